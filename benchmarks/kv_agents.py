"""Staged KV transfers of a TP instance: rank 0's agent (``--kv-agents rank0``) vs per-rank agents.

A random Llama built here (hidden 512, 8 layers, 8 heads, 4 KV heads of 64 dims, fp32:
2 KiB of K+V per token per layer, 16 KiB per token) served on ``p:2,d:1``, ``p:1,d:2``
and ``p:2,d:2`` (``--tp`` the same) on the CPU, prefill and decode started in this
process as ``epd launch`` does (router + launcher of worker processes). For each mode,
pair and prompt length, ``--reps`` greedy requests of ``max_tokens=2`` with fresh random
token ids (no prefix-cache hits); medians of:

* ``wall_s``: request sent .. last token received (prefill, KV move, decode-side
  unpack, one decode step): what the KV path costs the request end to end;
* ``prefill_s`` (the prefill forward, packs and, on CPU, the synchronous cma copies
  inside the writes), ``kv_transfer_s`` (first write .. every rank's writes done) and
  ``num_transfer_requests`` (NIXL writes of every rank) from the prefill worker's
  ``PrefillDone``.

    python benchmarks/kv_agents.py                      # both modes, 3 pairs, 512/1024/2048 tokens
    python benchmarks/kv_agents.py --quick              # 1 pair (p:2,d:1), 512 tokens, 1 rep

Writes benchmarks/results/kv_agents.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

PAIRS = ("p:2,d:1", "p:1,d:2", "p:2,d:2")
MODES = ("rank0", "per-rank")


def build_model(out: Path) -> Path:
    """A random Llama (see the module docstring) with epd's tiny tokenizer, in ``out``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from epd.models.tiny import create_tiny_model

    if (out / "config.json").exists():
        return out
    tiny = create_tiny_model("llama", out.parent / "tiny-llama")
    cfg = LlamaConfig.from_pretrained(tiny)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 512, 1024, 8
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 4, 64
    cfg.max_position_embeddings = 4096
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


async def _run(model: Path, mode: str, pair: str, lengths: list[int], reps: int, log_dir: Path) -> dict:
    from epd.launch.spec import build_launch_plan
    from epd.launch.supervisor import Launcher
    from epd.router.router import Router, RouterRequest
    from epd.sampling_params import SamplingParams

    plan = build_launch_plan(pair, pair, num_attention_heads=8, num_kv_heads=4)
    worker_args = ["--max-model-len", str(max(lengths) + 16), "--num-kv-blocks", "1024", "--block-size", "16",
                   "--kv-staging-mb", "256", "--kv-agents", mode]
    router = Router(stage_timeout_s=600, token_timeout_s=600)
    await router.start()
    launcher = Launcher(plan, model=str(model), router_endpoint=router.endpoint, threads_per_worker=1,
                        extra_worker_args=worker_args, log_dir=log_dir)
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    try:
        launcher.start()
        await router.wait_ready({"prefill": 1, "decode": 1}, 300, on_poll=lambda: None)

        async def one(rid: str, n: int) -> dict:
            prompt = torch.randint(17, 400, (n,), generator=gen).tolist()
            req = RouterRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            stats = None
            t0 = time.perf_counter()
            async for ev in router.generate(req):
                if stats is None:
                    stats = ev.prefill_stats
            return dict(stats, wall_s=time.perf_counter() - t0)

        await one("warmup", 64)
        for n in lengths:
            samples = [await one(f"{mode}-{pair}-{n}-{i}", n) for i in range(reps)]
            med = {k: statistics.median(s[k] for s in samples)
                   for k in ("wall_s", "prefill_s", "kv_transfer_s", "kv_bytes")}
            med["num_transfer_requests"] = samples[0]["num_transfer_requests"]
            out[str(n)] = med
            print(f"  {mode:8s} {pair}  {n:5d} tokens: wall {med['wall_s'] * 1e3:7.1f} ms, prefill "
                  f"{med['prefill_s'] * 1e3:7.1f} ms, transfer {med['kv_transfer_s'] * 1e3:6.1f} ms, "
                  f"{med['num_transfer_requests']} writes, {med['kv_bytes'] / 1e6:.1f} MB", flush=True)
    finally:
        try:
            await router.stop()
        finally:
            launcher.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pairs", nargs="+", default=list(PAIRS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.reps, args.pairs = [512], 1, ["p:2,d:1"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from epd import metrics

    metrics.setup_multiprocess_dir()  # once per process, before any run
    work = Path(tempfile.mkdtemp(prefix="epd-kv-agents-"))
    model = build_model(work / "llama-512")
    results: dict = {}
    for pair in args.pairs:
        for mode in MODES:
            log_dir = work / f"logs-{mode}-{pair.replace(':', '').replace(',', '-')}"
            log_dir.mkdir()
            results.setdefault(pair, {})[mode] = asyncio.run(_run(model, mode, pair, args.lengths, args.reps,
                                                                  log_dir))
    print(f"\n{'pair':9s} {'tokens':>6s} | {'rank0 wall ms':>13s} {'per-rank wall ms':>16s} | "
          f"{'rank0 writes':>12s} {'per-rank writes':>15s}")
    for pair, modes in results.items():
        for n in map(str, args.lengths):
            a, b = modes["rank0"][n], modes["per-rank"][n]
            print(f"{pair:9s} {n:>6s} | {a['wall_s'] * 1e3:13.1f} {b['wall_s'] * 1e3:16.1f} | "
                  f"{a['num_transfer_requests']:12d} {b['num_transfer_requests']:15d}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
           "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__, "reps": args.reps,
           "threads_per_worker": 1, "results": results}
    path = args.out_dir / "kv_agents.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
