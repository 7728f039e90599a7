"""The Triton fused-experts kernel against the PyTorch grouped loop, on the CPU under TRITON_INTERPRET=1.

Kernel outputs are filled with NaN first, so a pair the kernel forgets to write fails. Shapes are tiny
and odd-sized (nothing a power of two) so every mask is exercised.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from services.worker.models import fused_moe  # noqa: E402
from services.worker.models.fused_moe import align_by_expert, fused_experts, grouped_matmul  # noqa: E402
from services.worker.models.moe import SparseMoeBlock, select_experts  # noqa: E402
from services.worker.tensor_parallel import TensorParallel  # noqa: E402
from services.worker.moe_config import MoEConfig  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the kernels on the CPU: they need TRITON_INTERPRET=1", allow_module_level=True)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _random_ids(tokens: int, top_k: int, num_experts: int, generator, unused: int | None = None) -> torch.Tensor:
    """Each token's k distinct experts, never ``unused``."""
    choices = [e for e in range(num_experts) if e != unused]
    rows = [torch.tensor(choices)[torch.randperm(len(choices), generator=generator)[:top_k]] for _ in range(tokens)]
    return torch.stack(rows)


@pytest.mark.parametrize("one_hot", [True, False])
@pytest.mark.parametrize("tokens, top_k, num_experts, block_m", [(1, 1, 3, 16), (5, 2, 4, 16), (40, 3, 7, 32)])
def test_alignment_groups_pairs_by_expert_in_padded_tiles(tokens, top_k, num_experts, block_m, one_hot,
                                                          monkeypatch):
    monkeypatch.setattr(fused_moe, "ONE_HOT_LIMIT", 1 << 30 if one_hot else 0)
    generator = torch.Generator().manual_seed(tokens)
    ids = _random_ids(tokens, top_k, num_experts, generator, unused=1)
    pairs, block_experts = align_by_expert(ids, num_experts, block_m)
    num_pairs = tokens * top_k
    assert pairs.numel() == block_experts.numel() * block_m
    assert pairs.numel() >= num_pairs + num_experts * (block_m - 1)
    flat = ids.flatten()
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    for tile, expert in enumerate(block_experts.tolist()):
        rows = pairs[tile * block_m:(tile + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert == num_experts:  # past the last group: padding only
            assert rows.numel() == 0
            continue
        assert expert != 1 and (flat[rows.long()] == expert).all()
        assert rows.tolist() == sorted(rows.tolist())
    assert block_experts.tolist() == sorted(block_experts.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_writes_every_pair(dtype):
    generator = torch.Generator().manual_seed(3)
    tokens, top_k, num_experts, k, n = 6, 2, 5, 40, 72
    ids = _random_ids(tokens, top_k, num_experts, generator)
    a = torch.randn(tokens, k, generator=generator).to(dtype)
    w = torch.randn(num_experts, n, k, generator=generator).to(dtype)
    weights = torch.rand(tokens * top_k, generator=generator)
    for rows_are_tokens in (True, False):
        rows = a if rows_are_tokens else torch.randn(tokens * top_k, k, generator=generator).to(dtype)
        c = torch.full((tokens * top_k, n), float("nan"), dtype=torch.float32)
        pairs, block_experts = align_by_expert(ids, num_experts, 16)
        grouped_matmul(rows, w, c, pairs, block_experts, weights, top_k, 16, rows_are_tokens)
        for p, e in enumerate(ids.flatten().tolist()):
            row = rows[p // top_k] if rows_are_tokens else rows[p]
            expected = row.float() @ w[e].float().T * (1.0 if rows_are_tokens else weights[p])
            torch.testing.assert_close(c[p], expected, atol=TOLERANCE[dtype] * 40, rtol=TOLERANCE[dtype])


def _block(num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool, float32_weights: bool,
           seed: int) -> SparseMoeBlock:
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter, renormalize=renormalize,
                    float32_weights=float32_weights, sparse_layers=(0,))
    block = SparseMoeBlock(hidden, moe, TensorParallel(), None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, top_k, num_experts", [(1, 2, 4), (9, 3, 6), (33, 2, 5), (70, 2, 4), (130, 2, 4)])
def test_fused_experts_equal_the_grouped_loop(tokens, top_k, num_experts, dtype, monkeypatch):
    # (70 and 130 tokens: tiles of 64 and 32 rows; 130 groups by sorting instead of the one-hot count.)
    if tokens == 130:
        monkeypatch.setattr(fused_moe, "ONE_HOT_LIMIT", 0)
    block = _block(num_experts, top_k, hidden=48, inter=40, renormalize=tokens % 2 == 1,
                   float32_weights=dtype == torch.float32, seed=tokens).to(dtype)
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens + 1)).to(dtype)
    with torch.no_grad():
        weights, ids = select_experts(block.gate(x), block.moe, dtype)
        expected = block.run_experts(x, weights, ids)
        out = fused_experts(x, block.w13, block.w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype] * scale * 4,
                               rtol=TOLERANCE[dtype] * 4)


def test_bad_inputs_are_refused():
    block = _block(4, 2, hidden=32, inter=16, renormalize=True, float32_weights=True, seed=0)
    x = torch.randn(3, 32)
    weights, ids = select_experts(block.gate(x), block.moe, x.dtype)
    with pytest.raises(ValueError, match="inputs' dtype"):
        fused_experts(x.double().float().half(), block.w13, block.w2, weights, ids)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 32\]"):
        fused_experts(torch.randn(3, 31), block.w13, block.w2, weights, ids)
    with pytest.raises(ValueError, match="tokens, top_k"):
        fused_experts(x, block.w13, block.w2, weights[:, :1], ids)


def test_a_model_with_fused_experts_matches_transformers(mixtral_dir, qwen2_moe_dir, qwen3_moe_dir):
    from transformers import AutoModelForCausalLM

    from services.worker.model_loader import load_model
    from tests.worker.test_model import PagedRunner, hf_logits, random_prompts

    for model_dir in (mixtral_dir, qwen2_moe_dir, qwen3_moe_dir):
        model, config = load_model(model_dir, torch.float32, torch.device("cpu"), pack=False)
        model.use_fused_experts()
        blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        assert blocks and all(block.fused for block in blocks)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
        long, short = random_prompts(config.vocab_size, [11, 1])
        out = PagedRunner(model, config).step({0: long, 1: short})
        torch.testing.assert_close(out[0], hf_logits(hf, long), atol=1e-4, rtol=0)
        torch.testing.assert_close(out[1], hf_logits(hf, short), atol=1e-4, rtol=0)


def test_the_engine_runs_experts_in_triton_with_the_triton_backend(mixtral_dir):
    from pagedserve import LLM, SamplingParams

    prompts = [[5, 17, 99, 3, 250, 41, 8, 77, 12], [42, 7, 19]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        # bfloat16: float32 experts on a CPU are packed for oneDNN and stay in the loop.
        llm = LLM(str(mixtral_dir), dtype="bfloat16", block_size=4, max_num_batched_tokens=8,
                  num_gpu_blocks_override=32, attention_backend=backend)
        blocks = [layer.mlp for layer in llm.engine.executor.worker.model.layers]
        assert all(block.fused == (backend == "triton") for block in blocks)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outputs]
    assert results["triton"] == results["torch"]


def test_warm_up_launches_every_tile_height_of_a_fused_model(qwen3_moe_dir, monkeypatch):
    from services.worker.kernel_warmup import _warm_up_experts
    from services.worker.model_loader import load_model

    model, _ = load_model(qwen3_moe_dir, torch.bfloat16, torch.device("cpu"))
    assert _warm_up_experts(model) == 0  # the grouped loop: nothing to compile
    model.use_fused_experts()
    launched = []
    real = fused_moe.fused_experts

    def recording(x, w13, w2, weights, ids, block_m=None):
        launched.append(block_m)
        return real(x, w13, w2, weights, ids, block_m)

    monkeypatch.setattr(fused_moe, "fused_experts", recording)
    with torch.no_grad():
        assert _warm_up_experts(model) == len(launched)
    # Every tile height a batch of any size can bring (the kernel does not specialize on the pair count).
    assert sorted(launched) == sorted({fused_moe.block_m_for(p, e) for p in range(1, 1 << 16) for e in (2, 8, 128)})
