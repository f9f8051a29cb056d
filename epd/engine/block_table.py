"""The persistent block table every TP rank keeps, and the changes that update it.

Each running sequence owns one row of ``table`` for as long as it runs (its row is
given by rank 0's ``InputBatch``). A step carries only what changed since the last
step (``BlockTableUpdate``: rows freed, blocks appended), so a step's message grows
with the sequences in it and their new blocks, not with their contexts; every rank
applies the same updates in the same order and so holds the same table. Source: vLLM
v1 ``worker/block_table.py`` (``BlockTable.append_row`` / ``add_row``) and
``gpu_input_batch.py``; the TP changes-only message is vLLM v1's
``SchedulerOutput`` (new requests in full, cached requests as their new blocks).
"""

from __future__ import annotations

import msgspec
import numpy as np


class BlockTableUpdate(msgspec.Struct, tag="blocks"):
    """One step's changes to the persistent block table, applied in field order.

    freed: rows whose sequences left the batch (cleared to -1).
    rows / starts / counts: per changed row, ``counts[i]`` block ids written at columns
        ``starts[i] ..`` of row ``rows[i]``; the row then holds exactly
        ``starts[i] + counts[i]`` blocks (a new row has ``starts[i] == 0``).
    blocks: the written block ids, concatenated in ``rows`` order: int32 bytes.
    """

    freed: list[int] = []
    rows: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    blocks: bytes = b""


class BlockTables:
    """Every rank's copy of the running sequences' block tables.

    table: [rows, max_blocks] int32, each row's blocks then -1; num_blocks: [rows]
    int32. Both grow (rows or columns) when an update needs more.
    """

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.table = np.full((max(rows, 1), max(max_blocks, 1)), -1, dtype=np.int32)
        self.num_blocks = np.zeros(max(rows, 1), dtype=np.int32)

    def apply(self, update: BlockTableUpdate) -> None:
        """Apply ``update`` (freed rows first, then the writes).

        Raises:
            ValueError: the update is inconsistent (a negative row or column, or fewer
                block ids than its counts say). The update comes from this instance's
                own rank 0, so this means a bug, not bad input.
        """
        for r in update.freed:
            if 0 <= r < len(self.num_blocks):
                self.table[r, :self.num_blocks[r]] = -1
                self.num_blocks[r] = 0
        if not update.rows:
            return
        ids = np.frombuffer(update.blocks, dtype=np.int32)
        if len(ids) != sum(update.counts) or min(update.rows) < 0 or min(update.starts) < 0:
            raise ValueError(f"inconsistent block-table update: {len(ids)} ids for counts {update.counts}, "
                             f"rows {update.rows}, starts {update.starts}")
        self._reserve(max(update.rows) + 1, max(s + c for s, c in zip(update.starts, update.counts)))
        k = 0
        for r, s, c in zip(update.rows, update.starts, update.counts):
            old = self.num_blocks[r]
            self.table[r, s:s + c] = ids[k:k + c]
            if s + c < old:
                self.table[r, s + c:old] = -1
            self.num_blocks[r] = s + c
            k += c

    def _reserve(self, rows: int, cols: int) -> None:
        have_rows, have_cols = self.table.shape
        if rows <= have_rows and cols <= have_cols:
            return
        table = np.full((max(rows, 2 * have_rows if rows > have_rows else have_rows),
                         max(cols, have_cols)), -1, dtype=np.int32)
        table[:have_rows, :have_cols] = self.table
        num = np.zeros(table.shape[0], dtype=np.int32)
        num[:have_rows] = self.num_blocks
        self.table, self.num_blocks = table, num
