"""The persistent batch: every step laid out from its changes-only message equals the
per-token definition (decodes first, then chunks), through chunked prefill, prefix-cache
hits, preemption, finished sequences whose rows are reused and new admissions; a TP
rank's table, fed only the wire messages, stays equal to what the sequences hold; and
a step's message carries only the blocks that are new."""

from __future__ import annotations

import msgspec
import numpy as np

from epd.engine.block_manager import BlockManager
from epd.engine.block_table import BlockTables
from epd.engine.input_batch import InputBatch
from epd.engine.scheduler import Scheduler
from epd.engine.step_input import StepInput, step_layout
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

BS = 4
WIRE = msgspec.msgpack.Decoder(StepInput)


def _expected(out):
    decodes = [s for s in out.scheduled if s.num_tokens == 1]
    order = decodes + [s for s in out.scheduled if s.num_tokens != 1]
    ids, pos, slots = [], [], []
    for s in order:
        for p in range(s.start, s.start + s.num_tokens):
            ids.append(s.seq.token_ids[p])
            pos.append(p)
            slots.append(s.seq.block_table[p // BS] * BS + p % BS)
    return decodes, order, ids, pos, slots


def test_steps_from_changes_equal_the_per_token_definition():
    sched = Scheduler(BlockManager(10, BS, True), 4, 12, 6)
    batch = InputBatch(2, 8)  # fewer rows and columns than needed: both grow
    rank1 = BlockTables(1, 1)  # another TP rank: sees only the wire messages
    shared = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks every prompt below shares
    prompts = [shared + [(7 * i + k) % 50 + 1 for k in range(n)] for i, n in enumerate((1, 5, 9, 3, 7, 2, 6))]
    pending = [Sequence(f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts)]
    seqs = list(pending)
    for s in pending[:4]:
        sched.add(s)
    pending = pending[4:]
    rows_seen, blockless_decode_steps, finished = set(), 0, 0
    for step_no in range(80):
        if not sched.has_unfinished() and not pending:
            break
        if pending and step_no % 5 == 4:
            sched.add(pending.pop(0))
        out = sched.schedule()
        if not out.scheduled:
            continue
        before = {s.seq.seq_id: int(batch.sent_blocks[batch.row_of[s.seq.seq_id]])
                  for s in out.scheduled if s.seq.seq_id in batch.row_of}
        step, mm = batch.build(out, sched.running)
        assert mm is None
        wire = WIRE.decode(msgspec.msgpack.encode(step))
        assert wire == step
        rank1.apply(wire.table_update)
        lay = step_layout(wire, rank1, BS)
        decodes, order, ids, pos, slots = _expected(out)
        assert lay.input_ids.tolist() == ids and lay.positions.tolist() == pos
        assert lay.slot_mapping.tolist() == slots and lay.num_tokens == len(ids)
        assert lay.num_decode_tokens == len(decodes)
        assert lay.decode_context_lens.tolist() == [s.start + 1 for s in decodes]
        for k, s in enumerate(decodes):
            row = lay.decode_block_tables[k].tolist()
            bt = s.seq.block_table
            assert row[:len(bt)] == bt and set(row[len(bt):]) <= {-1}
        for (_q0, n, ctx, bt), s in zip(lay.prefills, order[len(decodes):]):
            assert (n, ctx) == (s.num_tokens, s.start + s.num_tokens)
            assert bt.tolist() == s.seq.block_table[:-(-ctx // BS)]
        # Changes only: a row already sent gets just its blocks past what it had.
        new = sum(len(s.seq.block_table) - before.get(s.seq.seq_id, 0) for s in out.scheduled)
        assert sum(wire.table_update.counts) == new
        if decodes and len(decodes) == len(out.scheduled) and not wire.table_update.blocks:
            blockless_decode_steps += 1
        rows_seen.update(batch.row_of.values())
        done = sched.update(out, {s.seq.seq_id: 3 + step_no % 5 for s in out.scheduled if s.sample})
        for seq in done:
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
                finished += 1
    assert finished == len(prompts) and not pending
    assert sched.num_preemptions > 0  # 10 blocks of 4 for up to 4 sequences of up to 23 tokens
    assert any(s.num_cached_tokens > 0 for s in seqs)  # prefix-cache hits skipped shared blocks
    assert blockless_decode_steps > 0
    assert len(rows_seen) < len(prompts)  # rows of finished sequences were reused
    # Every row the other rank still holds matches rank 0's view (nothing stale).
    for _seq_id, row in batch.row_of.items():
        assert int(rank1.num_blocks[row]) == int(batch.sent_blocks[row])


def test_a_freed_row_is_cleared_on_every_rank():
    tables = BlockTables(2, 4)
    from epd.engine.block_table import BlockTableUpdate

    tables.apply(BlockTableUpdate(rows=[0, 1], starts=[0, 0], counts=[3, 1],
                                  blocks=np.array([7, 8, 9, 4], dtype=np.int32).tobytes()))
    tables.apply(BlockTableUpdate(freed=[0], rows=[1, 5], starts=[1, 0], counts=[1, 2],
                                  blocks=np.array([6, 2, 3], dtype=np.int32).tobytes()))
    assert tables.table[0].tolist() == [-1, -1, -1, -1] and tables.num_blocks[0] == 0
    assert tables.table[1, :2].tolist() == [4, 6] and tables.num_blocks[1] == 2
    assert tables.table[5, :2].tolist() == [2, 3] and tables.num_blocks[5] == 2  # rows grew


def test_the_k_residual_starts_at_the_first_true_decode_of_a_row():
    """``StepInput.resid_start`` (int8's exact K residual, kernels.kv_quant.KResidual) names
    the first position a decode step of the row's sequence computed. A one-token chunk
    partway through a recompute after preemption (the scheduler puts it among the decodes)
    is not a decode: the rows after it come from a prefill and never reach the residual, so
    the residual must not be read for them; nor is a one-token chunk of the prompt. A
    multi-token chunk of a row that kept its row forgets an earlier start."""
    from epd.engine.scheduler import ScheduledSeq, SchedulerOutput

    bs = 16
    seq = Sequence("r", list(range(10)), SamplingParams())
    seq.token_ids += list(range(100, 111))  # 21 tokens: 10 of prompt, 11 generated before a preemption
    seq.block_table = [3, 5]
    batch = InputBatch(4, 32)
    tables = BlockTables(4, 4)

    def step(start, n):
        out = SchedulerOutput(scheduled=[ScheduledSeq(seq, start, n)])
        msg, _ = batch.build(out, [seq])
        tables.apply(msg.table_update)
        lay = step_layout(msg, tables, bs)
        return np.frombuffer(msg.resid_start, dtype=np.int64).tolist(), lay.decode_resid_from.tolist()

    assert step(0, 9) == ([], [])
    assert step(9, 1) == ([-1], [bs])  # the prompt's last token, alone: not a decode
    assert step(10, 1) == ([-1], [bs])  # the recompute's one-token chunk: not a decode
    assert step(11, 10) == ([], [])
    seq.token_ids.append(111)
    assert step(21, 1) == ([21], [5])  # the first decode: block 1's rows 5.. are the residual's
    seq.token_ids.append(112)
    assert step(22, 1) == ([21], [5])
    seq.token_ids += [113, 114]
    assert step(23, 2) == ([], [])  # a multi-token chunk (a recompute that kept its row)
    assert step(24, 1) == ([24], [8])
