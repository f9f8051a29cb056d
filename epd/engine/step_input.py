"""One engine step's model inputs, flattened and packed: ``StepInput`` and its builder.

The step's tokens are laid out as in vLLM v1: decode tokens first (one per sequence),
then each prefill chunk. The per-token arrays (input ids, positions, slot mapping) and
the decode block tables are built with numpy, per sequence rather than per token, and
travel as raw little-endian bytes: the model runner wraps them as tensors without a
Python loop (``torch.frombuffer``), and the other TP ranks receive them as one msgpack
``bin`` each (a memcpy, no list of ints to encode or decode). Source: vLLM v1
``gpu_model_runner._prepare_inputs`` (numpy index arithmetic over the persistent batch's
block table), nano-vllm ``ModelRunner.prepare_*``.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from epd.engine.scheduler import SchedulerOutput


class StepInput(msgspec.Struct, tag="step"):
    """A step's flattened tokens (decodes first).

    input_ids / positions / slot_mapping: [num_tokens] int64 bytes; decode_block_tables:
    [num_decodes, decode_width] int32 bytes (rows padded with -1); decode_context_lens:
    [num_decodes] int32 bytes; prefills: (q_start, q_len, context_len, block_table) per
    chunk; logits_indices: rows whose logits are returned, in ``seq_ids`` order. Read
    the arrays with the methods (``tokens()``, ...), which return tensors over the bytes.
    """

    input_ids: bytes
    positions: bytes
    slot_mapping: bytes
    num_decode_tokens: int
    decode_width: int
    decode_block_tables: bytes
    decode_context_lens: bytes
    prefills: list[tuple[int, int, int, list[int]]]
    logits_indices: list[int]
    seq_ids: list[int]
    # (first step row, rows) spans whose input embeddings come from media
    # embeddings; their rows, concatenated in order, travel beside the message.
    mm_rows: list[tuple[int, int]] = []
    # (first staging block, block ids): every rank packs its head slice of these
    # blocks into its part of the staging region, layer by layer (heterogeneous TP).
    kv_packs: list[tuple[int, list[int]]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) // 8

    def tokens(self) -> torch.Tensor:
        """[num_tokens] int64 (a read-only view of the bytes: copy before writing)."""
        return _view(self.input_ids, torch.int64)

    def token_positions(self) -> torch.Tensor:
        """[num_tokens] int64."""
        return _view(self.positions, torch.int64)

    def slots(self) -> torch.Tensor:
        """[num_tokens] int64 KV slot of each token (block id * block_size + offset)."""
        return _view(self.slot_mapping, torch.int64)

    def block_tables(self) -> torch.Tensor:
        """[num_decode_tokens, decode_width] int32, padded with -1."""
        return _view(self.decode_block_tables, torch.int32).view(self.num_decode_tokens, self.decode_width)

    def context_lens(self) -> torch.Tensor:
        """[num_decode_tokens] int32: tokens each decode attends to, its own included."""
        return _view(self.decode_context_lens, torch.int32)


def _view(buf: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not buf:
        return torch.empty(0, dtype=dtype)
    import warnings

    with warnings.catch_warnings():  # bytes are read-only; the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype)


def build_step_input(out: SchedulerOutput, block_size: int) -> tuple[StepInput, torch.Tensor | None]:
    """Flatten a scheduler output: decode tokens first, then prefill chunks.

    Returns the step and the media embedding rows it needs ([rows, hidden], or
    None for a text-only step), in ``mm_rows`` order.
    """
    # A one-token chunk attends exactly like a decode token.
    decodes = [s for s in out.scheduled if s.num_tokens == 1]
    prefills = [s for s in out.scheduled if s.num_tokens != 1]
    nd = len(decodes)
    total = nd + sum(s.num_tokens for s in prefills)
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    width = max((len(s.seq.block_table) for s in decodes), default=0)
    tables = np.full((nd, width), -1, dtype=np.int32)
    ctx_lens = np.empty(nd, dtype=np.int32)
    for k, s in enumerate(decodes):
        seq, p = s.seq, s.start
        bt = seq.block_table
        input_ids[k] = seq.token_ids[p]
        positions[k] = p
        slots[k] = bt[p // block_size] * block_size + p % block_size
        tables[k, :len(bt)] = bt
        ctx_lens[k] = p + 1
    chunks = []
    q = nd
    for s in prefills:
        seq, start, n = s.seq, s.start, s.num_tokens
        pos = np.arange(start, start + n, dtype=np.int64)
        input_ids[q:q + n] = seq.token_ids[start:start + n]
        positions[q:q + n] = pos
        nblk = -(-(start + n) // block_size)
        bt = np.asarray(seq.block_table[:nblk], dtype=np.int64)
        slots[q:q + n] = bt[pos // block_size] * block_size + pos % block_size
        chunks.append((q, n, start + n, list(seq.block_table[:nblk])))
        q += n
    logits_indices: list[int] = []
    seq_ids: list[int] = []
    mm_rows: list[tuple[int, int]] = []
    mm_parts: list[torch.Tensor] = []
    q = 0
    for s in decodes + prefills:
        seq, start, n = s.seq, s.start, s.num_tokens
        for ph, emb in zip(seq.mm_placeholders, seq.mm_embeddings):
            lo, hi = max(start, ph.offset), min(start + n, ph.offset + ph.length)
            if lo < hi:
                mm_rows.append((q + lo - start, hi - lo))
                mm_parts.append(emb[lo - ph.offset:hi - ph.offset])
        q += n
        if s.sample:
            logits_indices.append(q - 1)
            seq_ids.append(seq.seq_id)
    step = StepInput(input_ids.tobytes(), positions.tobytes(), slots.tobytes(), nd, width, tables.tobytes(),
                     ctx_lens.tobytes(), chunks, logits_indices, seq_ids, mm_rows)
    return step, (torch.cat(mm_parts) if mm_parts else None)
