"""Disaggregated vs aggregated serving on the same cores, side by side in one run.

Two pool layouts with the same total devices (3 worker processes, 1 torch thread each,
the whole process tree pinned to the same cores with ``taskset``):

* aggregated    ``--pools e:1,pd:2``   (two engines doing chunked prefill + decode)
* disaggregated ``--pools e:1,p:1,d:1`` (one prefill engine pushing KV to one decode engine)

Each is started with ``epd launch`` (a subprocess, like a user would) and measured with
``epd bench`` (:mod:`epd.bench`) through the OpenAI API:

1. rate sweeps: ``chat`` and ``long-mix`` on the embedded SmolLM2-135M-Instruct,
   ``multimodal`` (1-4 images per request) on a tiny random LLaVA (``epd model
   create-tiny llava``): P99 ITL, P99 TTFT, SLO attainment per rate and DistServe goodput
   (total and per device);
2. cache effects, one request at a time: a repeated 768-token system prompt (prefix cache)
   against a different one each time, a repeated speech clip (Whisper transcript cache)
   and repeated images (encoder cache) against altered ones: TTFT with and without hits.

    python benchmarks/disagg_vs_agg.py            # the full comparison (13-20 min on 2 cores)
    python benchmarks/disagg_vs_agg.py --quick    # smoke run (~10 min): fewer requests and rates

Writes benchmarks/results/disagg_vs_agg.json (every request of every run), the tables as
disagg_vs_agg.md, and PNGs (attainment vs rate and latency CDFs per workload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import ROOT, fmt_ms, fmt_ratio, load_avg, serve_epd

from epd.bench import BenchConfig, RequestRecord, WorkloadOptions, goodput, run_bench, slo_attainment
from epd.bench.cli import write_results
from epd.bench.plots import plot_attainment, plot_cdfs

CONFIGS = {"aggregated": "e:1,pd:2", "disaggregated": "e:1,p:1,d:1"}
DEVICES = 3  # worker processes in either layout


@dataclass
class Sweep:
    """A rate sweep of one workload; SLOs in seconds."""

    workload: str
    model: str  # "smollm2" | "llava"
    rates: list[float]
    num_requests: int
    duration_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    options: WorkloadOptions = field(default_factory=WorkloadOptions)
    loose_slo: tuple[float, float] | None = None  # a second (TTFT, TPOT) pair, computed from the same runs


@dataclass
class CacheCase:
    """TTFT of one-at-a-time requests with cache hits (``hit``) and without (``miss``)."""

    name: str
    model: str
    workload: str
    num_requests: int
    hit: WorkloadOptions
    miss: WorkloadOptions


def plan(quick: bool) -> tuple[list[Sweep], list[CacheCase]]:
    """What to run. Lengths and rates sized for SmolLM2 fp32 on 2 CPU cores."""
    chat = WorkloadOptions(input_len=(32, 128), output_len=32)
    long_mix = WorkloadOptions(input_len=(32, 128), output_len=32, long_share=0.2, long_input_len=(768, 1024))
    mm = WorkloadOptions(input_len=(8, 24), output_len=32, images=(1, 4))
    if quick:
        sweeps = [Sweep("chat", "smollm2", [0.5, 1.5], 6, 15, 2.0, 0.15, chat, (5.0, 0.5)),
                  Sweep("long-mix", "smollm2", [0.5, 1.0], 5, 15, 4.0, 0.15, long_mix, (10.0, 0.5)),
                  Sweep("multimodal", "llava", [2.0, 6.0], 8, 10, 1.0, 0.05, mm, (2.0, 0.15))]
        n_cache = 3
    else:
        sweeps = [Sweep("chat", "smollm2", [0.25, 0.5, 1.0], 16, 30, 2.0, 0.15, chat, (5.0, 0.5)),
                  Sweep("long-mix", "smollm2", [0.125, 0.25, 0.5], 16, 48, 4.0, 0.15, long_mix, (10.0, 0.5)),
                  Sweep("multimodal", "llava", [3.0, 6.0, 12.0], 40, 10, 1.0, 0.05, mm, (2.0, 0.15))]
        n_cache = 5
    sys_prompt = dict(input_len=(16, 24), output_len=4, system_prompt_len=768)
    caches = [
        CacheCase("prefix cache: repeated 768-token system prompt", "smollm2", "chat", n_cache,
                  WorkloadOptions(system_prompt="shared", **sys_prompt),
                  WorkloadOptions(system_prompt="unique", **sys_prompt)),
        CacheCase("transcript cache: repeated speech clip (Whisper tiny.en)", "smollm2", "multimodal", n_cache,
                  WorkloadOptions(audio_share=1.0, media_reuse=1.0, output_len=4),
                  WorkloadOptions(audio_share=1.0, media_reuse=0.0, output_len=4)),
        CacheCase("encoder cache: 4 repeated images (tiny CLIP)", "llava", "multimodal", n_cache * 2,
                  WorkloadOptions(images=(4, 4), media_reuse=1.0, output_len=4),
                  WorkloadOptions(images=(4, 4), media_reuse=0.0, output_len=4)),
    ]
    return sweeps, caches


def _bounded(g: dict, rates: list[float]) -> tuple[float, int]:
    """(rate, direction): direction +1 = at least (every swept rate met the target),
    -1 = below the lowest swept rate (none met it), 0 = interpolated or exact."""
    if g["status"] == "lower_bound":
        return g["rate"], 1
    if g["status"] == "never_met":
        return min(rates), -1
    return g["rate"], 0


def _sweep_goodput(result: dict, ttft_slo_s: float, tpot_slo_s: float) -> tuple[str, dict]:
    """(attainments "a / b / c", goodput dict) of a sweep's records under other SLOs."""
    rates, att = [], []
    for run in result["runs"]:
        recs = [RequestRecord.from_json(r) for r in run["records"]]
        rates.append(run["rate"])
        att.append(slo_attainment(recs, ttft_slo_s, tpot_slo_s)["both"])
    g = goodput(rates, att)
    return " / ".join(f"{a:.0%}" for a in att), {"rate": g.rate, "status": g.status}


def _goodput(g: dict, rates: list[float]) -> str:
    rate, d = _bounded(g, rates)
    mark = {1: ">= ", -1: "< ", 0: ""}[d]
    return f"{mark}{rate:.2f} ({mark}{rate / DEVICES:.2f})"


def _goodput_ratio(num: dict, den: dict, rates: list[float]) -> str:
    """num / den with the direction the bounds allow; "-" when they allow none."""
    (a, da), (b, db) = _bounded(num, rates), _bounded(den, rates)
    if da == db:
        return f"{a / b:.2f}x" if da == 0 else "-"
    return (">= " if da >= db else "<= ") + f"{a / b:.2f}x"


def sweep_table(sweeps: list[Sweep], results: dict) -> str:
    """Markdown: per workload and rate, P99 ITL / P99 TTFT / attainment of both layouts,
    then goodput (req/s, and per device)."""
    out = ["| workload (model) | SLO TTFT / TPOT | rate req/s | P99 ITL ms agg / disagg | agg/disagg | "
           "P99 TTFT ms agg / disagg | attainment agg / disagg |",
           "|---|---|---:|---:|---:|---:|---:|"]
    goodputs = ["| workload | SLO TTFT / TPOT | attainment agg by rate | attainment disagg by rate | "
                "goodput agg req/s (per device) | goodput disagg req/s (per device) | disagg/agg |",
                "|---|---|---|---|---:|---:|---:|"]
    for sw in sweeps:
        agg, dis = results[sw.workload]["aggregated"], results[sw.workload]["disaggregated"]
        for ra, rd in zip(agg["runs"], dis["runs"]):
            sa, sd = ra["summary"], rd["summary"]
            out.append(f"| {sw.workload} ({sw.model}) | {sw.ttft_slo_s} s / {sw.tpot_slo_s} s | {ra['rate']:g} | "
                       f"{fmt_ms(sa['itl_s']['p99'])} / {fmt_ms(sd['itl_s']['p99'])} | "
                       f"{fmt_ratio(sa['itl_s']['p99'], sd['itl_s']['p99'])} | "
                       f"{fmt_ms(sa['ttft_s']['p99'])} / {fmt_ms(sd['ttft_s']['p99'])} | "
                       f"{sa['attainment']['both']:.0%} / {sd['attainment']['both']:.0%} |")
        for ttft, tpot in [(sw.ttft_slo_s, sw.tpot_slo_s)] + ([sw.loose_slo] if sw.loose_slo else []):
            (aa, ga), (ad, gd) = (_sweep_goodput(r, ttft, tpot) for r in (agg, dis))
            goodputs.append(f"| {sw.workload} | {ttft:g} s / {tpot:g} s | {aa} | {ad} | {_goodput(ga, sw.rates)} | "
                            f"{_goodput(gd, sw.rates)} | {_goodput_ratio(gd, ga, sw.rates)} |")
    return "\n".join(out) + "\n\n" + "\n".join(goodputs)


def cache_table(caches: list[CacheCase], results: dict) -> str:
    """Markdown: TTFT p50 without and with cache hits, per layout."""
    out = ["| case | layout | TTFT p50 ms, no hits | TTFT p50 ms, hits | speed-up | cached prompt tokens (hits) |",
           "|---|---|---:|---:|---:|---:|"]
    for c in caches:
        for layout in CONFIGS:
            r = results[c.name][layout]
            miss, hit = r["miss"]["runs"][0], r["hit"]["runs"][0]
            tm, th = miss["summary"]["ttft_s"]["p50"], hit["summary"]["ttft_s"]["p50"]
            cached = [x["cached_tokens"] for x in hit["records"][1:] if x["cached_tokens"] is not None]
            out.append(f"| {c.name} | {layout} | {fmt_ms(tm)} | {fmt_ms(th)} | {fmt_ratio(tm, th)} | "
                       f"{sum(cached) / len(cached) if cached else 0:.0f} |")
    return "\n".join(out)


def report(sweeps: list[Sweep], caches: list[CacheCase], results: dict, meta: dict, out_dir: Path, stem: str) -> None:
    """Print the tables, write them as ``<stem>.md`` and the per-workload PNGs."""
    done_sweeps = [s for s in sweeps if len(results.get(s.workload, {})) == len(CONFIGS)]
    done_caches = [c for c in caches if len(results.get(c.name, {})) == len(CONFIGS)]
    tables = sweep_table(done_sweeps, results) + "\n\n" + cache_table(done_caches, results)
    (out_dir / f"{stem}.md").write_text(tables + "\n")
    for sw in done_sweeps:
        pair = [(layout, results[sw.workload][layout]) for layout in CONFIGS]
        plot_attainment(pair, out_dir / f"{stem}_{sw.workload}_attainment.png")
        plot_cdfs(pair, out_dir / f"{stem}_{sw.workload}_cdf.png")
    print(tables)
    load = meta["load_avg"]
    print(f"load average (1/5/15 min) at start {load['start']}, end {load.get('end')}; wall {meta.get('wall_s')} s; "
          f"wrote {out_dir}/{stem}.*")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: fewer requests and rates")
    p.add_argument("--cores", default="0,1", help="CPUs both layouts are pinned to (taskset -c; default %(default)s)")
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--only", choices=["smollm2", "llava"], default=None, help="run one model's part only")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", type=Path, default=None, help="only rebuild tables and plots from this results JSON")
    args = p.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        sweeps, caches = plan(saved["bench"]["quick"])
        report(sweeps, caches, saved["results"], saved["bench"], args.report.parent, args.report.stem)
        return 0
    sweeps, caches = plan(args.quick)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    meta = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": args.quick, "only": args.only,
            "cores": args.cores, "threads_per_worker": args.threads_per_worker, "configs": CONFIGS,
            "devices": DEVICES, "cpu_count": os.cpu_count(), "load_avg": {"start": load_avg()}}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        from epd.models.tiny import create_tiny_model

        models = {"smollm2": None, "llava": str(create_tiny_model("llava", Path(tmp) / "llava", seed=0))}
        for model_key in ("smollm2", "llava"):
            if args.only and model_key != args.only:
                continue
            for layout, pools in CONFIGS.items():
                print(f"== {model_key} on {layout} ({pools}), cores {args.cores}", flush=True)
                log = args.out_dir / f"disagg_vs_agg_{model_key}_{layout}.log"
                with serve_epd(models[model_key], pools, args.cores, args.threads_per_worker, log) as url:
                    for sw in (s for s in sweeps if s.model == model_key):
                        cfg = BenchConfig(url, workload=sw.workload, rates=sw.rates, num_requests=sw.num_requests,
                                          duration_s=sw.duration_s, ttft_slo_s=sw.ttft_slo_s, tpot_slo_s=sw.tpot_slo_s,
                                          num_devices=DEVICES, options=sw.options, seed=args.seed, progress=False)
                        res = asyncio.run(run_bench(cfg))
                        results.setdefault(sw.workload, {})[layout] = res
                        g = res["goodput"]
                        print(f"  {sw.workload}: " + ", ".join(
                            f"{r['rate']:g} req/s: ITL p99 {fmt_ms(r['summary']['itl_s']['p99'])} ms, TTFT p99 "
                            f"{fmt_ms(r['summary']['ttft_s']['p99'])} ms, "
                            f"attain {r['summary']['attainment']['both']:.0%}"
                            for r in res["runs"]) + f"; goodput {g['rate']:.2f} ({g['status']})", flush=True)
                    for c in (c for c in caches if c.model == model_key):
                        entry = results.setdefault(c.name, {}).setdefault(layout, {})
                        for which, opts in (("miss", c.miss), ("hit", c.hit)):
                            cfg = BenchConfig(url, workload=c.workload, rates=[math.inf], num_requests=c.num_requests,
                                              max_concurrency=1, ttft_slo_s=None, tpot_slo_s=None,
                                              num_devices=DEVICES, options=opts, seed=args.seed + 1, progress=False)
                            entry[which] = asyncio.run(run_bench(cfg))
                        print(f"  {c.name}: TTFT p50 {fmt_ms(entry['miss']['runs'][0]['summary']['ttft_s']['p50'])} ms "
                              f"without hits, {fmt_ms(entry['hit']['runs'][0]['summary']['ttft_s']['p50'])} ms with",
                              flush=True)
                meta["load_avg"][f"{model_key}/{layout}"] = load_avg()
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    meta["load_avg"]["end"] = load_avg()
    stem = "disagg_vs_agg" + ("_quick" if args.quick else "")
    meta["parts"] = {args.only or "all": dict(meta)}  # when and under what load each part ran
    previous = args.out_dir / f"{stem}.json"
    if args.only and previous.exists():  # one model's part: merge into the other part's results
        old = json.loads(previous.read_text())
        if old["bench"].get("quick") == args.quick:
            results = {**old["results"], **results}
            meta["parts"] = {**old["bench"].get("parts", {}), **meta["parts"]}
    write_results({"bench": {"workload": "disagg_vs_agg", **meta}, "runs": [], "results": results},
                  args.out_dir / f"{stem}.json", plots=False)
    report(sweeps, caches, results, meta, args.out_dir, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
