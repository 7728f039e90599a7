"""Every live sequence's block table as one row of a host tensor, kept between steps.

A step's batch needs its sequences' tables as one ``[num_seqs, max_blocks]`` tensor. Rebuilt from the
Python lists each step, that is Python work proportional to the tokens in context (32 sequences at 32k
tokens are 64k block ids a step). Here a plan's deltas are written into each sequence's row as they
arrive (a few ids a step), and a batch's tables are one gather of its rows. Columns past a table's end
hold 0, as the attention metadata's padding does. A failed write (an id past int32) changes nothing.
"""

from __future__ import annotations

import torch

INITIAL_ROWS = 64


class HostBlockTables:
    def __init__(self, width: int, rows: int = INITIAL_ROWS):
        self.table = torch.zeros(rows, max(1, width), dtype=torch.int32)  # [rows, width]; grows by doubling
        self.lengths = [0] * rows  # entries in use per row
        self.free_rows = list(range(rows - 1, -1, -1))  # popped from the end: low rows first
        self.live_rows: set[int] = set()

    def add(self, blocks: list[int]) -> int:
        """A row holding ``blocks``; give it back with ``release``."""
        ids = _ids(blocks)
        if not self.free_rows:
            self._grow(rows=2 * self.table.shape[0])
        row = self.free_rows.pop()
        self.live_rows.add(row)
        self._write(row, 0, ids)
        return row

    def append(self, row: int, blocks: list[int]) -> None:
        """``blocks`` after the row's last entry: the ids a plan appended."""
        self._write(row, self.lengths[self._live(row)], _ids(blocks))

    def truncate(self, row: int, length: int) -> None:
        """Keep the row's first ``length`` entries (the scheduler released the blocks after them)."""
        if not 0 <= length <= self.lengths[self._live(row)]:
            raise ValueError(f"block-table row {row} has {self.lengths[row]} entries, cannot keep {length}")
        self.table[row, length:self.lengths[row]] = 0
        self.lengths[row] = length

    def replace(self, row: int, blocks: list[int]) -> None:
        """A whole new table for ``row`` (after a copy-on-write of an inner block, or a swap-in)."""
        ids = _ids(blocks)
        self.table[self._live(row), :self.lengths[row]] = 0
        self._write(row, 0, ids)

    def copy(self, row: int) -> int:
        """A new row equal to ``row`` (a forked sequence starts on its parent's blocks)."""
        length = self.lengths[self._live(row)]
        new = self.add([])
        self.table[new, :length] = self.table[row, :length]
        self.lengths[new] = length
        return new

    def release(self, row: int) -> None:
        self.live_rows.remove(self._live(row))
        self.table[row, :self.lengths[row]] = 0
        self.lengths[row] = 0
        self.free_rows.append(row)

    def gather(self, rows: list[int]) -> torch.Tensor:
        """``[len(rows), longest of their tables]`` int32, padded with 0, in the order given."""
        width = max(self.lengths[r] for r in rows)
        return self.table[:, :width].index_select(0, torch.tensor(rows, dtype=torch.int64))

    def _live(self, row: int) -> int:
        if row not in self.live_rows:
            raise ValueError(f"block-table row {row} is not in use")
        return row

    def _write(self, row: int, start: int, ids: torch.Tensor) -> None:
        end = start + len(ids)
        if end > self.table.shape[1]:
            self._grow(width=max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = ids
        self.lengths[row] = end

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.table.shape
        rows, width = rows or old_rows, width or old_width
        table = torch.zeros(rows, width, dtype=torch.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        self.lengths += [0] * (rows - old_rows)
        self.free_rows = list(range(rows - 1, old_rows - 1, -1)) + self.free_rows


def _ids(blocks: list[int]) -> torch.Tensor:
    """Block ids as int32, checked before anything changes (a negative id would fit, and be wrong)."""
    if blocks and not 0 <= min(blocks) <= max(blocks) < 2 ** 31:
        raise ValueError(f"block ids must be in [0, 2**31), got {min(blocks)}..{max(blocks)}")
    return torch.tensor(blocks, dtype=torch.int32)
