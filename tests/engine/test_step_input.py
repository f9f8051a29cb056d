"""The packed step input: the numpy builder lays tokens out as the per-token definition
says (decodes first, then chunks), and the bytes survive the TP wire format."""

from __future__ import annotations

import msgspec

from epd.engine.block_manager import BlockManager
from epd.engine.scheduler import Scheduler
from epd.engine.step_input import StepInput, build_step_input
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

BS = 4


def test_layout_matches_the_per_token_definition():
    sched = Scheduler(BlockManager(64, BS, True), 8, 12)
    seqs = [Sequence(f"r{i}", [(7 * i + k) % 50 + 1 for k in range(n)], SamplingParams(max_tokens=4))
            for i, n in enumerate((5, 9, 14))]
    for s in seqs:
        sched.add(s)
    for _ in range(4):  # a mix: decodes and chunked prefills
        out = sched.schedule()
        step, mm = build_step_input(out, BS)
        decodes = [s for s in out.scheduled if s.num_tokens == 1]
        rows = decodes + [s for s in out.scheduled if s.num_tokens != 1]
        ids, pos, slots = [], [], []
        for s in rows:
            for p in range(s.start, s.start + s.num_tokens):
                ids.append(s.seq.token_ids[p])
                pos.append(p)
                slots.append(s.seq.block_table[p // BS] * BS + p % BS)
        assert step.tokens().tolist() == ids and step.token_positions().tolist() == pos
        assert step.slots().tolist() == slots and step.num_tokens == len(ids) and mm is None
        assert step.context_lens().tolist() == [s.start + 1 for s in decodes]
        for k, s in enumerate(decodes):
            row = step.block_tables()[k].tolist()
            assert row[:len(s.seq.block_table)] == s.seq.block_table and set(row[len(s.seq.block_table):]) <= {-1}
        wire = msgspec.msgpack.Decoder(StepInput).decode(msgspec.msgpack.encode(step))
        assert wire == step
        sched.update(out, {s.seq.seq_id: 3 for s in out.scheduled if s.sample})
