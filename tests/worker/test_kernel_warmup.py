"""The dummy batches a CUDA worker warms its Triton kernels up with (the compiles themselves are checked
by benchmarks/triton_compile.py, through tests/worker/test_triton_compile.py)."""

from __future__ import annotations

import os

# Whichever test module imports triton first decides interpreted or compiled for the whole session;
# test_triton_kernels.py needs the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from services.worker.kernel_warmup import warm_up_batches  # noqa: E402


def shapes(batches):
    assert all(len(batch) == 1 for batch in batches)
    prefills = [b[0].num_scheduled_tokens for b in batches if b[0].num_computed_tokens == 0]
    decodes = [b[0].num_computed_tokens + 1 for b in batches if b[0].num_computed_tokens > 0]
    return prefills, decodes


@pytest.mark.parametrize("max_model_len, budget, prefills, decodes", [
    (2048, 4096, [1, 2, 4, 8, 16, 32, 64], [256, 512, 1024, 2048]),  # 2, 4, 8 and 16 splits of 128 keys
    (2000, 48, [1, 2, 4, 8, 16, 32, 48], [256, 512, 1024, 2000]),  # the longest query and context themselves too
    (40960, 4096, [1, 2, 4, 8, 16, 32, 64], [256, 512, 1024, 2048, 4096, 8192, 40960]),  # 64 splits from 8192
    (700, 4096, [1, 2, 4, 8, 16, 32, 64], [256, 512, 700]),
    (255, 4096, [1, 2, 4, 8, 16, 32, 64], []),  # too short for split-K
    (40, 4096, [1, 2, 4, 8, 16, 32, 40], []),
])
def test_warm_up_reaches_every_tile_height_and_split_count(max_model_len, budget, prefills, decodes):
    assert shapes(warm_up_batches(16, 10, max_model_len, budget)) == (prefills, decodes)


def test_warm_up_sequences_stay_inside_the_pool_and_their_context():
    for batch in warm_up_batches(block_size=16, num_blocks=3, max_model_len=5000, token_budget=4096):
        seq = batch[0]
        total = seq.num_computed_tokens + seq.num_scheduled_tokens
        assert total <= 5000 and len(seq.token_ids) == total
        assert len(seq.block_table) == -(-total // 16) and all(0 <= b < 3 for b in seq.block_table)
