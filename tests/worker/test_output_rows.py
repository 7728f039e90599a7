"""The last layer computes only the rows a step's outputs read (services/worker/output_rows.py): the same states for
those rows as a whole pass gives, in every architecture's layer shape, and the rows chosen right."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.worker.attention.torch_ref import TorchAttentionBackend
from services.worker.model_loader import load_model
from services.worker.output_rows import StepHidden, rows_read
from tests.attention_inputs import build_metadata

CPU = torch.device("cpu")
BLOCK_SIZE = 4
# Pre norms (Llama), MoE (Mixtral, Qwen2-MoE), sandwich norms (Gemma 2), post norms (OLMo 2), residual multipliers
# (Granite), NoPE layers (SmolLM3). (The transformers backend, which runs its layers whole and then takes the rows, is
# checked through the worker: tests/worker/test_transformers_backend.py.)
FIXTURES = ["llama_dir", "mixtral_dir", "qwen2_moe_dir", "gemma2_dir", "olmo2_dir", "granite_dir", "smollm3_dir"]


def run_step(model, config, lengths: list[int], cached: list[int], seed: int, output_rows=None) -> torch.Tensor:
    """One step over fresh pools: sequence i has ``cached[i]`` tokens in the cache (computed by an earlier step in the
    same call) and ``lengths[i]`` new ones."""
    generator = torch.Generator().manual_seed(seed)
    shape = (64, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    pools = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    backend = TorchAttentionBackend(pools, model.attention_spec())
    tokens = [torch.randint(0, config.vocab_size, (c + n,), generator=generator).tolist()
              for c, n in zip(cached, lengths)]
    tables, first = [], 0
    for c, n in zip(cached, lengths):
        blocks = -(-(c + n) // BLOCK_SIZE)
        tables.append(list(range(first + blocks - 1, first - 1, -1)))  # descending: not contiguous in order
        first += blocks
    with torch.inference_mode():
        if any(cached):  # the cached tokens, a step of their own
            earlier = [(table[:-(-c // BLOCK_SIZE)], 0, c) for table, c in zip(tables, cached) if c]
            ids = [t for seq, c in zip(tokens, cached) if c for t in seq[:c]]
            positions = [p for c in cached if c for p in range(c)]
            model(torch.tensor(ids), torch.tensor(positions), backend, build_metadata(earlier, BLOCK_SIZE))
        meta = build_metadata([(table, c, n) for table, c, n in zip(tables, cached, lengths)], BLOCK_SIZE)
        ids = [t for seq, c in zip(tokens, cached) for t in seq[c:]]
        positions = [p for c, n in zip(cached, lengths) for p in range(c, c + n)]
        return model(torch.tensor(ids), torch.tensor(positions), backend, meta, output_rows=output_rows)


def rows_each_layer_runs(model) -> list[int]:
    """Records how many rows each decoder layer's MLP gets."""
    seen = []
    for layer in model.layers:
        layer.mlp.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_last_layer_computes_the_rows_asked_for_as_a_whole_pass_does(fixture, request):
    model, config = load_model(request.getfixturevalue(fixture), torch.float32, CPU)
    lengths, cached = [7, 1, 5, 3], [0, 9, 4, 0]
    whole = run_step(model, config, lengths, cached, seed=1)
    rows = [0, 6, 7, 10, 11, 12, 15]  # a first row, sequences' last rows, a run of rows (drafts)
    seen = rows_each_layer_runs(model)
    part = run_step(model, config, lengths, cached, seed=1, output_rows=torch.tensor(rows))
    assert part.shape == (len(rows), config.hidden_size)
    torch.testing.assert_close(part, whole[rows], atol=1e-5, rtol=1e-5)
    layers = config.num_hidden_layers
    assert seen[-layers:] == [sum(lengths)] * (layers - 1) + [len(rows)]


def test_adapters_follow_their_tokens_into_the_output_rows(llama_dir, tmp_path):
    """With LoRA, the last layer's projections past attention take the mask's rows of the output rows."""
    from services.worker.lora_adapters import AdapterSlots
    from services.worker.tensor_parallel import TensorParallel
    from shared.lora import LoRARequest
    from tests.lora_adapters import make_adapter

    model, config = load_model(llama_dir, torch.float32, CPU)
    slots = AdapterSlots(model, num_slots=2, max_rank=8, tp=TensorParallel())
    one, two = (LoRARequest(name, str(make_adapter(llama_dir, tmp_path / name, seed=seed)))
                for name, seed in (("one", 1), ("two", 2)))
    assigned, failed = slots.slots_for([one, None, two])
    assert not failed
    lengths, rows = [5, 4, 6], torch.tensor([4, 8, 13, 14])
    slots.batch.set_token_slots(assigned, lengths)
    whole = run_step(model, config, lengths, [0, 0, 0], seed=3)
    slots.batch.set_token_slots(assigned, lengths)
    slots.batch.keep_output_rows(rows)
    part = run_step(model, config, lengths, [0, 0, 0], seed=3, output_rows=rows)
    torch.testing.assert_close(part, whole[rows], atol=1e-5, rtol=1e-5)
    slots.batch.clear()
    without = run_step(model, config, lengths, [0, 0, 0], seed=3, output_rows=rows)
    assert not torch.allclose(without[[0, 2, 3]], part[[0, 2, 3]], atol=1e-3), "the adapters changed nothing"
    torch.testing.assert_close(without[1], part[1], atol=1e-5, rtol=1e-5)  # (its sequence has none)
    slots.batch.set_token_slots(assigned, lengths)
    with pytest.raises(RuntimeError, match="a projection of 3 rows in a step of 15 tokens"):
        slots.batch.mask_for(3)


def seq(drafts: int = 0):
    return SimpleNamespace(draft_token_ids=[7] * drafts)


@pytest.mark.parametrize("prompt_rows, sampling, expected", [
    ([], [(0, seq()), (2, seq())], [3, 9]),  # two prompt chunks' last rows; sequence 1 is a partial chunk
    ([], [(1, seq(2))], [5, 6, 7]),  # a sequence verifying two drafts: its last three rows
    ([(0, None, 0, 3)], [(0, seq())], [0, 1, 2, 3]),  # prompt logprobs, then the chunk's sampled row
    ([(2, None, 8, 2)], [(2, seq())], [8, 9]),  # the two overlap: each row once
    ([], [], []),  # prompt chunks alone
])
def test_rows_read(prompt_rows, sampling, expected):
    assert rows_read([0, 4, 8, 10], prompt_rows, sampling) == expected


def test_step_hidden_takes_rows_by_their_step_numbers():
    states = torch.arange(12.0).view(4, 3)
    assert StepHidden(states, None).take([3, 1]).tolist() == [[9, 10, 11], [3, 4, 5]]
    part = StepHidden(states[[1, 3]], [5, 20])
    assert part.take([20, 5, 20]).tolist() == [[9, 10, 11], [3, 4, 5], [9, 10, 11]]
    with pytest.raises(KeyError):
        part.take([6])
