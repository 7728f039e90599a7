"""The FP8 KV cache (--kv-cache-dtype, services/worker/attention/kv_quant.py) in every backend, against
the reference attention over exactly what the cache holds: each code times its layer's scale. The cache must
hold kv_quant.quantize_kv's codes; block moves carry them as bytes; the engine holds more blocks in the same
memory, reads the checkpoint's scales, and stays close to the unquantized cache (mean KL reported)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.attention.kv_quant import KVScales, dequantize_kv, quantize_kv
from services.worker.attention.spec import AttentionSpec
from services.worker.attention.torch_ref import TorchAttentionBackend, paged_attention_reference, write_kv
from services.worker.block_moves import copy_blocks_torch, swap_blocks
from tests.attention_inputs import build_metadata

NAN = float("nan")
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _backend(name: str):
    if name == "torch":
        return TorchAttentionBackend
    if name == "cpu":
        from services.worker.attention.cpu_kernels import cpu_kernels_unavailable_reason

        if (reason := cpu_kernels_unavailable_reason()) is not None:
            pytest.skip(reason)
        from services.worker.attention.cpu_attention import CpuAttentionBackend
        return CpuAttentionBackend
    from services.worker.attention.triton_attention import TritonAttentionBackend
    return TritonAttentionBackend


def fp8_case(backend: str, kv_dtype: torch.dtype, batch: list[tuple[int, int]], *, dtype=torch.float32,
             softcap: float | None = None, windows: tuple = (), heads: int = 4, kv_heads: int = 2, dim: int = 32,
             block_size: int = 16, seed: int = 0, atol: float = 1e-4) -> None:
    """batch: (cached, new) tokens per sequence; two layers, each with its own scales."""
    generator = torch.Generator().manual_seed(seed)
    scales = KVScales(tuple((torch.rand(2, generator=generator) * 3 + 0.25).tolist()),
                      tuple((torch.rand(2, generator=generator) * 3 + 0.25).tolist()))
    num_blocks = sum(-(-(c + n) // block_size) for c, n in batch) + 3
    free = torch.randperm(num_blocks, generator=generator).tolist()
    seqs = [([free.pop() for _ in range(-(-(c + n) // block_size))], c, n) for c, n in batch]
    shape = (num_blocks, block_size, kv_heads, dim)

    def randn(*size):
        return (torch.randn(*size, generator=generator) * 4).to(dtype)

    # Unowned slots hold finite garbage codes; the cached prefix, real codes.
    pools = [tuple(quantize_kv(randn(*shape), 1.0, kv_dtype) for _ in "kv") for _ in range(2)]
    prefix = [(t[:-(-c // block_size)], 0, c) for t, c, _ in seqs if c]
    if prefix:
        meta = build_metadata(prefix, block_size)
        for layer, (k_cache, v_cache) in enumerate(pools):
            ks, vs = scales.of(layer)
            write_kv(k_cache, v_cache, quantize_kv(randn(meta.num_tokens, kv_heads, dim), ks, kv_dtype),
                     quantize_kv(randn(meta.num_tokens, kv_heads, dim), vs, kv_dtype), meta.slot_mapping)
    meta = build_metadata(seqs, block_size)
    spec = AttentionSpec(dim ** -0.5, windows, softcap)
    inputs, expected = [], []
    for layer, (k_cache, v_cache) in enumerate(pools):
        ks, vs = scales.of(layer)
        q, k, v = (randn(meta.num_tokens, h, dim) for h in (heads, kv_heads, kv_heads))
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        write_kv(ref_k, ref_v, quantize_kv(k, ks, kv_dtype), quantize_kv(v, vs, kv_dtype), meta.slot_mapping)
        want = paged_attention_reference(q.float(), dequantize_kv(ref_k, ks, torch.float32),
                                         dequantize_kv(ref_v, vs, torch.float32), meta, spec.scale,
                                         window=spec.window(layer), softcap=softcap)
        inputs.append((q, k, v))
        expected.append((want, ref_k, ref_v))
        # The slots the backend must write hold NaN codes: a missed write, or a read before it, shows.
        nan = torch.full((meta.num_tokens, kv_heads, dim), NAN).to(kv_dtype)
        write_kv(k_cache, v_cache, nan, nan, meta.slot_mapping)
    attention = _backend(backend)(pools, spec, kv_scales=scales)
    for layer in range(2):
        out = attention.forward(layer, *inputs[layer], meta)
        want, ref_k, ref_v = expected[layer]
        assert out.dtype == dtype and torch.isfinite(out).all(), f"layer {layer}"
        torch.testing.assert_close(out.float(), want, atol=atol, rtol=atol, msg=lambda m: f"layer {layer}: {m}")
        for got, ref in zip(pools[layer], (ref_k, ref_v)):  # the same codes as quantize_kv, bit for bit
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), f"layer {layer}: cache codes"


MIXED = [(0, 1), (37, 1), (16, 1), (0, 21), (40, 9), (3, 1)]  # decodes, a first prefill, a chunk after a prefix


@pytest.mark.parametrize("kv_dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_cpu_backends_attend_over_the_codes_times_their_scales(backend, kv_dtype):
    fp8_case(backend, kv_dtype, MIXED)
    fp8_case(backend, kv_dtype, MIXED, softcap=5.0, windows=(12, None), seed=1)
    fp8_case(backend, kv_dtype, [(30, 1), (70, 1), (5, 1)], dtype=torch.bfloat16, atol=3e-2, seed=2)


@pytest.mark.parametrize("kv_dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_the_cpu_kernel_decodes_every_code_as_torch_does(kv_dtype):
    """With one key, attention returns its value row: every finite code, through the C++ kernel's decoding."""
    from services.worker.attention.cpu_kernels import cpu_kernels_unavailable_reason, paged_decode_attention

    if (reason := cpu_kernels_unavailable_reason()) is not None:
        pytest.skip(reason)
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype)
    codes = codes[torch.isfinite(codes.float())]
    dim = 64
    codes = torch.cat([codes, codes[:(-len(codes)) % dim]]).view(-1, 1, 1, dim)  # a row of 64 per block
    n = codes.shape[0]
    value_cache = codes.expand(n, 16, 1, dim).contiguous()
    key_cache = torch.zeros_like(value_cache)
    out = torch.full((n, 1, dim), NAN)
    paged_decode_attention(out, torch.randn(n, 1, dim), key_cache, value_cache, torch.arange(n, dtype=torch.int32)
                           .view(n, 1), torch.ones(n, dtype=torch.int32), torch.arange(n), torch.arange(n), 1.0,
                           v_scale=0.75)
    assert torch.equal(out.view(n, dim), codes.view(n, dim).float() * 0.75)


@pytest.mark.parametrize("kv_dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_triton_backend_attends_over_the_codes_times_their_scales(kv_dtype):
    fp8_case("triton", kv_dtype, [(0, 1), (19, 1), (0, 9), (17, 4)], dim=16)


def test_block_moves_carry_fp8_codes_as_bytes():
    pool = quantize_kv(torch.randn(2, 2, 6, 4, 2, 8) * 50, 1.0, torch.float8_e4m3fn)
    before = pool.clone()
    copy_blocks_torch(pool, [(0, 3), (5, 1)])
    assert torch.equal(pool[:, :, 3].view(torch.uint8), before[:, :, 0].view(torch.uint8))
    assert torch.equal(pool[:, :, 1].view(torch.uint8), before[:, :, 5].view(torch.uint8))
    host = torch.zeros(2, 2, 3, 4, 2, 8).to(torch.float8_e4m3fn)
    swap_blocks(pool, host, [(2, 0)])
    assert torch.equal(host[:, :, 0].view(torch.uint8), pool[:, :, 2].view(torch.uint8))
    from services.worker.attention.triton_cache_ops import copy_blocks

    copy_blocks(pool, [(4, 0)])
    assert torch.equal(pool[:, :, 0].view(torch.uint8), pool[:, :, 4].view(torch.uint8))


def test_the_engine_holds_more_blocks_reads_the_checkpoint_scales_and_stays_close(llama_dir, tmp_path):
    from pagedserve import LLM, SamplingParams

    # The checkpoint's scales, in llm-compressor's and in older FP8 checkpoints' names.
    scaled = tmp_path / "scaled"
    shutil.copytree(llama_dir, scaled)
    tensors = load_file(scaled / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.25])
    save_file(tensors, scaled / "model.safetensors")
    prompts = [[3 + (5 * i + 13 * j) % 500 for j in range(n)] for i, n in enumerate((12, 30, 7))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)
    blocks, outputs = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(scaled), kv_cache_memory_bytes=1 << 20, kv_cache_dtype=kv)
        try:
            worker = llm.engine.executor.worker
            blocks[kv] = worker.num_blocks
            outputs[kv] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            if kv == "fp8":
                assert worker.kv_pool.dtype == torch.float8_e4m3fn
                assert worker.attention.kv_scales == KVScales((0.5, 1.0), (1.0, 0.25))
        finally:
            llm.close()
    assert blocks["fp8"] == 4 * blocks["auto"]  # float32 model: a quarter of the bytes per block
    # Against the float32 cache, on the same tokens (the first step's distributions): mean KL, bounded loosely.
    kls = []
    for ours, ref in zip(outputs["fp8"], outputs["auto"]):
        first_ours, first_ref = ours.outputs[0].logprobs[0], ref.outputs[0].logprobs[0]
        shared = set(first_ours) & set(first_ref)
        kls.append(sum(torch.tensor(first_ref[t].logprob).exp() * (first_ref[t].logprob - first_ours[t].logprob)
                       for t in shared).item())
    print(f"FP8 (e4m3) KV cache: mean KL of first-token distributions from the float32 cache {sum(kls) / len(kls):.2e}")
    assert all(abs(kl) < 0.05 for kl in kls)


def test_scales_measured_from_the_first_batch_stay_fixed(llama_dir):
    from pagedserve import LLM, SamplingParams
    from services.worker.attention.kv_quant import MeasuredKVScales
    from shared.config import EngineConfig

    scales = MeasuredKVScales(2, torch.float8_e4m3fn)
    k, v = torch.tensor([[-896.0, 2.0]]), torch.tensor([[4.48, -1.0]])
    first = scales.of_step(1, k, v)
    assert first == pytest.approx((2.0, 0.01), rel=1e-6)  # the largest magnitude lands on e4m3's largest, 448
    assert scales.of_step(1, k * 10, v * 10) == first and scales.found[0] is None
    with pytest.raises(ValueError, match="calculate_kv_scales needs an FP8 kv_cache_dtype"):
        EngineConfig(calculate_kv_scales=True)
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 20, kv_cache_dtype="fp8", calculate_kv_scales=True)
    try:
        measured = llm.engine.executor.worker.attention.kv_scales
        assert measured.found == [None, None]
        out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(temperature=0.0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert all(found is not None and found != (1.0, 1.0) for found in measured.found)
        first = list(measured.found)
        llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert measured.found == first
    finally:
        llm.close()
