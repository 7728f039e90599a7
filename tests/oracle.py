"""The transformers oracle: greedy continuations and their logits, and the near-tie rule."""

from __future__ import annotations

import functools

import torch

NEAR_TIE_NATS = 1e-3


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    # Eager attention, always: some transformers releases (5.17) run Gemma 2 on SDPA, which drops its
    # score cap, and the oracle would be wrong (a GPU run found it).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # compare full lengths, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy(model_dir, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers generate, greedy: the new tokens and the log-softmax at each step."""
    return model_greedy(hf_model(str(model_dir)), prompt_token_ids, max_new_tokens)


def model_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """hf_greedy on a transformers model already built (one whose layers a test replaced)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_token_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0, return_dict_in_generate=True, output_logits=True)
    new = out.sequences[0, len(prompt_token_ids):].tolist()
    return new, [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]


def assert_greedy_equal(ours: list[int], ref: list[int], ref_logprobs: list[torch.Tensor], what: str = "") -> None:
    """Token for token; at the first divergence, accept it only as a near-tie (then stop comparing)."""
    for step, (mine, theirs) in enumerate(zip(ours, ref)):
        if mine != theirs:
            gap = abs(ref_logprobs[step][mine] - ref_logprobs[step][theirs]).item()
            assert gap <= NEAR_TIE_NATS, (
                f"{what}: diverged at step {step}: ours {mine}, transformers {theirs}, "
                f"logprob gap {gap:.2e} nats > {NEAR_TIE_NATS}")
            return
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens, transformers {len(ref)}"
