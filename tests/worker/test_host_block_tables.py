"""The worker's host block tables: against plain lists over random adds, appends, replacements, forks and
releases (the tensor growing in rows and in width on the way), refusing what would corrupt them, and
through a real engine whose sequences fork, get preempted and finish: every row comes back."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.host_block_tables import HostBlockTables
from services.worker.input_batch import ScheduledSequence, padded_block_tables


def expected_gather(lists: dict[int, list[int]], rows: list[int]) -> torch.Tensor:
    width = max(len(lists[r]) for r in rows)
    return torch.tensor([lists[r] + [0] * (width - len(lists[r])) for r in rows], dtype=torch.int32)


def assert_all_rows_free(tables: HostBlockTables) -> None:
    assert not tables.live_rows and sorted(tables.free_rows) == list(range(tables.table.shape[0]))
    assert not tables.table.any() and not any(tables.lengths)


def test_random_operations_match_lists():
    rng = random.Random(0)
    tables = HostBlockTables(width=3, rows=2)
    lists: dict[int, list[int]] = {}
    for _ in range(2000):
        op = rng.random()
        if op < 0.2 or not lists:
            row = tables.add(blocks := [rng.randrange(1000) for _ in range(rng.randrange(0, 6))])
            assert row not in lists
            lists[row] = blocks
        elif op < 0.55:
            row = rng.choice(list(lists))
            new = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
            tables.append(row, new)
            lists[row] += new
        elif op < 0.65:
            row = rng.choice(list(lists))
            lists[row] = [rng.randrange(1000) for _ in range(rng.randrange(0, 8))]
            tables.replace(row, lists[row])
        elif op < 0.75:
            parent = rng.choice(list(lists))
            child = tables.copy(parent)
            assert child not in lists
            lists[child] = list(lists[parent])
        elif op < 0.9:
            row = rng.choice(list(lists))
            tables.release(row)
            del lists[row]
        rows = rng.sample(list(lists), min(len(lists), 5)) if lists else []
        if rows and any(lists[r] for r in rows):
            assert torch.equal(tables.gather(rows), expected_gather(lists, rows))
    assert tables.table.shape[0] > 2 and tables.table.shape[1] > 3  # it grew both ways
    for row in list(lists):
        tables.release(row)
    assert_all_rows_free(tables)


def test_gathered_tables_equal_those_built_from_the_lists():
    tables = HostBlockTables(width=4)
    batch = [ScheduledSequence([0] * 5, [7, 3], 4, 1), ScheduledSequence([0] * 9, [1, 9, 4, 2, 8], 8, 1),
             ScheduledSequence([0], [5], 0, 1)]
    rows = [tables.add(s.block_table) for s in batch]
    assert torch.equal(tables.gather(rows), padded_block_tables(batch))


def test_bad_ids_and_double_releases_are_refused_and_change_nothing():
    tables = HostBlockTables(width=4, rows=1)
    row = tables.add([3, 4])
    for bad in ([5, -1], [2 ** 31]):
        with pytest.raises(ValueError, match="block ids"):
            tables.append(row, bad)
        with pytest.raises(ValueError, match="block ids"):
            tables.replace(row, bad)
        with pytest.raises(ValueError, match="block ids"):
            tables.add(bad)
    assert tables.gather([row]).tolist() == [[3, 4]] and tables.free_rows == []
    tables.release(row)
    with pytest.raises(ValueError, match="not in use"):
        tables.release(row)
    with pytest.raises(ValueError, match="not in use"):
        tables.append(row, [1])
    assert_all_rows_free(tables)


def test_an_engine_gives_every_row_back(llama_dir):
    # Parallel samples fork, beams fork and finish, a small pool preempts (swap and recompute): whatever
    # happens to the sequences, once all requests are done their rows are free and zero.
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(llama_dir), block_size=4, num_gpu_blocks_override=24, max_num_seqs=8)
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 400 for j in range(5 + 3 * i)]} for i in range(6)]
    params = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(use_beam_search=True, beam_width=2, max_tokens=6, ignore_eos=True)] * 3
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)
    assert llm.stats()["num_preemptions"] > 0
    llm.engine.step()  # the last finished sequences' ids reach the worker with the next plan
    worker = llm.engine.executor.worker
    assert not worker.seqs
    assert_all_rows_free(worker.block_tables)
