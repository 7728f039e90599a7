"""Blocks behind every layer's sliding window are freed while their sequence runs, and nothing reads them."""

from __future__ import annotations

import os
import random

# Whichever test module imports triton first decides interpreted or compiled for the whole session.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from services.scheduler.block_manager import FREED_BLOCK_ID, READ_MARGIN, BlockManager  # noqa: E402
from services.worker.attention.spec import AttentionSpec, kv_window  # noqa: E402
from tests.kv_release import poison_released_blocks  # noqa: E402
from tests.oracle import assert_greedy_equal, hf_greedy  # noqa: E402

WINDOW = 12  # conftest's mistral_window_dir: every layer sees 12 keys


def grown(manager: BlockManager, seq_id: int, num_tokens: int) -> BlockManager:
    assert manager.append_slots(seq_id, num_tokens) is not None
    return manager


def test_blocks_behind_the_window_and_its_margin_are_freed():
    manager = grown(BlockManager(num_blocks=20, block_size=4, kv_window=WINDOW), 0, 60)  # 15 blocks
    table = manager.block_table(0)
    # The next token at 40 sees 29..40; a kernel may read from 13 on: blocks 0-2 (keys 0..11) go.
    assert manager.release_blocks_behind_window(0, 40) == (40 - WINDOW + 1 - READ_MARGIN) // 4 == 3
    assert manager.block_table(0) == [FREED_BLOCK_ID] * 3 + table[3:]
    assert manager.num_free_blocks == 5 + 3 and manager.num_released_blocks(0) == 3
    assert manager.release_blocks_behind_window(0, 40) == 0  # nothing new
    assert manager.release_blocks_behind_window(0, 45) == 1  # one more block left the margin
    assert manager.allocated_slots() == (15 - 4) * 4
    manager.check_invariants()
    manager.free(0)
    assert manager.num_free_blocks == 20
    manager.check_invariants()


def test_short_contexts_and_whole_context_models_keep_every_block():
    windowed = grown(BlockManager(num_blocks=8, block_size=4, kv_window=WINDOW), 0, 28)
    assert windowed.release_blocks_behind_window(0, WINDOW + READ_MARGIN - 1) == 0  # the margin still reaches 0
    whole = grown(BlockManager(num_blocks=8, block_size=4), 0, 28)
    assert whole.release_blocks_behind_window(0, 28) == 0 and whole.num_free_blocks == 1
    with pytest.raises(ValueError, match="kv_window"):
        BlockManager(num_blocks=8, block_size=4, kv_window=0)


def test_a_fork_shares_the_released_entries_and_keeps_its_own_blocks():
    manager = grown(BlockManager(num_blocks=20, block_size=4, kv_window=WINDOW), 0, 50)
    manager.release_blocks_behind_window(0, 48)
    manager.fork(0, 1)
    assert manager.block_table(1) == manager.block_table(0) and manager.num_released_blocks(1) == 5
    manager.check_invariants()
    assert manager.release_blocks_behind_window(0, 50) == 0
    # The parent moves on; the child's blocks stay referenced until the child lets them go too.
    grown(manager, 0, 64)
    freed_by_parent = manager.release_blocks_behind_window(0, 64)
    free_before = manager.num_free_blocks
    assert freed_by_parent == 4 and manager.release_blocks_behind_window(1, 64) == 4
    assert manager.num_free_blocks == free_before + 4  # only when both released them
    manager.check_invariants()
    manager.free(0)
    manager.free(1)
    assert manager.num_free_blocks == 20


def test_swapping_moves_only_the_live_blocks_and_keeps_the_released_entries():
    manager = grown(BlockManager(num_blocks=20, block_size=4, kv_window=WINDOW, num_host_blocks=12), 0, 48)
    manager.release_blocks_behind_window(0, 48)  # 12 blocks, 5 released
    live = manager.block_table(0)[5:]
    assert manager.can_swap_out(0)
    out = manager.swap_out(0)
    assert [device for device, _ in out] == live and manager.num_free_host_blocks == 12 - 7
    manager.check_invariants()
    assert manager.can_swap_in(0, 52)  # 7 back, and one more block for tokens 48..51
    back = manager.swap_in(0)
    assert [host for host, _ in back] == [host for _, host in out]
    table = manager.block_table(0)
    assert table[:5] == [FREED_BLOCK_ID] * 5 and table[5:] == [device for _, device in back]
    # The host blocks the swap-in reads stay held until the step's plan is sealed.
    assert manager.num_released_blocks(0) == 5 and manager.num_free_host_blocks == 12 - 7
    assert manager.seal_plan() == ([], []) and manager.num_free_host_blocks == 12
    manager.check_invariants()


def evict(manager: BlockManager, block_hash) -> None:
    """What the pool does to a cached-free block when it hands it out (LRU picks the longest freed)."""
    block = manager.pool.cached_block(block_hash)
    assert block.ref_cnt == 0
    manager.pool._evict(block)


def cached_sequence(manager: BlockManager, tokens: list[int]) -> None:
    grown(manager, 0, len(tokens))
    manager.cache_full_blocks(0, len(tokens), lambda start, end: tokens[start:end])


def test_a_cache_hit_needs_only_the_blocks_its_window_reads():
    manager = BlockManager(num_blocks=20, block_size=4, enable_caching=True, kv_window=WINDOW)
    tokens = list(range(100, 148))
    cached_sequence(manager, tokens)
    manager.release_blocks_behind_window(0, 48)
    assert manager.num_cached_blocks == 5  # freed, still indexed
    hashes = manager.cached_prefix(tokens + [1]).hashes
    for block_hash in hashes[:5]:  # freed first, so evicted first: the start of the chain
        evict(manager, block_hash)
    hit = manager.cached_prefix(tokens + [1])
    # The next token, at 48, reads from key 48 - 12 + 1 - 16 = 21, in block 5: blocks 5-11 suffice.
    assert hit.num_blocks == 12 and hit.blocks[:5] == (None,) * 5 and None not in hit.blocks[5:]
    assert hit.hashes == hashes
    manager.allocate_with_hits(1, hit, 49)
    assert manager.num_released_blocks(1) == 5 and manager.block_table(1)[5:12] == manager.block_table(0)[5:12]
    manager.check_invariants()
    manager.free(1)
    manager.free(0)
    # Block 8 missing: 12 blocks would need it; 8 would need blocks 1-7, and 1-4 are gone too.
    evict(manager, hashes[8])
    assert manager.cached_prefix(tokens + [1]).num_blocks == 0
    manager.check_invariants()


def test_a_block_missing_inside_the_window_ends_the_hit_before_it():
    manager = BlockManager(num_blocks=20, block_size=4, enable_caching=True, kv_window=WINDOW)
    tokens = list(range(100, 148))
    cached_sequence(manager, tokens)
    manager.free(0)
    hashes = manager.cached_prefix(tokens + [1]).hashes
    evict(manager, hashes[8])
    hit = manager.cached_prefix(tokens + [1])
    # 8 blocks: the token at 32 reads from key 5, in block 1; block 0 is not needed (a released entry).
    assert hit.num_blocks == 8 and hit.blocks[0] is None and None not in hit.blocks[1:]


def test_without_a_window_a_cache_hit_starts_at_the_first_block():
    manager = BlockManager(num_blocks=20, block_size=4, enable_caching=True)
    tokens = list(range(100, 148))
    cached_sequence(manager, tokens)
    manager.free(0)
    hashes = manager.cached_prefix(tokens + [1]).hashes
    assert len(hashes) == 12
    evict(manager, hashes[0])
    assert manager.cached_prefix(tokens + [1]).num_blocks == 0


def test_the_worker_reports_the_widest_window_of_all_its_models():
    windowed = AttentionSpec(1.0, (16, 32))
    assert kv_window((windowed, 2)) == 32
    assert kv_window((windowed, 3)) is None  # the third layer sees everything
    assert kv_window((AttentionSpec(1.0, (16, None)), 2)) is None  # Gemma 2-like: some layers are global
    assert kv_window((windowed, 2), (AttentionSpec(1.0, (64,)), 1)) == 64  # a draft model reads further
    assert kv_window((windowed, 2), (AttentionSpec(1.0), 1)) is None


@pytest.mark.parametrize("backend, block_size, num_blocks", [
    ("torch", 8, 64), ("cpu", 8, 64), ("triton", 8, 64),
    ("torch", 16, 11), ("cpu", 16, 11)])  # 11 blocks of 16: preempted, swapped with released entries
def test_greedy_equals_transformers_with_released_blocks_poisoned(mistral_window_dir, backend, block_size,
                                                                  num_blocks):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend runs here only under the interpreter")
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    lengths = [3, 40, 90] if backend == "triton" else [1, 13, 40, 90, 150]  # the interpreter is slow
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]
    # No prefix caching: a poisoned block must not come back as a cache hit (released blocks are
    # otherwise kept, valid, in the cache: see the test above).
    llm = LLM(str(mistral_window_dir), block_size=block_size, max_num_batched_tokens=48,
              enable_chunked_prefill=True, attention_backend=backend, enable_prefix_caching=False,
              num_gpu_blocks_override=num_blocks)
    assert llm.engine.info.kv_window == WINDOW
    # The Triton kernel loads no position past a context's end and none behind the window's margin:
    # NaN there checks that nothing released is even loaded. The PyTorch and CPU backends gather whole
    # blocks and weight a fresh block's unwritten slots by 0, which is exact for the finite values a
    # (zeroed) pool holds but not for NaN: they get a huge finite poison, which any read inside a
    # window would still show.
    released = poison_released_blocks(llm, float("nan") if backend == "triton" else 1e4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert released[0] > 0
    if num_blocks < 64:
        assert llm.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    for prompt, out in zip(prompts, outputs):
        ref, ref_logprobs = hf_greedy(mistral_window_dir, prompt, 16)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"{backend}, prompt of {len(prompt)}")
    assert llm.stats()["kv_blocks_used"] == 0
    llm.engine.scheduler.blocks.check_invariants()


def test_releasing_lets_more_sequences_run_at_once(mistral_window_dir):
    """The same long requests in the same small pool: freeing what left the window avoids preemption."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 500) for _ in range(120)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = {}
    for release in (True, False):
        llm = LLM(str(mistral_window_dir), block_size=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  num_gpu_blocks_override=48)
        if not release:
            llm.engine.scheduler.blocks.kv_window = None
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[release] = (llm.stats()["num_preemptions"], [o.outputs[0].token_ids for o in outputs])
    (with_release, tokens), (without, tokens_kept) = runs[True], runs[False]
    assert with_release == 0 < without, runs
    assert tokens == tokens_kept  # the same greedy tokens either way
    assert all(len(t) == 40 for t in tokens)


def test_a_follow_up_turn_hits_the_cache_after_its_start_was_evicted(mistral_window_dir):
    """A conversation's start leaves the window first, is freed first and so evicted first; its later
    blocks still serve the next turn, which equals transformers'."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    first, other = ([rng.randrange(1, 500) for _ in range(n)] for n in (160, 100))
    follow_up = first + [rng.randrange(1, 500) for _ in range(3)]
    llm = LLM(str(mistral_window_dir), block_size=8, num_gpu_blocks_override=30)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in (first, other):
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    before = llm.stats()["prefix_cache_hits"]
    out = llm.generate([{"prompt_token_ids": follow_up}], params, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hits"] - before == 160  # every full block of the first turn
    ref, ref_logprobs = hf_greedy(mistral_window_dir, follow_up, 4)
    assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs)
    llm.engine.scheduler.blocks.check_invariants()


def test_a_sequence_longer_than_the_pool_runs_when_only_its_window_is_held(mistral_window_dir):
    """Admission asks for the most blocks a sequence holds at once: with every layer windowed and chunked
    prefill, its window's and a step's. Two such requests share the pool (one waits or is preempted)."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (150, 120)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # 190 tokens need 24 blocks of 8; a step of 32 tokens over a 12-key window holds at most
    # ceil((32 + 11 + 16) / 8) + 2 = 10.
    llm = LLM(str(mistral_window_dir), block_size=8, max_num_batched_tokens=32, enable_chunked_prefill=True,
              num_gpu_blocks_override=12)
    assert llm.engine.scheduler.blocks.most_blocks_held(190, 32) == 10
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref, ref_logprobs = hf_greedy(mistral_window_dir, prompt, 40)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"prompt of {len(prompt)}")
    assert llm.stats()["kv_blocks_used"] == 0
    # Without chunked prefill a recomputed sequence needs every block in one step: refused as before.
    whole = LLM(str(mistral_window_dir), block_size=8, max_num_batched_tokens=512, enable_chunked_prefill=False,
                num_gpu_blocks_override=12)
    with pytest.raises(ValueError, match="needing 24 KV blocks at once"):
        whole.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
