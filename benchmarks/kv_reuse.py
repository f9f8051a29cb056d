"""The KV-cache-centric pool on the Mooncake conversation trace: KV bytes moved P -> D
per request, prefix hit shares and TTFT, with the pool off (``--no-decode-kv-reuse
--no-remote-prefix-reads``), with decode-side reuse, with a host tier
(``--kv-host-cache-gb 1``), a disk tier under a smaller one, and everything on
(remote prefix reads between the two prefill instances too).

The runs replay the same rows of ``../shared/traces/mooncake_conversation_trace.jsonl``:
whole conversations, in order of their first turn, each turn at most 8,000 tokens
(:func:`conversation_rows`), lengths scaled by ``SCALE`` as ``epd bench --workload trace
--trace-scale`` does (each ``hash_ids`` block becomes the same text wherever it recurs),
on ``p:2,d:1`` with the
embedded SmolLM2-135M-Instruct and a small KV cache (``KV_GB`` per worker, so the replay
evicts), one request at a time (``--max-concurrency 1``, so TTFT is each request's own,
not queueing), or with ``--rate R`` at the trace's recorded arrival times rescaled to a
mean of R requests/s (``epd bench``'s rescaling keeps the trace's bursts; the rows' first
turns arrive close together). The trace's theoretical share is the share of the
replayed rows' prompt blocks whose hash id an earlier replayed row already had (an
unbounded cache). Bytes come from the servers' ``epd_kv_transfer_bytes_total`` and
``epd_kv_transfer_saved_bytes_total``; hit shares from the workers' prefix-cache stats.

    python benchmarks/kv_reuse.py [--rows 40] [--quick] [--rate R] [--modes off,all]

Prints a table; writes ``benchmarks/results/kv_reuse.json`` and ``.png`` (``_quick``
with ``--quick``, ``_rate<R>`` with ``--rate``); ``--report FILE.json`` rebuilds both
from a saved run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from pathlib import Path

import httpx
from _common import ROOT, fmt_ms, git_commit, load_avg, serve_epd

from epd.bench import BenchConfig, WorkloadOptions, run_bench
from epd.bench.traces import block_tokens, load_trace, scale_trace

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
POOLS = "p:2,d:1"
#: KV cache per worker, GiB: small enough that the replay evicts (what the host tier is for)
KV_GB = "0.15"
_NO_REMOTE = ("--no-remote-prefix-reads",)
MODES = {"off": ("--no-decode-kv-reuse", *_NO_REMOTE), "decode-reuse": _NO_REMOTE,
         "decode-reuse+host": ("--kv-host-cache-gb", "1", *_NO_REMOTE),
         # a host tier a quarter that size over a disk tier (one anonymous file per worker in /var/tmp)
         "decode-reuse+host+disk": ("--kv-host-cache-gb", "0.25", "--kv-disk-cache-dir", "/var/tmp",
                                    "--kv-disk-cache-gb", "1", *_NO_REMOTE),
         # decode-side reuse, the host tier and remote prefix reads between the prefill instances
         "all": ("--kv-host-cache-gb", "1")}


#: longest turn (input + output tokens, before scaling) of a replayed conversation
MAX_TURN_TOKENS = 8000
#: the trace's lengths times this (a 512-token hash block becomes 128 tokens): prompts of
#: about 1,000 tokens and answers of about 100, so 3 x 40 requests take minutes on 2 cores
SCALE = 0.25


def conversation_rows(n: int) -> list:
    """Whole conversations of the trace (rows whose first two ``hash_ids`` agree: a turn
    carries the earlier turns' blocks), in order of their first turn, every turn at most
    ``MAX_TURN_TOKENS``, until ``n`` rows; returned in trace order. Consecutive rows
    would hold almost no reuse (a conversation's turns lie far apart in the trace)."""
    rows = load_trace(TRACE, limit=None)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r.hash_ids[:2]), []).append(i)
    picked: list[int] = []
    for g in groups.values():  # (dicts keep insertion order: by first turn)
        if len(picked) >= n:
            break
        if all(rows[i].input_len + rows[i].output_len <= MAX_TURN_TOKENS for i in g):
            picked += g
    return [rows[i] for i in sorted(picked)]


def theoretical_share(rows) -> float:
    """Share of the rows' prompt blocks whose hash id an earlier row had (unbounded cache)."""
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        for h in r.hash_ids:
            hit += h in seen
            total += 1
            seen.add(h)
    return hit / total if total else float("nan")


def counters(url: str) -> dict[str, float]:
    """The KV byte counters, summed over instances."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("epd_kv_transfer_bytes_total", "epd_kv_transfer_saved_bytes_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return out


def worker_stats(url: str) -> dict[str, float]:
    """Prefix-cache lookups and hits (tokens) of the prefill pool and of decode (host-tier
    hits among them); decode's reused blocks."""
    w = httpx.get(url + "/epd/workers", timeout=30).json()
    pre = [s for k, s in w.items() if k.startswith("prefill")]
    dec = w["decode-0"]
    return {"prefill_query_tokens": sum(s.get("prefix_cache_query_tokens", 0) for s in pre),
            "prefill_hit_tokens": sum(s.get("prefix_cache_hit_tokens", 0) for s in pre),
            "prefill_host_hit_tokens": sum(s.get("prefix_cache_host_hit_tokens", 0) for s in pre),
            "decode_host_hit_tokens": dec.get("prefix_cache_host_hit_tokens", 0),
            "disk_hit_tokens": sum(s.get("prefix_cache_disk_hit_tokens", 0) for s in (*pre, dec)),
            "remote_hit_tokens": sum(s.get("prefix_cache_remote_hit_tokens", 0) for s in pre),
            "decode_query_tokens": dec.get("prefix_cache_query_tokens", 0),
            "decode_hit_tokens": dec.get("prefix_cache_hit_tokens", 0),
            "decode_reused_blocks": dec.get("kv_reused_blocks", 0)}


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def run_mode(mode: str, rows: int, out_dir: Path, seed: int, rate: float | None = None) -> dict:
    log = out_dir / f"kv_reuse_{mode}.log"
    with serve_epd(None, POOLS, "0,1", 1, log, extra=("--kv-cache-memory-gb", KV_GB, *MODES[mode])) as url:
        max_len = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
        replayed, scale = scale_trace(conversation_rows(rows), int(max_len * 0.9), SCALE)
        opts = WorkloadOptions(trace_path=TRACE, trace_rows=replayed, trace_block_tokens=block_tokens(scale))
        rows = len(replayed)
        cfg = BenchConfig(url, workload="trace", rates=[rate or math.inf], num_requests=rows,
                          max_concurrency=None if rate else 1,
                          options=opts, seed=seed, progress=False, ttft_slo_s=2.0, tpot_slo_s=0.1)
        c0, w0 = counters(url), worker_stats(url)
        res = asyncio.run(run_bench(cfg))
        time.sleep(1.0)  # worker counters move once per heartbeat
        c, w = _delta(counters(url), c0), _delta(worker_stats(url), w0)
    summary = res["runs"][0]["summary"]
    n_ok = summary["completed"] or 1
    return {"mode": mode, "scale": scale, "block_tokens": opts.trace_block_tokens,
            "theoretical_share": theoretical_share(opts.trace_rows[:rows]),
            "prefill_hit_share": _share(w["prefill_hit_tokens"], w["prefill_query_tokens"]),
            "decode_hit_share": _share(w["decode_hit_tokens"], w["decode_query_tokens"]),
            "host_hit_share": _share(w["prefill_host_hit_tokens"] + w["decode_host_hit_tokens"],
                                     w["prefill_query_tokens"] + w["decode_query_tokens"]),
            "disk_hit_share": _share(w["disk_hit_tokens"], w["prefill_query_tokens"] + w["decode_query_tokens"]),
            "remote_hit_share": _share(w.get("remote_hit_tokens", 0), w["prefill_query_tokens"]),
            "kv_bytes_per_request": c["epd_kv_transfer_bytes_total"] / n_ok,
            "kv_saved_bytes_per_request": c["epd_kv_transfer_saved_bytes_total"] / n_ok,
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            # one run, no sweep: goodput as the requests/s that met both SLOs
            "goodput_rps": (summary["request_throughput"] or 0) * (summary["attainment"]["both"] or 0),
            "slo_attainment": summary["attainment"]["both"], "num_ok": n_ok, "workers": w, "bench": res}


def table(results: dict) -> str:
    lines = ["| mode | trace share | prefill hit share | of which remote | decode hit share | host-tier share "
             "| of which disk | KV MB P->D / req | saved MB / req | TTFT p50 ms | TTFT p99 ms | goodput req/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        r = results.get(mode)
        if r is None:
            continue
        lines.append(f"| {mode} | {r['theoretical_share']:.1%} | {r['prefill_hit_share']:.1%} | "
                     f"{r.get('remote_hit_share', 0.0):.1%} | "
                     f"{r['decode_hit_share']:.1%} | {r['host_hit_share']:.1%} | "
                     f"{r.get('disk_hit_share', 0.0):.1%} | "
                     f"{r['kv_bytes_per_request'] / 1e6:.2f} | "
                     f"{r['kv_saved_bytes_per_request'] / 1e6:.2f} | {fmt_ms(r['ttft_p50_s'])} | "
                     f"{fmt_ms(r['ttft_p99_s'])} | {r['goodput_rps']:.2f} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    """Bars per mode: KV MB moved P -> D per request, hit shares (the trace's theoretical
    share as a line) and TTFT p50 / p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m in results]
    rs = [results[m] for m in modes]
    x = range(len(modes))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    axes[0].bar(x, [r["kv_bytes_per_request"] / 1e6 for r in rs], color="tab:blue", label="moved")
    axes[0].bar(x, [r["kv_saved_bytes_per_request"] / 1e6 for r in rs],
                bottom=[r["kv_bytes_per_request"] / 1e6 for r in rs], color="tab:green", alpha=0.6, label="saved")
    axes[0].set_title("KV P->D per request (MB)")
    axes[0].legend(fontsize=8)
    w = 0.27
    for k, (key, label) in enumerate((("prefill_hit_share", "prefill"), ("decode_hit_share", "decode"),
                                      ("host_hit_share", "host tier"))):
        axes[1].bar([i + (k - 1) * w for i in x], [100 * r[key] for r in rs], w, label=label)
    axes[1].axhline(100 * rs[0]["theoretical_share"], color="k", ls="--", lw=1, label="trace (unbounded)")
    axes[1].set_title("prefix hit share (%)")
    axes[1].legend(fontsize=8)
    axes[2].bar([i - 0.2 for i in x], [1000 * r["ttft_p50_s"] for r in rs], 0.4, label="p50")
    axes[2].bar([i + 0.2 for i in x], [1000 * r["ttft_p99_s"] for r in rs], 0.4, label="p99")
    axes[2].set_title("TTFT (ms)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), modes, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=40, help="trace rows replayed (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=None,
                   help="the trace's arrival times rescaled to this mean rate, requests/s "
                        "(default: one request at a time)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (default: all of them)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--report", type=Path, default=None, help="only rebuild the table and plot from this results JSON")
    args = p.parse_args(argv)
    if args.report:
        results = json.loads(args.report.read_text())["results"]
        print(table(results))
        print(f"plot: {plot(results, args.report.with_suffix('.png'))}")
        return 0
    rows = 8 if args.quick else args.rows
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
            "pools": POOLS, "rows": rows, "trace": TRACE.name, "load_avg": {"start": load_avg()}}
    results = {}
    meta["rate"] = args.rate
    for mode in args.modes.split(","):
        print(f"== KV pool {mode}", flush=True)
        results[mode] = run_mode(mode, rows, args.out_dir, args.seed, args.rate)
        meta["load_avg"][mode] = load_avg()
    print(table(results))
    out = args.out_dir / (f"kv_reuse{'_quick' if args.quick else ''}{f'_rate{args.rate:g}' if args.rate else ''}"
                          ".json")
    out.write_text(json.dumps({"bench": meta, "results": results}, indent=1, default=str))
    print(f"results: {out}; plot: {plot(results, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
