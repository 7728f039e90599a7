"""The worker's host block tables against plain lists, over random adds, appends, replacements, forks and
releases (with the tensor growing in rows and in width on the way)."""

from __future__ import annotations

import random

import torch

from services.worker.host_block_tables import HostBlockTables
from services.worker.input_batch import ScheduledSequence, padded_block_tables


def expected_gather(lists: dict[int, list[int]], rows: list[int], width: int) -> torch.Tensor:
    return torch.tensor([(lists[r] + [0] * width)[:width] for r in rows], dtype=torch.int32)


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
            tables.append(row, len(lists[row]), new)
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
        if rows:
            width = max(1, max(len(lists[r]) for r in rows))
            assert torch.equal(tables.gather(rows, width), expected_gather(lists, rows, width))
    assert tables.table.shape[0] > 2 and tables.table.shape[1] > 3  # it grew both ways


def test_gathered_tables_equal_those_built_from_the_lists():
    tables = HostBlockTables(width=4)
    batch = [ScheduledSequence([0] * 5, [7, 3], 4, 1), ScheduledSequence([0] * 9, [1, 9, 4, 2, 8], 8, 1),
             ScheduledSequence([0], [5], 0, 1)]
    rows = [tables.add(s.block_table) for s in batch]
    assert torch.equal(tables.gather(rows, 5), padded_block_tables(batch))
