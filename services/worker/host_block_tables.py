"""Every live sequence's block table as one row of a host tensor, kept between steps.

A step's batch needs its sequences' tables as one ``[num_seqs, max_blocks]`` tensor. Rebuilt from the
Python lists each step, that is Python work proportional to the tokens in context (32 sequences at 32k
tokens are 64k block ids a step). Here a plan's deltas are written into each sequence's row as they
arrive (a few ids a step), and a batch's tables are one gather of its rows. Columns past a table's end
hold 0, as the attention metadata's padding does.
"""

from __future__ import annotations

import torch

INITIAL_ROWS = 64


class HostBlockTables:
    def __init__(self, width: int, rows: int = INITIAL_ROWS):
        self.table = torch.zeros(rows, max(1, width), dtype=torch.int32)  # [rows, width]; grows by doubling
        self.free_rows = list(range(rows - 1, -1, -1))  # popped from the end: low rows first

    def add(self, blocks: list[int]) -> int:
        """A row holding ``blocks``; give it back with ``release``."""
        if not self.free_rows:
            self._grow(rows=2 * self.table.shape[0])
        row = self.free_rows.pop()
        self.append(row, 0, blocks)
        return row

    def replace(self, row: int, blocks: list[int]) -> None:
        """A whole new table for ``row`` (a sequence resumed after a swap)."""
        self.table[row].zero_()
        self.append(row, 0, blocks)

    def append(self, row: int, start: int, blocks: list[int]) -> None:
        """``blocks`` into ``row`` from column ``start``: the ids a plan added after the table's last."""
        end = start + len(blocks)
        if end > self.table.shape[1]:
            self._grow(width=max(end, 2 * self.table.shape[1]))
        if blocks:
            self.table[row, start:end] = torch.tensor(blocks, dtype=torch.int32)

    def copy(self, row: int) -> int:
        """A new row equal to ``row`` (a forked sequence starts on its parent's blocks)."""
        new = self.add([])
        self.table[new] = self.table[row]
        return new

    def release(self, row: int) -> None:
        self.table[row].zero_()
        self.free_rows.append(row)

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """``[len(rows), width]`` int32: the first ``width`` columns of ``rows``, in that order."""
        return self.table[:, :width].index_select(0, torch.tensor(rows, dtype=torch.int64))

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.table.shape
        rows, width = rows or old_rows, width or old_width
        table = torch.zeros(rows, width, dtype=torch.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        self.free_rows = list(range(rows - 1, old_rows - 1, -1)) + self.free_rows
