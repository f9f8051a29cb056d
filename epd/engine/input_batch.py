"""Rank 0's persistent batch: a row per running sequence, kept across steps.

A sequence gets a row the first step it is scheduled and keeps it until it leaves the
running batch (finished, aborted or preempted). The row holds its token ids and
remembers how many of its blocks the TP ranks' block tables (``BlockTables``) already
have, so each step copies only what is new: the tokens sampled since the last step and
the blocks allocated since (a new row: its whole prompt and block list, once). The step
is then built with numpy over the rows: input ids are one gather from the token buffer.
Source: vLLM v1 ``worker/gpu_input_batch.py`` (``InputBatch``: ``token_ids_cpu``,
``add_request`` / ``remove_request``) and ``core/sched/output.py`` (new vs cached
requests).
"""

from __future__ import annotations

import numpy as np
import torch

from epd.engine.block_table import BlockTableUpdate
from epd.engine.scheduler import SchedulerOutput
from epd.engine.step_input import StepInput
from epd.sequence import Sequence


class InputBatch:
    """Rows of the running sequences and their token buffer.

    token_ids: [rows, max_model_len] int32 (a row's first ``num_token_ids[row]`` are its
    sequence's); sent_blocks: [rows] int64, blocks of the row the TP ranks' tables hold.
    Rows and columns grow when needed.

    Args:
        max_num_seqs: initial rows (the scheduler's running-batch cap).
        max_model_len: initial token columns.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int) -> None:
        self.token_ids = np.zeros((max(max_num_seqs, 1), max(max_model_len, 1)), dtype=np.int32)
        self.num_token_ids = np.zeros(self.token_ids.shape[0], dtype=np.int64)
        self.sent_blocks = np.zeros(self.token_ids.shape[0], dtype=np.int64)
        # [rows] int64: the first position a decode step of the row's sequence computed here
        # (StepInput.resid_start), -1 before its first
        self.resid_start = np.full(self.token_ids.shape[0], -1, dtype=np.int64)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(range(self.token_ids.shape[0] - 1, -1, -1))

    def build(self, out: SchedulerOutput, running: list[Sequence]) -> tuple[StepInput, torch.Tensor | None]:
        """The step for scheduler output ``out`` (``running``: the scheduler's running
        sequences after scheduling; rows of sequences no longer among them are freed).

        Returns the step and the media embedding rows it needs ([rows, hidden], or None
        for a text-only step), in ``mm_rows`` order.
        """
        update = BlockTableUpdate()
        if len(self.row_of) > len(running):  # a sequence left: free its row (seq ids are never reused)
            alive = {s.seq_id for s in running}
            for seq_id in [i for i in self.row_of if i not in alive]:
                row = self.row_of.pop(seq_id)
                self._free_rows.append(row)
                update.freed.append(row)
        # A one-token chunk attends exactly like a decode token; so does each token of a
        # decode with drafts (ScheduledSeq.spec): one entry per position, all on its row.
        scheduled = sorted(out.scheduled, key=lambda s: s.num_tokens != 1 and not s.spec)
        n = sum(s.num_tokens if s.spec else 1 for s in scheduled)
        rows = np.empty(n, dtype=np.int32)
        starts = np.empty(n, dtype=np.int64)
        counts = np.empty(n, dtype=np.int64)
        new_blocks: list[int] = []
        k = 0
        for s in scheduled:
            seq = s.seq
            row = self.row_of.get(seq.seq_id)
            if row is None:
                row = self._new_row(seq.seq_id)
            self._sync_tokens(row, seq.token_ids)
            sent = int(self.sent_blocks[row])
            bt = seq.block_table
            if len(bt) < sent:  # never while a sequence runs; rewrite the row to stay exact
                sent = 0
            if len(bt) > sent:
                update.rows.append(row)
                update.starts.append(sent)
                update.counts.append(len(bt) - sent)
                new_blocks.extend(bt[sent:])
                self.sent_blocks[row] = len(bt)
            if s.spec:  # the drafts go into the row's buffer past its tokens (the next sync overwrites them)
                end = seq.num_tokens + len(s.spec)
                if end > self.token_ids.shape[1]:
                    self._grow(self.token_ids.shape[0], max(end, 2 * self.token_ids.shape[1]))
                self.token_ids[row, seq.num_tokens:end] = s.spec
                for i in range(s.num_tokens):
                    rows[k], starts[k], counts[k] = row, s.start + i, 1
                    k += 1
                continue
            rows[k], starts[k], counts[k] = row, s.start, s.num_tokens
            k += 1
            if s.num_tokens > 1:  # a prefill chunk (a recompute too): its rows never reach the residual
                self.resid_start[row] = -1
            elif (self.resid_start[row] < 0 and s.start >= seq.num_prompt_tokens
                  and s.start + 1 == seq.num_tokens):  # the first true decode (not a one-token chunk)
                self.resid_start[row] = s.start
        update.blocks = np.asarray(new_blocks, dtype=np.int32).tobytes()
        q_end = np.cumsum(counts)
        seg = np.repeat(np.arange(n), counts)
        positions = starts[seg] + (np.arange(int(q_end[-1]) if n else 0) - (q_end - counts)[seg])
        input_ids = self.token_ids[rows[seg], positions].astype(np.int64)
        logits_indices: list[int] = []
        seq_ids: list[int] = []
        mm_rows: list[tuple[int, int]] = []
        mm_parts: list[torch.Tensor] = []
        q = 0
        for s in scheduled:
            seq, start, num = s.seq, s.start, s.num_tokens
            for ph, emb in zip(seq.mm_placeholders, seq.mm_embeddings):
                lo, hi = max(start, ph.offset), min(start + num, ph.offset + ph.length)
                if lo < hi:
                    mm_rows.append((q + lo - start, hi - lo))
                    mm_parts.append(emb[lo - ph.offset:hi - ph.offset])
            q += num
            if s.spec:  # logits at every position: the target's token after each
                logits_indices.extend(range(q - num, q))
                seq_ids.extend([seq.seq_id] * num)
            elif s.sample:
                logits_indices.append(q - 1)
                seq_ids.append(seq.seq_id)
        nd = int((counts == 1).sum())
        mrope = b""
        if any(s.seq.mrope() is not None for s in scheduled):  # Qwen-VL media: [3, num_tokens] positions
            mrope = np.concatenate([s.seq.mrope_positions(s.start, s.num_tokens) for s in scheduled],
                                   axis=1).astype(np.int64).tobytes()
        step = StepInput(input_ids.tobytes(), rows.tobytes(), starts.tobytes(), counts.tobytes(), nd, update,
                         logits_indices, seq_ids, mm_rows, mrope_positions=mrope,
                         resid_start=self.resid_start[rows[:nd]].tobytes())
        return step, (torch.cat(mm_parts) if mm_parts else None)

    def _new_row(self, seq_id: int) -> int:
        if not self._free_rows:
            have = self.token_ids.shape[0]
            self._grow(2 * have, self.token_ids.shape[1])
            self._free_rows = list(range(2 * have - 1, have - 1, -1))
        row = self._free_rows.pop()
        self.row_of[seq_id] = row
        self.num_token_ids[row] = 0
        self.sent_blocks[row] = 0
        self.resid_start[row] = -1
        return row

    def _sync_tokens(self, row: int, token_ids: list[int]) -> None:
        """Copy the tokens the row lacks (all of them for a new row; then the sampled ones)."""
        have, total = int(self.num_token_ids[row]), len(token_ids)
        if total == have:
            return
        if total > self.token_ids.shape[1]:
            self._grow(self.token_ids.shape[0], max(total, 2 * self.token_ids.shape[1]))
        if total < have:  # never while a sequence runs; rewrite the row to stay exact
            have = 0
        self.token_ids[row, have:total] = token_ids[have:] if total - have > 1 else token_ids[-1]
        self.num_token_ids[row] = total

    def _grow(self, rows: int, cols: int) -> None:
        old = self.token_ids
        self.token_ids = np.zeros((rows, cols), dtype=np.int32)
        self.token_ids[:old.shape[0], :old.shape[1]] = old
        for name in ("num_token_ids", "sent_blocks", "resid_start"):
            arr = np.full(rows, -1 if name == "resid_start" else 0, dtype=np.int64)
            arr[:len(getattr(self, name))] = getattr(self, name)
            setattr(self, name, arr)
