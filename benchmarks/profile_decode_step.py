"""Where one decode step's time goes: GEMMs, attention and the rest, and ops per layer.

SmolLM2-135M-Instruct (embedded default), BATCH sequences of 128 random prompt tokens,
prefilled, 5 warm-up decode steps, then 20 timed steps (``step_ms``: the engine's whole
step, scheduling and sampling included). Then, at the shapes of the last step:

* ``gemm_ms``: every linear layer of every decoder layer, then the LM head, run once each
  in order on ``BATCH`` rows (the weights stream from memory as in a step);
* ``attention_ms``: the paged decode attention kernel on every layer's KV cache with the
  step's block tables and context lengths;
* ``rest_ms``: ``step_ms - gemm_ms - attention_ms`` (norms, RoPE, KV store, activation,
  the Python engine loop, sampling);
* ``ops_per_layer``: the torch dispatcher ops a step runs (torch.profiler), per decoder layer.

Eager (``--enforce-eager``) runs each layer as torch modules, so its GEMMs are counted from
the profiler's ``aten::mm`` / ``addmm`` / ``linear`` self time instead. Prints one JSON line.

    python benchmarks/profile_decode_step.py bfloat16 1 after
    python benchmarks/profile_decode_step.py bfloat16 8 before --enforce-eager
"""

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from epd import LLM, SamplingParams
from epd.kernels.cpu_attention import paged_decode_attention_cpu
from epd.models.checkpoints import resolve_model

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("dtype")
ap.add_argument("batch", type=int)
ap.add_argument("label")
ap.add_argument("--enforce-eager", action="store_true")
ap.add_argument("--quantization", choices=("int8",))
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
B = args.batch
torch.set_num_threads(args.threads)
extra = {"quantization": args.quantization} if args.quantization else {}  # (runs on older epd too)
llm = LLM(str(resolve_model(None)), dtype=args.dtype, kv_cache_memory_gb=0.5, enforce_eager=args.enforce_eager, **extra)
eng = llm.engine
runner = eng.runner
model = runner.model
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
step_ms = (time.perf_counter() - t) / 20 * 1000
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        eng.step()
events = prof.key_averages()
layers = model.model.layers
ops_per_layer = sum(e.count for e in events if e.key.startswith("aten::")) / 10 / len(layers)


def timed(fn, n: int = 10) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1000


dtype = runner.k_cache.dtype
hidden = model.config.hidden_size
if args.enforce_eager:
    gemm_ms = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::linear",
                                                                     "aten::bmm")) / 10 / 1000
else:
    from epd.kernels.linear import linear

    linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    xs = {m: torch.randn(B, m.packed.in_features).to(dtype) for m in linears[:4]}
    inputs = [xs[linears[i % 4]] for i in range(len(linears))]
    head_x = torch.randn(B, hidden).to(dtype)

    def all_gemms():
        for m, x in zip(linears, inputs):
            linear(x, m.packed, m.bias)
        model.compute_logits(head_x)

    gemm_ms = timed(all_gemms)
rows = [s for s in eng.scheduler.running][:B]
width = max(len(s.block_table) for s in rows)
tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in rows], dtype=torch.int32)
ctx = torch.tensor([s.num_computed_tokens + 1 for s in rows], dtype=torch.int32)
attn0 = layers[0].self_attn
q = torch.randn(B, attn0.num_heads, attn0.head_dim).to(dtype)
attention_ms = timed(lambda: [paged_decode_attention_cpu(q, runner.k_cache[i], runner.v_cache[i], tables, ctx,
                                                         attn0.attn.scale) for i in range(len(layers))])
print(json.dumps({"label": args.label, "dtype": args.dtype, "quantization": args.quantization,
                  "fused": getattr(runner, "fused", None) is not None, "B": B, "context": int(ctx.float().mean()),
                  "step_ms": round(step_ms, 1), "gemm_ms": round(gemm_ms, 1), "attention_ms": round(attention_ms, 1),
                  "rest_ms": round(step_ms - gemm_ms - attention_ms, 1), "ops_per_layer": round(ops_per_layer, 1)}))
