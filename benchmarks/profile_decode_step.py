"""Where one decode step's time goes: the step's wall time and the torch profiler's top ops.

SmolLM2-135M-Instruct (embedded default), BATCH sequences of 128 random prompt tokens,
prefilled, 5 warm-up decode steps, 20 timed steps (``step_ms``), then 10 profiled ones
(torch.profiler, CPU; ``torch_ops_ms`` is their self time per step, so time spent outside
torch ops, such as the C++ CPU decode kernel and Python, is ``step_ms - torch_ops_ms``).
Prints one JSON line.

    python benchmarks/profile_decode_step.py bfloat16 32 after
"""

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from epd import LLM, SamplingParams
from epd.models.checkpoints import resolve_model

dtype, B, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(2)
llm = LLM(str(resolve_model(None)), dtype=dtype, kv_cache_memory_gb=0.5)
eng = llm.engine
g = torch.Generator().manual_seed(0)
prompts = torch.randint(17, 40000, (B, 128), generator=g).tolist()
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for i, pr in enumerate(prompts):
    eng.add_request(str(i), pr, p)
while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
    eng.step()
for _ in range(5):
    eng.step()
t = time.perf_counter()
for _ in range(20):
    eng.step()
dt = (time.perf_counter() - t) / 20
with profile(activities=[ProfilerActivity.CPU]) as prof:
    t = time.perf_counter()
    for _ in range(10):
        eng.step()
    wall = (time.perf_counter() - t) / 10
ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
ops = [(e.key, e.self_cpu_time_total / 10 / 1000) for e in ev[:6]]
covered = sum(e.self_cpu_time_total for e in ev) / 10 / 1000
print(json.dumps({"label": label, "dtype": dtype, "B": B, "step_ms": round(dt * 1000, 1),
                  "profiled_step_ms": round(wall * 1000, 1), "torch_ops_ms": round(covered, 1),
                  "top": [(k, round(v, 1)) for k, v in ops]}))
