"""What building one step's input costs on rank 0, and what the TP ranks receive.

B sequences with CTX-token prompts, prefilled, then 50 decode steps: the median time of
``InputBatch.build`` (the persistent batch) and of every rank's ``step_layout`` over its
block table, and the msgpack size of the step message sent to the other TP ranks.
No model runs (scheduler, block manager and batch only). Prints a table, saves JSON.

    python benchmarks/step_build.py
"""

import json
import pathlib
import time

import msgspec

from epd.engine.block_manager import BlockManager
from epd.engine.block_table import BlockTables
from epd.engine.input_batch import InputBatch
from epd.engine.scheduler import Scheduler
from epd.engine.step_input import step_layout
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

BS = 16
rows = []
for B, ctx in ((32, 1024), (32, 4096), (128, 1024)):
    sched = Scheduler(BlockManager(B * (ctx // BS + 8), BS, False), B, 1 << 30)
    batch, tables = InputBatch(B, ctx + 128), BlockTables(B, ctx // BS + 8)
    for i in range(B):
        sched.add(Sequence(str(i), [(i * 7 + k) % 1000 + 1 for k in range(ctx)],
                           SamplingParams(max_tokens=10000, ignore_eos=True)))
    out = sched.schedule()
    step, _ = batch.build(out, sched.running)
    tables.apply(step.table_update)
    sched.update(out, {s.seq.seq_id: 5 for s in out.scheduled})
    build, lay, sizes = [], [], []
    for _ in range(50):
        out = sched.schedule()
        t = time.perf_counter()
        step, _ = batch.build(out, sched.running)
        t1 = time.perf_counter()
        tables.apply(step.table_update)
        step_layout(step, tables, BS)
        t2 = time.perf_counter()
        build.append(t1 - t)
        lay.append(t2 - t1)
        sizes.append(len(msgspec.msgpack.encode(step)))
        sched.update(out, {s.seq.seq_id: 5 for s in out.scheduled})
    rows.append({"B": B, "ctx": ctx, "build_us": round(sorted(build)[25] * 1e6),
                 "layout_us": round(sorted(lay)[25] * 1e6),
                 "tp_message_bytes_median": sorted(sizes)[25], "tp_message_bytes_max": max(sizes)})
print("| sequences | context | build µs | layout µs (each rank) | TP message bytes, median / max |")
print("|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['B']} | {r['ctx']} | {r['build_us']} | {r['layout_us']} | "
          f"{r['tp_message_bytes_median']} / {r['tp_message_bytes_max']} |")
out = pathlib.Path(__file__).parent / "results" / "step_build.json"
out.parent.mkdir(exist_ok=True)
out.write_text(json.dumps(rows, indent=1))
