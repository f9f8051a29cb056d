"""One engine step's message to every TP rank (``StepInput``) and the model inputs each
rank lays out from it (``StepLayout``).

The step's tokens are laid out as in vLLM v1: decode tokens first (one per sequence),
then each prefill chunk. The message holds per-sequence arrays (persistent-batch row,
first position, token count), the step's input ids and the block-table changes since the
last step (``epd.engine.block_table``); the per-token arrays (positions, slot mapping)
and the decode block tables are computed from them on each rank with numpy index
arithmetic over the persistent block table, with no Python loop per token or per block.
Arrays travel as raw little-endian bytes (one msgpack ``bin`` each, a memcpy). Source:
vLLM v1 ``gpu_model_runner._prepare_inputs`` (positions and slot mapping from
``query_start_loc`` over the persistent batch's block table), nano-vllm
``ModelRunner.prepare_*``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from epd.engine.block_table import BlockTables, BlockTableUpdate


class StepInput(msgspec.Struct, tag="step"):
    """A step, decodes first.

    input_ids: [num_tokens] int64 bytes. rows: [num_seqs] int32 bytes, each scheduled
    sequence's row of the persistent block table; starts / num_new: [num_seqs] int64
    bytes, its first position and token count this step (the first
    ``num_decode_tokens`` sequences have one token each). table_update: the block-table
    changes to apply before this step. logits_indices: step rows whose logits are
    returned, in ``seq_ids`` order.
    """

    input_ids: bytes
    rows: bytes
    starts: bytes
    num_new: bytes
    num_decode_tokens: int
    table_update: BlockTableUpdate
    logits_indices: list[int]
    seq_ids: list[int]
    # (first step row, rows) spans whose input embeddings come from media
    # embeddings; their rows, concatenated in order, travel beside the message.
    mm_rows: list[tuple[int, int]] = []
    # (first staging block, block ids): every rank packs its head slice of these
    # blocks into its part of the staging region, layer by layer (heterogeneous TP).
    kv_packs: list[tuple[int, list[int]]] = []
    # [3, num_tokens] int64 bytes: M-RoPE positions (time, height, width) when a scheduled
    # sequence has them (Qwen-VL media, ``Sequence.mrope``); empty: positions are the indices.
    mrope_positions: bytes = b""
    # [num_decode_tokens] int64 bytes: for each decode sequence, the first position whose K
    # this worker's decode steps computed (its residual may hold the rows from there on:
    # kv_quant.KResidual), or -1 while it has none; empty: -1 for all.
    resid_start: bytes = b""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) // 8

    def tokens(self) -> torch.Tensor:
        """[num_tokens] int64 (a read-only view of the bytes: copy before writing)."""
        return _view(self.input_ids, torch.int64)


@dataclass(slots=True)
class StepLayout:
    """A step's model inputs on one rank (CPU tensors; the runner moves them).

    input_ids / positions / slot_mapping: [num_tokens] int64 (slot = block id *
    block_size + offset); positions are [3, num_tokens] for an M-RoPE step
    (``StepInput.mrope_positions``). decode_block_tables: [num_decode_tokens, decode_width] int32,
    rows padded with -1; decode_context_lens: [num_decode_tokens] int32 (tokens each
    decode attends to, its own included). prefills: (q_start, q_len, context_len,
    block_table [ceil(context_len / block_size)] int32) per chunk. decode_rows:
    [num_decode_tokens] int64, each decode's persistent-batch row; decode_resid_from:
    [num_decode_tokens] int64, the first offset of its last block whose K its residual
    holds (block_size: none; ``StepInput.resid_start``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_width: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefills: list[tuple[int, int, int, torch.Tensor]]
    decode_rows: torch.Tensor
    decode_resid_from: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def step_layout(step: StepInput, tables: BlockTables, block_size: int) -> StepLayout:
    """Lay out ``step`` over ``tables``, which ``step.table_update`` was already applied to."""
    rows = np.frombuffer(step.rows, dtype=np.int32)
    starts = np.frombuffer(step.starts, dtype=np.int64)
    counts = np.frombuffer(step.num_new, dtype=np.int64)
    nd = step.num_decode_tokens
    q_end = np.cumsum(counts)
    q_start = q_end - counts
    seg = np.repeat(np.arange(len(rows)), counts)
    positions = starts[seg] + (np.arange(int(q_end[-1]) if len(q_end) else 0) - q_start[seg])
    table = tables.table
    slots = table[rows[seg], positions // block_size].astype(np.int64) * block_size + positions % block_size
    dec_rows = rows[:nd]
    resid_start = np.frombuffer(step.resid_start, dtype=np.int64) if step.resid_start else np.full(nd, -1)
    block_start = starts[:nd] - starts[:nd] % block_size
    resid_from = np.where(resid_start < 0, block_size, np.clip(resid_start - block_start, 0, block_size))
    width = int(tables.num_blocks[dec_rows].max()) if nd else 0
    prefills = []
    for k in range(nd, len(rows)):
        ctx = int(starts[k] + counts[k])
        prefills.append((int(q_start[k]), int(counts[k]), ctx,
                         torch.from_numpy(table[rows[k], :-(-ctx // block_size)].copy())))
    return StepLayout(
        input_ids=step.tokens(),
        positions=(_view(step.mrope_positions, torch.int64).view(3, -1) if step.mrope_positions
                   else torch.from_numpy(positions)),
        slot_mapping=torch.from_numpy(slots),
        num_decode_tokens=nd,
        decode_width=width,
        decode_block_tables=torch.from_numpy(table[dec_rows, :width]),
        decode_context_lens=torch.from_numpy((starts[:nd] + 1).astype(np.int32)),
        prefills=prefills,
        decode_rows=torch.from_numpy(dec_rows.astype(np.int64)),
        decode_resid_from=torch.from_numpy(resid_from.astype(np.int64)),
    )


def _view(buf: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not buf:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # bytes are read-only; the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype)
