"""Architectures with no native model, run through transformers' own modelling code over the paged KV
cache (--model-impl transformers): greedy outputs equal transformers' generate through chunked prefill,
preemption, forks and prefix-cache hits; a native architecture on this path equals its native path; what
the path cannot serve is refused by name."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve import LLM, SamplingParams
from services.worker.models.transformers_model import TransformersCausalLM
from tests.generic_models import GENERIC_ARCHS, make_generic_model
from shared.lora import LoRARequest
from tests.kv_release import count_releases, preempted_or_released
from tests.lora_adapters import make_adapter, merged_model
from tests.oracle import assert_greedy_equal, hf_greedy
from tests.scheduler.test_engine_oracle import MAX_TOKENS, blocks_to_force_preemption, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def generic_dir(tmp_path_factory):
    made = {}

    def make(model_type: str):
        if model_type not in made:
            made[model_type] = make_generic_model(tmp_path_factory.mktemp(model_type), model_type)
        return made[model_type]

    return make


def _assert_equals_transformers(model_dir, prompts, outputs, what: str) -> None:
    for prompt, out in zip(prompts, outputs):
        ref, ref_logprobs = hf_greedy(model_dir, prompt, MAX_TOKENS)
        for sample in out.outputs:
            assert_greedy_equal(sample.token_ids, ref, ref_logprobs, f"{what}, prompt of {len(prompt)}")


@pytest.mark.parametrize("model_type", list(GENERIC_ARCHS))
def test_greedy_equals_transformers_through_its_own_code(model_type, generic_dir):
    model_dir = generic_dir(model_type)
    prompts = random_prompts(seed=8)
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=48, enable_chunked_prefill=True,
              num_gpu_blocks_override=blocks_to_force_preemption(8))
    try:
        assert isinstance(llm.engine.executor.worker.model, TransformersCausalLM)  # auto chose it
        released = count_releases(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert preempted_or_released(llm, released, 8), "the KV budget was meant to force preemption"
        assert llm.stats()["kv_blocks_used"] == 0
        _assert_equals_transformers(model_dir, prompts, outputs, model_type)
    finally:
        llm.close()


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_forks_prefix_hits_and_both_preemptions(preemption_mode, generic_dir):
    model_dir = generic_dir("gpt_bigcode")  # one KV head for all
    prompts = random_prompts(seed=9)[2:]
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=48, preemption_mode=preemption_mode,
              num_gpu_blocks_override=blocks_to_force_preemption(8))
    try:
        forked = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)  # copy-on-write forks
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], forked, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
        once = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
        hits = llm.stats()["prefix_cache_hits"]
        again = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)  # its blocks, just freed
        assert llm.stats()["prefix_cache_hits"] > hits
        _assert_equals_transformers(model_dir, prompts, first, "forked")
        _assert_equals_transformers(model_dir, prompts[:1] * 2, once + again, "again")
    finally:
        llm.close()


def test_a_native_architecture_on_the_generic_path_equals_its_native_path(llama_dir):
    prompts = random_prompts(seed=10)[1:4]
    outputs = {}
    for impl in ("native", "transformers"):
        llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=48, model_impl=impl)
        try:
            outputs[impl] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
        finally:
            llm.close()
    for prompt, native, generic in zip(prompts, outputs["native"], outputs["transformers"]):
        ref, ref_logprobs = hf_greedy(llama_dir, prompt, MAX_TOKENS)
        assert_greedy_equal(native, ref, ref_logprobs, "native")
        assert_greedy_equal(generic, ref, ref_logprobs, "transformers")


def test_lora_adapters_apply_by_transformers_module_names(generic_dir, tmp_path):
    """Each prompt with its own adapter, or none, in one batch: each equals transformers on the base
    weights with that adapter merged in."""
    model_dir = generic_dir("cohere")
    adapters = {seed: make_adapter(model_dir, tmp_path / f"a{seed}", rank=4, alpha=8, seed=seed, std=0.2)
                for seed in (1, 2)}
    merged = {seed: merged_model(model_dir, path, tmp_path / f"m{seed}") for seed, path in adapters.items()}
    prompts = random_prompts(seed=11)[1:4]
    loras = [LoRARequest("one", str(adapters[1])), None, LoRARequest("two", str(adapters[2]))]
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=4, block_size=8, max_num_batched_tokens=48)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    finally:
        llm.close()
    for prompt, lora, out in zip(prompts, loras, outputs):
        reference = model_dir if lora is None else merged[1 if lora.name == "one" else 2]
        _assert_equals_transformers(reference, [prompt], [out], f"adapter {lora and lora.name}")
    base = [o.outputs[0].token_ids for o in outputs]
    assert base[0] != hf_greedy(model_dir, prompts[0], MAX_TOKENS)[0], "the adapter was meant to change the output"


def _config_only(path, model_type: str, **fields):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **fields).save_pretrained(path)
    return path


@pytest.mark.parametrize("case, says", [
    ("t5", "encoder-decoder"),
    ("bloom", "ALiBi"),
    ("falcon", "attention does not go through transformers' attention interface"),
    ("remote", "needs the repository's own Python code"),
    ("native gpt2", "--model-impl transformers (or auto) runs it"),
    ("tensor parallel", "tensor parallelism with --model-impl transformers"),
    ("quantization", "--quantization fp8 with --model-impl transformers"),
])
def test_what_the_transformers_path_cannot_serve_is_refused_at_start(case, says, tmp_path, generic_dir):
    options = {}
    if case in ("t5", "bloom", "falcon"):
        model_dir = _config_only(tmp_path, case)
    elif case == "remote":
        model_dir = tmp_path
        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "my_own_lm", "architectures": ["MyOwnForCausalLM"],
            "auto_map": {"AutoModelForCausalLM": "modeling_my_own.MyOwnForCausalLM"}}))
    else:
        model_dir = generic_dir("gpt2")
        options = {"native gpt2": {"model_impl": "native"}, "tensor parallel": {"tensor_parallel_size": 2},
                   "quantization": {"quantization": "fp8"}}[case]
    with pytest.raises(ValueError, match=re.escape(says)):
        LLM(str(model_dir), **options)


REMOTE_CONFIG = '''
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
REMOTE_MODEL = '''
from transformers import LlamaForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
'''


def test_a_checkpoints_own_code_runs_with_trust_remote_code(llama_dir, tmp_path):
    """A repository that ships its model's Python (auto_map): refused without --trust-remote-code, served
    with it, equal to transformers running the same code."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "remote"
    shutil.copytree(llama_dir, model_dir)
    (model_dir / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    (model_dir / "modeling_tiny_remote.py").write_text(REMOTE_MODEL)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        LLM(str(model_dir))
    prompt = random_prompts(seed=12)[2]
    llm = LLM(str(model_dir), trust_remote_code=True, block_size=8)
    try:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    finally:
        llm.close()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    assert type(reference).__name__ == "TinyRemoteForCausalLM"
    with torch.no_grad():
        ref = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True)
    assert_greedy_equal(out.outputs[0].token_ids, ref.sequences[0, len(prompt):].tolist(),
                        [torch.log_softmax(step[0].float(), -1) for step in ref.logits], "remote code")


@pytest.mark.parametrize("family, placeholder", [("llava_dir", "<image>"),
                                                 ("qwen2_vl_dir", "<|vision_start|><|image_pad|><|vision_end|>"),
                                                 ("gemma3_multimodal_dir", "<start_of_image>")])
def test_images_through_transformers_own_code(family, placeholder, request):
    """A vision-language checkpoint on this path: the image encoder shares transformers' own vision modules, its
    features go in as embeddings, Qwen2-VL's M-RoPE positions and Gemma 3's both-way attention as natively, and a
    chunk budget puts text and images in separate steps."""
    from tests.images import hf_greedy_with_images, picture

    from services.worker.models.lora_linear import LoRALinear
    from services.worker.models.packed_linear import PackedLinear

    model_dir = request.getfixturevalue(family)
    llm = LLM(str(model_dir), model_impl="transformers", block_size=4, num_gpu_blocks_override=128,
              max_num_batched_tokens=7, enable_chunked_prefill=True, enable_lora=True, max_lora_rank=8)
    try:
        worker = llm.engine.executor.worker
        assert isinstance(worker.model, TransformersCausalLM)
        shared = {id(p) for p in worker.model.hf.parameters()}
        vision = worker.image_encoder.vision
        assert all(id(p) in shared for p in vision.parameters())  # no weight held twice
        # Adapters and packing are the language model's: an adapter's rows are the step's tokens, not patches.
        assert not any(isinstance(m, (LoRALinear, PackedLinear)) for m in vision.modules())
        assert any(isinstance(m, LoRALinear) for m in worker.model.hf.modules())
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        for text, images in ((f"What is {placeholder} here?", [picture(1)]),
                             (f"Compare {placeholder} with {placeholder} now.", [picture(2, (60, 30)),
                                                                                picture(3, (100, 100))])):
            tokens = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params,
                                  use_tqdm=False)[0].outputs[0].token_ids
            assert_greedy_equal(tokens, *hf_greedy_with_images(model_dir, text, images), what=f"{family}: {text}")
    finally:
        llm.close()
