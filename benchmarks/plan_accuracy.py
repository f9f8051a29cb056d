"""``epd plan`` accuracy: predicted against measured p90 TTFT and ITL on a trace replay.

1. ``epd launch --pools p:1,d:1`` of a tiny random llama widened to hidden 256 x 4 layers
   (built in the run, as tests/serving/test_diagnose_server.py), then ``epd plan profile``;
2. per rate, ``epd plan correct --trace`` (Dynamo's correction factors) while ``epd bench``
   replays *other* rows of the same trace (rows ``--rows``..2x``--rows``) on the profiled
   pools at that rate, as a running deployment would be observed before it is re-planned:
   the profile is fitted to live traffic it is not judged on;
3. ``epd plan recommend`` for rows of the Azure LLM 2023 conversation trace
   (../shared/traces), lengths x ``--scale``, times rescaled to each ``--rate``, under the
   SLOs;
4. ``epd launch`` of the recommended pools and ``epd bench --workload trace`` of the same
   rows at the same rate (same scale, synthetic text calibrated to the model's tokenizer);
   measured p90 TTFT, p90 ITL (chunk gaps) and p90 TPOT against the predictions, and the
   prefill workers' own mean prefill and prefill-queue time over the replay (``/metrics``)
   against the profile's mean prefill time for the same rows: where the replay's prefill is
   slower than the profile's, the workers interfere (e.g. when the P and D processes share cores).

    python benchmarks/plan_accuracy.py                 # rates 4, 8 and 12 req/s, 120 rows (~7 min on 2 cores)
    python benchmarks/plan_accuracy.py --rates 8 --rows 60
    python benchmarks/plan_accuracy.py --prefill-under-decode 0,4   # prefill alone and under 4 decode streams
    python benchmarks/plan_accuracy.py --decode-under-prefill 0   # decode profiled with prefill idle only

The table's "uncorrected" columns are the same pools simulated from the profile before
``epd plan correct`` (the model of the 2026-12-04 runs); ``--no-correct`` skips the correction.

Writes benchmarks/results/plan_accuracy.json (profile, recommendations, bench summaries)
and prints the table (markdown) that benchmarks/README.md quotes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx
import numpy as np
from _common import ROOT, load_avg, serve_epd

from epd.metrics import KV_TRANSFER, PREFILL, PREFILL_QUEUE, TTFT
from epd.ops.plan.fit import PrefillFit, load_profile
from epd.ops.plan.simulate import simulate
from epd.ops.plan.workload import trace_workload
from epd.ops.scrape import Window, metrics_url, scrape

TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"


def small_llama(path: Path) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from epd.models.tiny import create_tiny_model

    path = create_tiny_model("llama", path)
    cfg = AutoConfig.from_pretrained(path)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 768, 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


def epd(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "epd.cli", *args], capture_output=True, text=True, timeout=timeout_s)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"epd {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _err(pred: float, meas: float | None) -> str:
    return "-" if not meas else f"{(pred - meas) / meas * 100:+.0f}%"


def calibrate(model: str, work: Path, profile: Path, rate: float, args: argparse.Namespace) -> None:
    """Replay rows ``rows..2*rows`` of the trace on the profiled pools at ``rate`` and run
    ``epd plan correct --trace`` over it, which writes the factors into ``profile``."""
    duration = args.rows / rate
    window = max(2.0, duration - 3.0)
    print(f"correcting on rows {args.rows}..{2 * args.rows - 1} at {rate:g} req/s (load {load_avg()})", flush=True)
    with serve_epd(model, "p:1,d:1", "0,1", 1, work / f"correct_{rate:g}.log") as url:
        bench = subprocess.Popen([sys.executable, "-m", "epd.cli", "bench", "--base-url", url, "--workload", "trace",
                                  "--trace", str(TRACE), "--trace-start", str(args.rows), "--num-requests",
                                  str(args.rows), "--trace-scale", str(args.scale), "--rate", str(rate),
                                  "--tokenizer", model, "--out", str(work / f"bench_correct_{rate:g}.json"),
                                  "--no-plots",
                                  "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # the window must lie inside the replay: wait for its first answers (the bench loads a
        # tokenizer and sends a warm-up request first), or the observed rate is too low
        t0 = time.monotonic()
        with httpx.Client(timeout=10) as client:
            while scrape(client, metrics_url(url)).total(TTFT + "_count") < 3:
                if bench.poll() is not None or time.monotonic() - t0 > 120:
                    raise RuntimeError(f"the calibration replay did not start: {bench.communicate()[1][-2000:]}")
                time.sleep(0.2)
        r = epd("plan", "correct", "--profile", str(profile), "--url", url, "--window", f"{window:g}", "--trace",
                str(TRACE), "--start", str(args.rows), "--limit", str(args.rows), "--scale", str(args.scale))
        _, err = bench.communicate(timeout=900)
        if bench.returncode != 0:
            raise RuntimeError(f"the calibration replay failed ({bench.returncode}):\n{err[-3000:]}")
    if r.returncode:
        raise RuntimeError(f"epd plan correct failed:\n{r.stderr[-3000:]}")
    print(r.stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 12.0])
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--ttft-slo", type=float, default=0.5)
    ap.add_argument("--itl-slo", type=float, default=0.02)
    ap.add_argument("--max-devices", type=int, default=4)
    ap.add_argument("--prefill-under-decode", default="0,4,8,16",
                    help="epd plan profile's decode stream counts prefill is timed under (default: %(default)s; "
                         "0 alone: no interference table, the model of the first runs)")
    ap.add_argument("--decode-under-prefill", default="0,0.5,1",
                    help="epd plan profile's prefill duty cycles decode is timed under (default: %(default)s; "
                         "0 alone: no decode-under-prefill table, the model of the 2026-12-04 rerun)")
    ap.add_argument("--no-correct", action="store_true",
                    help="predict from the profile as measured (no held-out replay, no `epd plan correct`)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_accuracy.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="plan_accuracy_"))
    model = small_llama(work / "llama")
    profile = work / "profile.json"
    print(f"profiling p:1,d:1 (load {load_avg()})", flush=True)
    with serve_epd(model, "p:1,d:1", "0,1", 1, work / "profile.log") as url:
        print(epd("plan", "profile", "--url", url, "--out", str(profile), "--repeats", "2",
                  "--lengths", "64,256,512,1024,2000",
                  "--prefill-under-decode", str(args.prefill_under_decode),
                  "--decode-under-prefill", str(args.decode_under_prefill)).stdout, flush=True)
    raw = profile
    results: dict = {"profile": json.loads(profile.read_text()), "runs": [], "trace": str(TRACE), "rows": args.rows,
                     "corrected": not args.no_correct,
                     "prefill_under_decode": args.prefill_under_decode,
                     "decode_under_prefill": args.decode_under_prefill,
                     "scale": args.scale, "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo}}
    rows = []
    for rate in args.rates:
        corrected = work / f"profile_{rate:g}.json"
        corrected.write_text(raw.read_text())
        if not args.no_correct:
            calibrate(model, work, corrected, rate, args)
        rec = json.loads(epd("plan", "recommend", "--profile", str(corrected), "--trace", str(TRACE), "--limit",
                             str(args.rows), "--scale", str(args.scale), "--max-model-len", "2048", "--rate",
                             str(rate), "--ttft-slo", str(args.ttft_slo), "--itl-slo", str(args.itl_slo),
                             "--max-devices", str(args.max_devices), "--json").stdout)
        pools = f"p:{rec['replicas']['prefill']},d:{rec['replicas']['decode']}"
        print(f"rate {rate:g}: recommended {rec['pools']} (predicted p90 TTFT {_ms(rec['predicted']['ttft_p90_s'])} ms,"
              f" ITL {_ms(rec['predicted']['itl_p90_s'])} ms); replaying (load {load_avg()})", flush=True)
        bench_out = work / f"bench_{rate:g}.json"
        with serve_epd(model, pools, "0,1", 1, work / f"serve_{rate:g}.log") as url, httpx.Client(timeout=10) as client:
            before = scrape(client, metrics_url(url))
            epd("bench", "--base-url", url, "--workload", "trace", "--trace", str(TRACE), "--num-requests",
                str(args.rows), "--trace-scale", str(args.scale), "--rate", str(rate), "--tokenizer", model,
                "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.itl_slo), "--out", str(bench_out),
                "--no-plots", "--no-progress")
            window = Window(before, scrape(client, metrics_url(url)))
        stages = {name: window.histogram(family, "prefill") for name, family in (("prefill", PREFILL),
                                                                              ("prefill_queue", PREFILL_QUEUE))}
        w = trace_workload(TRACE, args.rows, 0, args.scale, 2048, rate)
        predicted_prefill_s = float(PrefillFit(**results["profile"]["prefill"]).seconds(w.input_len).mean())
        bench_run = json.loads(bench_out.read_text())["runs"][0]
        summary = bench_run["summary"]
        sent = [r["prompt_tokens"] for r in bench_run["records"] if r.get("prompt_tokens")]
        server = {"prefill_mean_s": stages["prefill"].mean, "prefill_queue_mean_s": stages["prefill_queue"].mean,
                  "profile_prefill_mean_s": predicted_prefill_s,
                  "kv_transfer_mean_s": getattr(window.histogram(KV_TRANSFER, "prefill"), "mean", None),
                  "api_ttft_mean_s": getattr(window.histogram(TTFT, "api"), "mean", None),
                  "prompt_tokens_mean": sum(sent) / len(sent) if sent else None,
                  "trace_input_tokens_mean": float(w.input_len.mean())}
        # the same pools under the profile before `epd plan correct`: the model of the earlier runs
        ttft_raw, gaps_raw = simulate(load_profile(raw), w, rec["replicas"]["prefill"], rec["replicas"]["decode"])
        server["ttft_p90_predicted_uncorrected_s"] = float(np.quantile(ttft_raw, 0.9))
        server["itl_p90_predicted_uncorrected_s"] = float(np.quantile(gaps_raw, 0.9)) if len(gaps_raw) else None
        results["runs"].append({"rate": rate, "recommend": rec, "bench": summary, "server": server, "load": load_avg()})
        p, m = rec["predicted"], summary
        c = rec.get("correction", {"prefill": 1.0, "decode": 1.0})
        rows.append(f"| {rate:g} | x{c['prefill']:.2f} / x{c['decode']:.2f} | {rec['pools']} | "
                    f"{_ms(p['ttft_p90_s'])} | {_ms(m['ttft_s']['p90'])} | "
                    f"{_err(p['ttft_p90_s'], m['ttft_s']['p90'])} | "
                    f"{_ms(server['ttft_p90_predicted_uncorrected_s'])} | "
                    f"{_ms(p['itl_p90_s'])} | {_ms(m['itl_s']['p90'])} | "
                    f"{_err(p['itl_p90_s'], m['itl_s']['p90'])} | {_ms(server['itl_p90_predicted_uncorrected_s'])} | "
                    f"{_ms(m['tpot_s']['p90'])} | "
                    f"{_ms(predicted_prefill_s)} | "
                    f"{_ms(server['prefill_mean_s'])} | {_ms(server['prefill_queue_mean_s'])} | {load_avg()[0]} |")
    table = ["| rate req/s | correction prefill / decode | recommended | TTFT p90 predicted ms | measured | error | "
             "uncorrected | "
             "ITL p90 predicted ms | measured | error | uncorrected | TPOT p90 measured ms | "
             "prefill mean: profile alone ms | replay ms | prefill queue mean ms | load 1m |", "|" + "---|" * 16] + rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(table))
    print(f"wrote {args.out} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
