"""The Triton kernels against the PyTorch reference, run on the CPU through the Triton interpreter.

Every output buffer is filled with NaN before the call, so a row the kernel forgets to write fails.
Shapes are tiny: the interpreter runs each program as numpy operations in Python.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernels are wrapped at import

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from services.worker.attention.metadata import AttentionMetadata  # noqa: E402
from tests.attention_inputs import with_image_spans  # noqa: E402
from services.worker.attention.selector import select_attention_backend  # noqa: E402
from services.worker.attention.spec import AttentionSpec  # noqa: E402
from services.worker.attention.torch_ref import (  # noqa: E402
    TorchAttentionBackend, paged_attention_reference, write_kv as write_kv_reference)
from services.worker.attention import triton_attention  # noqa: E402
from services.worker.attention.triton_attention import (  # noqa: E402
    SPLIT_MIN_KEYS, TritonAttentionBackend, choose_num_splits, make_launch_plan, paged_attention)
from services.worker.attention.triton_cache_ops import copy_blocks, swap_blocks, whole_pool, write_kv  # noqa: E402
from services.worker.swap_staging import SwapStaging  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the kernels on the CPU: they need TRITON_INTERPRET=1", allow_module_level=True)
if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
    # Its interpreter turns a loaded scalar used as a loop bound into an int with int(array), which
    # numpy >= 2.4 refuses for one-element arrays. Compiled, the kernels work on 3.6 (benchmarks/RESULTS.md).
    pytest.skip(f"the Triton {triton.__version__} interpreter cannot run these kernels; use triton >= 3.7 for "
                "the CPU tests", allow_module_level=True)

NAN = float("nan")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


# --- building a batch ------------------------------------------------------------------------------


def make_batch(specs: list[tuple[int, int]], block_size: int, num_blocks: int, generator: torch.Generator,
               order: str = "random") -> AttentionMetadata:
    """Metadata for sequences given as (cached tokens, new tokens); blocks drawn from the whole pool.

    order "random" scatters every sequence's blocks over the pool; "reverse" hands them out from the
    top of the pool down, so each table runs backwards through memory.
    """
    needed = sum(-(-(cached + new) // block_size) for cached, new in specs)
    assert needed <= num_blocks
    if order == "reverse":
        free = list(range(num_blocks - needed, num_blocks))
    else:
        free = torch.randperm(num_blocks, generator=generator)[:needed].tolist()
    tables, slots = [], []
    for cached, new in specs:
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        tables.append(table)
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(cached, cached + new)]
    query_lens = [new for _, new in specs]
    seq_lens = [cached + new for cached, new in specs]
    width = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def random_pools(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator, layers=1):
    shape = (layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=generator).to(dtype)


def check_attention(specs, *, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                    order="random", seed=0, window=None, softcap=None, images=False, **kwargs):
    """``images``: spans of new tokens that see each other both ways (attention_inputs.with_image_spans)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in specs) + 5
    pool = random_pools(num_blocks, block_size, num_kv_heads, head_dim, dtype, g)
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    meta = make_batch(specs, block_size, num_blocks, g, order)
    if images:
        meta = with_image_spans(meta, g)
    # q as the model makes it: a strided view into a wider projection (last dim contiguous only).
    qkv = torch.randn(meta.num_tokens, (num_heads + 2) * head_dim, generator=g).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale, out=torch.full_like(q, NAN), window=window,
                          softcap=softcap, **kwargs)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# --- paged attention ---------------------------------------------------------------------------------

MIXED = [(0, 7), (12, 5), (33, 1), (20, 1), (0, 1), (5, 3)]  # prefill chunks after cached blocks + decodes


@pytest.mark.parametrize("specs, block_size, order", [
    pytest.param([(0, 1)], 8, "random", id="context-of-one"),
    pytest.param([(15, 1), (0, 16), (8, 8)], 8, "random", id="block-multiple"),
    pytest.param([(16, 1), (7, 10)], 8, "random", id="one-into-new-block"),
    pytest.param([(29, 1), (10, 9)], 4, "reverse", id="blocks-in-reverse"),
    pytest.param(MIXED, 16, "random", id="mixed-prefill-decode"),
])
def test_attention_matches_reference(specs, block_size, order):
    check_attention(specs, block_size=block_size, order=order)


@pytest.mark.parametrize("window, split_k", [(None, False), (None, True), (6, False), (6, True)])
def test_images_attending_both_ways_match_reference(window, split_k):
    """Prefill tokens whose key limits pass their own position (KEY_LIMIT), beside decodes, in tiles of several
    queries, windowed or not, split or not."""
    for seed in range(2):
        check_attention([(0, 13), (9, 7), (20, 1), (3, 2)], block_size=4, seed=seed, window=window, images=True,
                        split_k=split_k)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (8, 1)], ids=["gqa1", "gqa2", "gqa8"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_attention_gqa_and_head_dims(num_heads, num_kv_heads, head_dim):
    check_attention(MIXED, block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def test_prefill_longer_than_one_query_tile():
    # float32 with head_dim 128 takes 16-row tiles (8 tokens x 2 heads): these prefills span several
    # tiles each, the last one partial, one after cached blocks.
    specs = [(9, 40), (0, 33), (5, 1)]
    check_attention(specs, block_size=8, num_heads=4, num_kv_heads=2, head_dim=128)
    meta = make_batch(specs, 8, 16, torch.Generator().manual_seed(0))
    plan = make_launch_plan(meta, torch.empty(74, 4, 128), torch.empty(16, 8, 2, 128))
    assert (plan.block_q, plan.num_warps, plan.num_tiles) == (8, 8, 5 + 5 + 1)


def test_tile_sizes_follow_the_batch_and_the_device(monkeypatch):
    bf16 = dict(dtype=torch.bfloat16)
    pool = torch.empty(16, 8, 2, 128, **bf16)
    decodes = make_batch([(40, 1), (3, 1)], 8, 16, torch.Generator().manual_seed(0))
    mixed = make_batch([(9, 40), (3, 1)], 8, 16, torch.Generator().manual_seed(0))
    # The interpreter stands in for a GPU with an A100's shared memory or more: 128-key decode steps.
    assert make_launch_plan(decodes, torch.empty(2, 4, 128, **bf16), pool).block_n == 128
    plan = make_launch_plan(mixed, torch.empty(41, 4, 128, **bf16), pool)
    assert (plan.block_n, plan.block_q * 2, plan.num_warps) == (64, 64, 4)  # prefill tiles keep 64 keys
    wide = make_launch_plan(mixed, torch.empty(41, 4, 256, **bf16), torch.empty(16, 8, 2, 256, **bf16))
    assert (wide.block_n, wide.block_q * 2, wide.num_warps) == (32, 64, 8)
    monkeypatch.setattr(triton_attention, "_shared_memory", lambda device: 100 << 10)  # a consumer GPU
    assert make_launch_plan(decodes, torch.empty(2, 4, 128, **bf16), pool).block_n == 64
    with pytest.raises(ValueError, match="block_q"):
        make_launch_plan(mixed, torch.empty(41, 4, 128, **bf16), pool, block_q=3)
    with pytest.raises(ValueError, match="block_q"):
        make_launch_plan(mixed, torch.empty(41, 4, 128, **bf16), pool, block_q=4)  # 4 x 2 heads < 16 rows


def test_attention_tiny_head_dim_without_dot():
    check_attention([(9, 1), (0, 4)], head_dim=8)  # below tl.dot's minimum: the broadcast-sum path


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("specs", [MIXED, [(70, 1), (3, 1)]], ids=["mixed", "decode"])
def test_split_k_forced_matches_reference(specs, num_splits):
    # block_n=16 puts several key tiles and several splits into these short contexts; some are empty.
    check_attention(specs, block_size=8, num_heads=8, num_kv_heads=2, split_k=True, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("num_splits", [2, 7])
def test_plan_for_a_longer_context_holds_for_shorter_ones(num_splits):
    # What a CUDA graph replays: a decode plan made for the longest context, launched over any lengths
    # (each sequence cuts its own context into the splits; the shortest leave some empty).
    g = torch.Generator().manual_seed(3)
    block_size, heads, kv_heads, dim = 8, 4, 2, 32
    specs = [(0, 1), (15, 1), (40, 1), (129, 1)]
    pool = random_pools(60, block_size, kv_heads, dim, torch.float32, g)
    meta = make_batch(specs, block_size, 60, g)
    q = torch.randn(meta.num_tokens, heads, dim, generator=g)
    longer = make_batch([(400, 1)] * len(specs), block_size, 60 * 4, g)
    plan = make_launch_plan(longer, q, pool[0, 0], split_k=True, num_splits=num_splits, block_n=16)
    assert plan.num_splits == num_splits
    out = paged_attention(q, pool[0, 0], pool[0, 1], meta, dim ** -0.5, out=torch.full_like(q, NAN), plan=plan)
    ref = paged_attention_reference(q, pool[0, 0], pool[0, 1], meta, dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


# Windows of 1 (itself only), inside a 16-key step, a block exactly, across tiles; prefill chunks whose
# first queries see the start of the context and whose later ones do not.
@pytest.mark.parametrize("window", [1, 5, 8, 23])
def test_sliding_window(window):
    check_attention(MIXED + [(40, 1), (0, 30)], block_size=8, window=window, block_n=16)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_sliding_window_split_k(num_splits):
    # The splits cover only the keys the window reaches (from a 16-key boundary); some stay empty.
    check_attention([(70, 1), (3, 1), (40, 1), (20, 6)], block_size=8, num_heads=8, num_kv_heads=2, window=21,
                    split_k=True, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores(dtype):
    # A cap of 1 bends every score past a few tenths: a kernel without it cannot match the reference.
    check_attention(MIXED, block_size=8, softcap=1.0, dtype=dtype, block_n=16)
    check_attention([(70, 1), (12, 5)], block_size=8, softcap=1.0, window=19, split_k=True, block_n=16)


def test_split_k_forced_off_for_long_decode():
    check_attention([(200, 1)], block_size=16, split_k=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split_k", [False, True])
def test_half_precision(dtype, split_k):
    check_attention(MIXED, dtype=dtype, split_k=split_k, block_n=16)


def test_bad_head_size_is_a_clear_error():
    q = torch.zeros(1, 2, 24)
    pool = torch.zeros(1, 2, 4, 8, 2, 24)
    meta = make_batch([(0, 1)], 8, 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="power-of-two head size"):
        paged_attention(q, pool[0, 0], pool[0, 1], meta, 1.0)
    with pytest.raises(ValueError, match="power-of-two head size"):
        TritonAttentionBackend([(pool[0, 0], pool[0, 1])], AttentionSpec(1.0))


def test_bad_inputs_are_rejected():
    pool = torch.zeros(1, 2, 4, 8, 2, 16)
    meta = make_batch([(0, 2)], 8, 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(torch.zeros(2, 2, 16, dtype=torch.float16), pool[0, 0], pool[0, 1], meta, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(torch.zeros(2, 16, 2).transpose(1, 2), pool[0, 0], pool[0, 1], meta, 1.0)
    with pytest.raises(ValueError, match="tokens"):
        paged_attention(torch.zeros(3, 2, 16), pool[0, 0], pool[0, 1], meta, 1.0)
    with pytest.raises(ValueError, match="num_stages"):
        paged_attention(torch.zeros(2, 2, 16), pool[0, 0], pool[0, 1], meta, 1.0, num_stages=0)


def test_split_heuristic():
    sms = 132
    assert choose_num_splits(num_programs=8, max_seq_len=32768, max_query_len=1, sm_count=sms) > 1
    assert choose_num_splits(num_programs=8, max_seq_len=2 * SPLIT_MIN_KEYS - 1, max_query_len=1,
                             sm_count=sms) == 1  # short
    assert choose_num_splits(num_programs=8, max_seq_len=512, max_query_len=1, sm_count=sms) == 512 // SPLIT_MIN_KEYS
    assert choose_num_splits(num_programs=2048, max_seq_len=32768, max_query_len=1, sm_count=sms) == 1  # full GPU
    assert choose_num_splits(num_programs=8, max_seq_len=32768, max_query_len=64, sm_count=sms) == 1  # prefill
    meta = make_batch([(40, 1)], 8, 8, torch.Generator().manual_seed(0))
    q, pool = torch.zeros(1, 4, 32), torch.zeros(1, 2, 8, 8, 2, 32)
    plan = make_launch_plan(meta, q, pool[0, 0], split_k=True, num_splits=4)
    assert plan.split and plan.num_splits == 3  # 41 keys in 16-key splits
    assert make_launch_plan(meta, q, pool[0, 0], split_k=False).num_splits == 1
    assert make_launch_plan(meta, q, pool[0, 0]).num_stages == 3  # Triton's default unless pinned
    assert make_launch_plan(meta, q, pool[0, 0], num_stages=5).num_stages == 5
    # A window bounds the keys any decode sees: the splits are sized for it (plus a 16-key step), not the context.
    long = make_batch([(4000, 1)], 8, 600, torch.Generator().manual_seed(0))
    assert make_launch_plan(long, q, pool[0, 0], split_k=True, num_splits=4, window=100).num_splits == 4
    assert make_launch_plan(long, q, pool[0, 0], split_k=True, num_splits=16, window=100).num_splits == 8


# --- the backend -------------------------------------------------------------------------------------


@pytest.mark.parametrize("split_k", [None, True])
@pytest.mark.parametrize("spec", [AttentionSpec(32 ** -0.5), AttentionSpec(32 ** -0.5, (6, None), 1.5),
                                  AttentionSpec(32 ** -0.5, (9, 9))], ids=["plain", "window-and-full-capped", "windows"])
def test_backend_matches_torch_backend(split_k, spec):
    g = torch.Generator().manual_seed(1)
    layers, block_size, heads, kv_heads, dim = 2, 4, 4, 2, 32
    meta = make_batch(MIXED, block_size, 40, g)
    pools = random_pools(40, block_size, kv_heads, dim, torch.float32, g, layers=layers)
    pools_ref = pools.clone()
    ours = TritonAttentionBackend([(pools[i, 0], pools[i, 1]) for i in range(layers)], spec, split_k=split_k)
    ref = TorchAttentionBackend([(pools_ref[i, 0], pools_ref[i, 1]) for i in range(layers)], spec)
    for layer in range(layers):
        q = torch.randn(meta.num_tokens, heads, dim, generator=g)
        k, v = torch.randn(2, meta.num_tokens, kv_heads, dim, generator=g)
        torch.testing.assert_close(ours.forward(layer, q, k, v, meta), ref.forward(layer, q, k, v, meta),
                                   atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pools, pools_ref, atol=0, rtol=0)


# --- cache operations --------------------------------------------------------------------------------


def test_write_kv_skips_padding_slots():
    g = torch.Generator().manual_seed(2)
    pool = random_pools(6, 4, 2, 16, torch.float32, g)
    expected = pool.clone()
    slots = torch.tensor([5, -1, 0, 23, -1, 9], dtype=torch.int64)
    k, v = torch.randn(2, 6, 2, 16, generator=g)
    write_kv(pool[0, 0], pool[0, 1], k, v, slots)
    real = slots >= 0
    write_kv_reference(expected[0, 0], expected[0, 1], k[real], v[real], slots[real])
    torch.testing.assert_close(pool, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_all_layers(dtype):
    g = torch.Generator().manual_seed(3)
    pool = random_pools(10, 4, 3, 8, dtype, g, layers=3)
    expected = pool.clone()
    pairs = [(1, 7), (4, 0), (4, 9), (2, 3)]
    src, dst = torch.tensor(pairs).T
    expected[:, :, dst] = expected[:, :, src]
    copy_blocks(pool, pairs)
    assert torch.equal(pool, expected)
    with pytest.raises(ValueError, match="both a source and a destination"):
        copy_blocks(pool, [(1, 2), (2, 3)])
    with pytest.raises(ValueError, match="outside"):
        copy_blocks(pool, [(1, 10)])


def test_swap_round_trip():
    g = torch.Generator().manual_seed(4)
    device_pool = random_pools(8, 4, 2, 16, torch.float32, g, layers=2)
    host_pool = torch.full((2, 2, 5, 4, 2, 16), NAN)
    original = device_pool.clone()
    swap_blocks(device_pool, host_pool, [(6, 0), (1, 4), (3, 2)])
    assert torch.equal(host_pool[:, :, [0, 4, 2]], original[:, :, [6, 1, 3]])
    device_pool.fill_(NAN)
    swap_blocks(host_pool, device_pool, [(0, 2), (4, 5), (2, 7)])
    assert torch.equal(device_pool[:, :, [2, 5, 7]], original[:, :, [6, 1, 3]])
    with pytest.raises(ValueError, match="per-block shape"):
        swap_blocks(device_pool, torch.zeros(2, 2, 5, 8, 2, 16), [(0, 0)])


@pytest.mark.parametrize("max_blocks", [1, 3, 64])  # a piece of 1 or 3 blocks, or the whole swap at once
def test_staged_swaps_equal_direct_ones_in_pieces_of_any_size(max_blocks):
    g = torch.Generator().manual_seed(9)
    device_pool = random_pools(12, 4, 2, 16, torch.bfloat16, g, layers=3)
    block_bytes = device_pool[:, :, 0].numel() * device_pool.element_size()
    staging = SwapStaging(pin=False, max_bytes=max_blocks * block_bytes)
    for step, count in enumerate([3, 1, 7, 12, 2, 12]):  # the buffer grows, is reused, and refills
        host_pool = torch.full((3, 2, 16, 4, 2, 16), NAN, dtype=torch.bfloat16)
        expected = host_pool.clone()
        src = torch.randperm(12, generator=g)[:count].tolist()
        dst = torch.randperm(16, generator=g)[:count].tolist()
        staging.swap_out(device_pool, host_pool, list(zip(src, dst)))
        swap_blocks(device_pool, expected, list(zip(src, dst)))
        torch.testing.assert_close(host_pool, expected, rtol=0, atol=0, equal_nan=True, msg=f"step {step}")
        back = torch.full_like(device_pool, NAN)
        staging.swap_in(host_pool, back, list(zip(dst, src)))
        untouched = [b for b in range(12) if b not in src]
        assert torch.equal(back[:, :, src], device_pool[:, :, src]) and back[:, :, untouched].isnan().all()
        assert staging._buffer.numel() <= max(max_blocks, 1) * block_bytes  # bounded by max_bytes
    with pytest.raises(ValueError, match="outside"):
        staging.swap_out(device_pool, host_pool, [(12, 0)])


def test_whole_pool_recovers_the_pool_tensor():
    pool = torch.zeros(3, 2, 4, 8, 2, 16)
    assert whole_pool([(pool[i, 0], pool[i, 1]) for i in range(3)]) is pool


# --- selection and the engine ------------------------------------------------------------------------


def test_selector(monkeypatch):
    from services.worker.attention import cpu_kernels
    from services.worker.attention.cpu_attention import CpuAttentionBackend

    cpu = torch.device("cpu")
    if cpu_kernels.cpu_kernels_unavailable_reason() is None:
        assert select_attention_backend("auto", cpu) is CpuAttentionBackend
    assert select_attention_backend("cpu", cpu) is CpuAttentionBackend
    with pytest.raises(ValueError, match="runs on CPUs"):
        select_attention_backend("cpu", torch.device("cuda"))
    assert select_attention_backend("torch", cpu) is TorchAttentionBackend
    assert select_attention_backend("triton", cpu) is TritonAttentionBackend
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("flash", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_attention_backend("triton", cpu)
    # Without a compiler: "auto" falls back to torch; asking for "cpu" says why it cannot run.
    monkeypatch.setattr(cpu_kernels, "_build", lambda: "no C++ compiler found")
    assert select_attention_backend("auto", cpu) is TorchAttentionBackend
    with pytest.raises(ValueError, match=r"cannot run here: no C\+\+ compiler"):
        CpuAttentionBackend([], AttentionSpec(1.0))


def test_config_validates_backend_name():
    from shared.config import EngineConfig

    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_engine_greedy_tokens_equal_torch_backend(llama_dir):
    from pagedserve import LLM, SamplingParams

    prompts = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 300, 6], [42, 7, 19], list(range(100, 114))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        # A budget of 8 tokens chunks the prompts, so later steps mix prefill chunks with decodes.
        llm = LLM(str(llama_dir), block_size=4, max_num_batched_tokens=8, num_gpu_blocks_override=32,
                  attention_backend=backend)
        assert llm.engine.executor.worker.attention.name == backend
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outputs]
    assert results["triton"] == results["torch"]


# --- the engine over the kernels ----------------------------------------------------------------------


@pytest.mark.parametrize("model_fixture", ["gemma2_dir", "mistral_window_dir"])
def test_engine_on_the_kernels_equals_transformers(model_fixture, request):
    """Windows (and Gemma 2's caps) through the kernels end to end: prompts longer than the window,
    chunked, with decodes beside them."""
    from pagedserve import LLM, SamplingParams
    from tests.oracle import assert_greedy_equal, hf_greedy

    model_dir = request.getfixturevalue(model_fixture)
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(n)] for n in (30, 5, 19)]
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=24, attention_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref, ref_logprobs = hf_greedy(model_dir, prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"{model_fixture} prompt of {len(prompt)}")
