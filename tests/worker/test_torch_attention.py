"""The CPU backends against paged_attention_reference (the oracle): TorchAttentionBackend (pure
PyTorch) and CpuAttentionBackend (its decodes in the C++ kernel). Every test runs both."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention import torch_ref
from services.worker.attention import cpu_kernels
from services.worker.attention.cpu_kernels import cpu_kernels_unavailable_reason
from services.worker.attention.spec import AttentionSpec
from services.worker.attention.torch_ref import TorchAttentionBackend, paged_attention_reference, write_kv
from tests.attention_inputs import build_metadata, with_image_spans

NAN = float("nan")


@pytest.fixture(params=["torch", "cpu-blocked", "cpu-two-pass"])
def backend(request, monkeypatch) -> type:
    """The torch backend, or the C++ one with its decodes reading K and V a block at a time or in two passes
    (cpu_kernels.decode_reads_blocks picks one by CPU; each CPU runs both here)."""
    if request.param == "torch":
        return TorchAttentionBackend
    reason = cpu_kernels_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from services.worker.attention.cpu_attention import CpuAttentionBackend
    monkeypatch.setattr(cpu_kernels, "decode_reads_blocks", lambda dtype: request.param == "cpu-blocked")
    return CpuAttentionBackend


def run_case(batch: list[tuple[int, int]], backend: type, *, heads: int = 8, kv_heads: int = 4, dim: int = 64,
             block_size: int = 16, dtype: torch.dtype = torch.float32, layers: int = 2,
             order: str = "random", seed: int = 0, atol: float = 1e-5, rtol: float = 1e-5,
             monkeypatch: pytest.MonkeyPatch | None = None, windows: tuple[int | None, ...] = (),
             softcap: float | None = None, images: bool = False) -> None:
    """batch: (cached, new) tokens per sequence. Every layer of one step is checked against the oracle;
    ``windows``: per layer (AttentionSpec's), ``softcap`` for all; ``images``: spans of new tokens that see each
    other both ways (Gemma 3's images)."""
    generator = torch.Generator().manual_seed(seed)
    needed = sum(-(-(c + n) // block_size) for c, n in batch)
    num_blocks = needed + 5
    if order == "reverse":  # each sequence's blocks descend through the pool
        free = list(range(num_blocks))
    else:
        free = torch.randperm(num_blocks, generator=generator).tolist()
    seqs = []
    for cached, new in batch:
        seqs.append(([free.pop() for _ in range(-(-(cached + new) // block_size))], cached, new))
    shape = (num_blocks, block_size, kv_heads, dim)

    def randn(*size):
        return torch.randn(*size, generator=generator).to(dtype)

    # Slots no sequence owns, and the unwritten tail of every last block, hold large finite garbage.
    pools = [(randn(*shape) * 100, randn(*shape) * 100) for _ in range(layers)]
    cached = [(t[:-(-c // block_size)], 0, c) for t, c, _ in seqs if c]
    if cached:
        prefix = build_metadata(cached, block_size)
        for k_cache, v_cache in pools:
            write_kv(k_cache, v_cache, randn(prefix.num_tokens, kv_heads, dim),
                     randn(prefix.num_tokens, kv_heads, dim), prefix.slot_mapping)

    meta = build_metadata(seqs, block_size)
    if images:
        meta = with_image_spans(meta, generator)
    spec = AttentionSpec(dim ** -0.5, windows, softcap)
    inputs, expected = [], []
    for layer, (k_cache, v_cache) in enumerate(pools):
        q, k, v = (randn(meta.num_tokens, h, dim) for h in (heads, kv_heads, kv_heads))
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        write_kv(ref_k, ref_v, k, v, meta.slot_mapping)
        inputs.append((q, k, v))
        want = paged_attention_reference(q, ref_k, ref_v, meta, spec.scale, window=spec.window(layer), softcap=softcap)
        expected.append((want, ref_k, ref_v))
        # Poison the slots the backend must write: a missed write (or a read before it) shows up as NaN.
        write_kv(k_cache, v_cache, torch.full_like(k, NAN), torch.full_like(v, NAN), meta.slot_mapping)

    attention = backend(pools, spec)
    if monkeypatch is not None:  # every output row must be written: the output starts as NaN
        empty_like = torch.empty_like
        monkeypatch.setattr(torch_ref.torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(NAN))
    outputs = [attention.forward(layer, *inputs[layer], meta) for layer in range(layers)]
    if monkeypatch is not None:
        monkeypatch.undo()
    for layer, (out, (want, ref_k, ref_v)) in enumerate(zip(outputs, expected)):
        assert out.dtype == dtype and out.shape == want.shape
        assert torch.isfinite(out).all(), f"layer {layer}: NaN/inf in the output"
        torch.testing.assert_close(out, want, atol=atol, rtol=rtol, msg=lambda m: f"layer {layer}: {m}")
        torch.testing.assert_close(pools[layer][0], ref_k, equal_nan=True)
        torch.testing.assert_close(pools[layer][1], ref_v, equal_nan=True)


DECODE_LENGTHS = [0, 15, 16, 31, 32, 48, 1, 200, 3, 95, 96, 500, 7, 64]  # cached; each decodes one more


@pytest.mark.parametrize("order", ["random", "reverse"])
def test_decode_very_different_lengths(backend, order, monkeypatch):
    # 1-token contexts, exact block multiples (15 + 1), one token into a new block (16 + 1).
    run_case([(c, 1) for c in DECODE_LENGTHS], backend, order=order, monkeypatch=monkeypatch)


def test_decode_many_small_chunks(backend, monkeypatch):
    # A tiny byte budget forces one chunk per few sequences; the plan is reused by both layers.
    monkeypatch.setattr(torch_ref, "DECODE_CHUNK_BYTES", 40 * 1024)
    lengths = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    run_case([(c, 1) for c in lengths], backend, seed=3, monkeypatch=monkeypatch)


def test_decode_equal_lengths_no_mask(backend, monkeypatch):
    run_case([(31, 1)] * 5 + [(63, 1)] * 3, backend, monkeypatch=monkeypatch)


def test_sequence_without_new_tokens(backend, monkeypatch):
    # Decode-only, but rows are not sequences.
    run_case([(5, 1), (20, 0), (33, 1)], backend, monkeypatch=monkeypatch)
    run_case([(5, 3), (20, 0), (33, 1)], backend, monkeypatch=monkeypatch)


def test_mixed_prefill_and_decode(backend, monkeypatch):
    # A first chunk, decodes, chunks after cached full blocks and after a partial block.
    run_case([(0, 37), (9, 1), (32, 16), (20, 7), (0, 1), (100, 1), (5, 2), (48, 33)], backend,
             monkeypatch=monkeypatch)


@pytest.mark.parametrize("batch", [
    [(16, 5)], [(17, 16)], [(64, 64)], [(3, 100)], [(160, 3), (1, 2)],  # prefill after cached blocks
    [(0, 2)], [(0, 16)], [(0, 77)], [(0, 40), (0, 3), (0, 16)],  # first chunks, no cache
])
def test_prefill(backend, batch, monkeypatch):
    run_case(batch, backend, monkeypatch=monkeypatch, order="reverse")


@pytest.mark.parametrize("per_call", [False, True])
def test_images_attending_both_ways(backend, per_call, monkeypatch):
    """Spans of new tokens that see each other both ways, first chunks and after cached blocks, with and without
    sliding windows, beside decodes; masks kept per step, or built per call."""
    if per_call:
        monkeypatch.setattr(torch_ref, "MASK_KEEP_ELEMENTS", 0)
    for seed in range(3):
        run_case([(0, 20), (16, 9), (7, 1), (0, 2), (33, 30)], backend, windows=(None, 12), seed=seed, images=True,
                 monkeypatch=monkeypatch)


def test_prefill_mask_built_per_call(backend, monkeypatch):
    monkeypatch.setattr(torch_ref, "MASK_KEEP_ELEMENTS", 0)  # the large-prefill path
    monkeypatch.setattr(torch_ref, "WORKSPACE_KEEP_ELEMENTS", 0)  # buffers not kept
    run_case([(40, 30), (7, 1), (0, 9)], backend, monkeypatch=monkeypatch)


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (8, 1), (6, 2)])
def test_gqa_ratios(backend, heads, kv_heads, monkeypatch):
    run_case([(c, 1) for c in DECODE_LENGTHS[:8]], backend, heads=heads, kv_heads=kv_heads, dim=32, seed=1,
             monkeypatch=monkeypatch)
    run_case([(0, 20), (30, 1), (17, 12), (4, 1)], backend, heads=heads, kv_heads=kv_heads, dim=32, seed=2,
             monkeypatch=monkeypatch)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_sizes(backend, block_size, monkeypatch):
    run_case([(0, 9), (12, 1), (5, 6), (31, 1), (0, 1)], backend, block_size=block_size, seed=4,
             monkeypatch=monkeypatch)


def test_bfloat16(backend, monkeypatch):
    run_case([(c, 1) for c in DECODE_LENGTHS], backend, dtype=torch.bfloat16, atol=2e-2, rtol=2e-2, seed=5,
             monkeypatch=monkeypatch)
    run_case([(0, 37), (9, 1), (32, 16), (20, 7), (48, 33)], backend, dtype=torch.bfloat16, atol=2e-2, rtol=2e-2,
             seed=6, monkeypatch=monkeypatch)


# Windows of 1 (a query sees only itself), under a block, a block exactly, across blocks, and longer than
# every context; each beside a full layer in the same step, so both plans live side by side.
WINDOWS = [1, 5, 16, 37, 1000]


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_decodes(backend, window, monkeypatch):
    run_case([(c, 1) for c in DECODE_LENGTHS], backend, windows=(window, None), monkeypatch=monkeypatch)


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_prefill_and_mixed(backend, window, monkeypatch):
    # First chunks longer and shorter than the window, chunks after a cached prefix the window cuts.
    run_case([(0, 37), (9, 1), (32, 16), (20, 7), (0, 3), (100, 1), (5, 2), (48, 33)], backend,
             windows=(None, window), seed=window, monkeypatch=monkeypatch)


def test_sliding_window_with_masks_built_per_call_and_small_chunks(backend, monkeypatch):
    monkeypatch.setattr(torch_ref, "MASK_KEEP_ELEMENTS", 0)
    monkeypatch.setattr(torch_ref, "DECODE_CHUNK_BYTES", 40 * 1024)
    lengths = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    run_case([(c, 1) for c in lengths] + [(0, 40), (60, 20)], backend, windows=(24, 24), seed=8,
             monkeypatch=monkeypatch)


@pytest.mark.parametrize("windows", [(), (9, None)])
def test_soft_capped_scores(backend, windows, monkeypatch):
    # A cap of 2 bends nearly every score (they reach about ±8 here): a missed cap cannot pass.
    run_case([(c, 1) for c in DECODE_LENGTHS[:8]] + [(0, 37), (32, 16)], backend, heads=8, kv_heads=2, dim=32,
             softcap=2.0, windows=windows, seed=9, monkeypatch=monkeypatch)
    run_case([(0, 20), (17, 12), (4, 1)], backend, dtype=torch.bfloat16, atol=2e-2, rtol=2e-2, softcap=2.0,
             windows=windows, seed=10, monkeypatch=monkeypatch)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [8, 6, 2])
def test_decodes_over_many_blocks_with_caps_and_windows(backend, dim, dtype, tolerance, heads, monkeypatch):
    """The head sizes the CPU kernel runs a block at a time under an online softmax (AVX-512, AVX2): contexts of many
    blocks (each block's sweeps prefetching two blocks on), a window starting inside a block, a cap that bends
    nearly every score; many decodes (all KV heads per work item) and few (one KV head each); groups of 4, 3 and 1
    query heads per KV head (the sweeps take them in pairs, then one)."""
    for batch in ([(c, 1) for c in DECODE_LENGTHS], [(150, 1), (61, 1), (33, 1)]):
        run_case(batch, backend, heads=heads, kv_heads=2, dim=dim, dtype=dtype, softcap=2.0, windows=(None, 37),
                 seed=dim + heads, atol=tolerance, rtol=tolerance, monkeypatch=monkeypatch)


def test_soft_capped_scores_a_few_queries_at_a_time(backend, monkeypatch):
    from services.worker.attention import sdpa

    monkeypatch.setattr(sdpa, "SCORES_ELEMENTS", 200)  # a handful of query rows per slice
    run_case([(0, 37), (32, 16), (5, 1), (0, 9)], backend, heads=4, kv_heads=2, dim=16, softcap=2.0,
             windows=(7, None), seed=11, monkeypatch=monkeypatch)


def test_new_step_gets_new_plan(backend):
    """The per-step plan is keyed by the metadata object: a second step must not reuse the first's."""
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    generator = torch.Generator().manual_seed(7)
    shape = (8, block_size, kv_heads, dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    attention = backend([(k_cache, v_cache)], AttentionSpec(dim ** -0.5))
    for seqs in ([([0, 1], 5, 1), ([2], 1, 1)], [([0, 1], 6, 1), ([2], 2, 1)], [([3, 4], 3, 5)]):
        meta = build_metadata(seqs, block_size)
        q = torch.randn(meta.num_tokens, heads, dim, generator=generator)
        k, v = (torch.randn(meta.num_tokens, kv_heads, dim, generator=generator) for _ in range(2))
        out = attention.forward(0, q, k, v, meta)
        expected = paged_attention_reference(q, k_cache, v_cache, meta, scale=dim ** -0.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_refuses_indices_outside_its_tensors():
    reason = cpu_kernels_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from services.worker.attention.cpu_kernels import paged_decode_attention

    pool = torch.zeros(4, 2, 1, 8)  # 4 blocks of 2 tokens, one KV head of 8
    q, out = torch.randn(2, 2, 8), torch.full((2, 2, 8), NAN)
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    rows, seqs = torch.tensor([0, 1]), torch.tensor([0, 1])
    paged_decode_attention(out, q, pool, pool, tables, lens, rows, seqs, 1.0)  # fine
    assert torch.isfinite(out).all()
    cases = [
        (IndexError, "block id 7", dict(tables=torch.tensor([[0, 7], [2, 3]], dtype=torch.int32))),
        (IndexError, "row 2", dict(rows=torch.tensor([0, 2]))),
        (IndexError, "sequence 5", dict(seqs=torch.tensor([0, 5]))),
        (ValueError, "context length 0", dict(lens=torch.tensor([0, 4], dtype=torch.int32))),
        (ValueError, "context length 5", dict(lens=torch.tensor([5, 4], dtype=torch.int32))),
    ]
    for error, message, change in cases:
        args = dict(tables=tables, lens=lens, rows=rows, seqs=seqs) | change
        with pytest.raises(error, match=message):
            paged_decode_attention(out, q, pool, pool, args["tables"], args["lens"], args["rows"], args["seqs"], 1.0)


def count_prefill_kernel_calls(monkeypatch, *, amx: bool) -> list[int]:
    """The context length of each call the CPU backend makes to the prefill kernel from now on, with the CPU
    taken to have AMX or not (skips where the kernel is not built)."""
    if cpu_kernels_unavailable_reason() is not None:
        pytest.skip(cpu_kernels_unavailable_reason())
    from services.worker.attention import cpu_attention

    if not cpu_attention.has_prefill_attention():
        pytest.skip("the CPU kernels were built without AVX-512 or AVX2")
    calls = []
    kernel = cpu_attention.prefill_attention
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda *args: (calls.append(args[5]), kernel(*args)))
    monkeypatch.setattr(cpu_attention, "sdpa_multiplies_on_amx", lambda: amx)
    return calls


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [8, 6, 2])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefills_in_the_cpu_kernel(dim, heads, dtype, tolerance, monkeypatch):
    """The C++ prefill kernel (csrc/prefill_attention.cpp) takes every causal prefill of the step: first chunks
    and chunks after a cached prefix, across many tiles of rows and keys (16 rows x 16 keys with
    AVX-512, 8 x 12 with AVX2), with prefixes that end mid-tile,
    beside decodes; groups of 4, 3 and 1 query heads per KV head."""
    from services.worker.attention.cpu_attention import CpuAttentionBackend

    calls = count_prefill_kernel_calls(monkeypatch, amx=False)  # (the kernel, on any CPU)
    batch = [(0, 70), (45, 33), (0, 17), (100, 1), (3, 16), (16, 50), (0, 2)]
    run_case(batch, CpuAttentionBackend, heads=heads, kv_heads=2, dim=dim, dtype=dtype, seed=dim + heads,
             atol=tolerance, rtol=tolerance)
    assert sorted(calls) == sorted(2 * [c + n for c, n in batch if n > 1])  # 2 layers, every prefill


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_bfloat16_prefills_go_to_sdpa_where_the_cpu_has_amx(dtype, tolerance, monkeypatch):
    from services.worker.attention.cpu_attention import CpuAttentionBackend

    calls = count_prefill_kernel_calls(monkeypatch, amx=True)
    batch = [(0, 40), (21, 19), (30, 1)]
    run_case(batch, CpuAttentionBackend, heads=4, kv_heads=2, dim=64, dtype=dtype, seed=7, atol=tolerance,
             rtol=tolerance)
    assert len(calls) == (0 if dtype == torch.bfloat16 else 4)  # float32: the kernel still, 2 layers x 2


def test_prefill_kernel_reads_strided_rows_and_refuses_bad_input():
    """New K/V as the model hands them (views into one fused projection output) give SDPA's causal attention;
    bad arguments raise, as the decode kernel's do."""
    if cpu_kernels_unavailable_reason() is not None:
        pytest.skip(cpu_kernels_unavailable_reason())
    import torch.nn.functional as F

    from services.worker.attention.cpu_kernels import has_prefill_attention, prefill_attention

    if not has_prefill_attention():
        pytest.skip("the CPU kernels were built without AVX-512 or AVX2")
    g = torch.Generator().manual_seed(3)
    length, heads, kv_heads, dim = 53, 4, 2, 64
    fused = torch.randn(length, heads + 2 * kv_heads, dim, generator=g)
    q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
    out = torch.full_like(q, NAN)
    table = torch.zeros(1, dtype=torch.int32)
    prefill_attention(out, q, k.unsqueeze(0), v.unsqueeze(0), table, length, dim ** -0.5)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    pool = torch.zeros(4, 16, kv_heads, dim)
    with pytest.raises(IndexError, match="block id 9"):
        prefill_attention(out, q, pool, pool, torch.tensor([0, 9, 1, 2], dtype=torch.int32), length, 1.0)
    with pytest.raises(ValueError, match="context length 70"):
        prefill_attention(out, q, pool, pool, torch.tensor([0, 1, 2, 3], dtype=torch.int32), 70, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        prefill_attention(out, q, pool.bfloat16(), pool.bfloat16(), torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                          length, 1.0)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_bfloat16_prefill_kernel_is_as_exact_as_its_output_rounding(dim):
    """bfloat16 scores (AVX512-BF16's pair dot products, where the build has them) lose nothing the float32 sums do
    not: against float64 attention over the same bfloat16 values, each output is off by little more than its own
    rounding to bfloat16 (a scale 1 % off fails this; the engine-wide tolerance of 2e-2 lets it through)."""
    if cpu_kernels_unavailable_reason() is not None:
        pytest.skip(cpu_kernels_unavailable_reason())
    from services.worker.attention.cpu_kernels import has_prefill_attention, prefill_attention

    if not has_prefill_attention():
        pytest.skip("the CPU kernels were built without AVX-512 or AVX2")
    g = torch.Generator().manual_seed(dim)
    length, heads, kv_heads = 300, 8, 4
    q = (2 * torch.randn(length, heads, dim, generator=g)).bfloat16()
    k = (2 * torch.randn(length, kv_heads, dim, generator=g)).bfloat16()
    v = torch.randn(length, kv_heads, dim, generator=g).bfloat16()
    out = torch.full_like(q, NAN)
    prefill_attention(out, q, k.unsqueeze(0), v.unsqueeze(0), torch.zeros(1, dtype=torch.int32), length, dim ** -0.5)
    keys, values = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("ihd,jhd->hij", q.double(), keys) * dim ** -0.5
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hij,jhd->ihd", scores.softmax(-1), values)
    error = (out.double() - expected).abs()
    rounding = (expected.bfloat16().double() - expected).abs()
    assert error.mean() <= 1.05 * rounding.mean() + 1e-6
    assert (error <= expected.abs() * 2 ** -8 + 2 ** -12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_cpu_kernels_kv_write_fills_the_slots_index_put_fills(dtype):
    """csrc/write_kv.cpp against torch_ref.write_kv: new rows as the model hands them (views into one fused
    projection output), into poisoned pools, at scattered slots; an FP8 cache's codes compared as bytes."""
    if cpu_kernels_unavailable_reason() is not None:
        pytest.skip(cpu_kernels_unavailable_reason())
    from services.worker.attention.cpu_kernels import write_kv as kernel_write_kv

    g = torch.Generator().manual_seed(11)
    tokens, kv_heads, dim, blocks, block_size = 300, 2, 64, 40, 16
    fused = torch.randn(tokens, 4 + 2 * kv_heads, dim, generator=g).to(dtype)
    _, k, v = fused.split([4, kv_heads, kv_heads], dim=1)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    pools = [torch.full((blocks, block_size, kv_heads, dim), NAN).to(dtype) for _ in range(4)]
    write_kv(pools[0], pools[1], k, v, slots)
    kernel_write_kv(pools[2], pools[3], k, v, slots)
    for expected, actual in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8))


def test_the_cpu_kernels_kv_write_refuses_bad_input():
    if cpu_kernels_unavailable_reason() is not None:
        pytest.skip(cpu_kernels_unavailable_reason())
    from services.worker.attention.cpu_kernels import write_kv as kernel_write_kv

    pool = torch.zeros(4, 16, 2, 64)
    rows = torch.randn(3, 2, 64)
    with pytest.raises(IndexError, match="slot 64"):
        kernel_write_kv(pool, pool.clone(), rows, rows, torch.tensor([0, 64, 1]))
    with pytest.raises(IndexError, match="slot -1"):
        kernel_write_kv(pool, pool.clone(), rows, rows, torch.tensor([0, -1, 1]))
    with pytest.raises(ValueError, match="heads next to each other"):
        kernel_write_kv(pool, pool.clone(), rows.transpose(0, 1).contiguous().transpose(0, 1), rows,
                        torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="shape and dtype"):
        kernel_write_kv(pool, pool.clone(), rows.bfloat16(), rows.bfloat16(), torch.tensor([0, 1, 2]))
    assert not pool.any()  # nothing written by a refused call
