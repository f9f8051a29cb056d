"""``epd bench``: the serving benchmark's command line (see :mod:`epd.bench`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from epd.bench.runner import BenchConfig, format_table, run_bench
from epd.bench.workloads import WORKLOADS, WorkloadOptions, calibrate

DEFAULT_OUT_DIR = Path(".")  # the current directory, as vLLM's benchmark writes its results


def _rate(text: str) -> float:
    try:
        r = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (req/s) or 'inf'") from None
    if not r > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0, got {text}")
    return r


def _span(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        span = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LOW-HIGH") from None
    if not 0 < span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"need 0 < LOW <= HIGH, got {text!r}")
    return span


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an ``argparse`` sub-parser set."""
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server: TTFT, TPOT, ITL, SLO attainment, goodput",
                       description="Load generator for any OpenAI-compatible server. One run per --rate (a rate "
                                   "sweep); writes JSON results and PNG plots, prints a table.")
    b.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, with or without /v1")
    b.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    b.add_argument("--workload", choices=WORKLOADS, default="chat")
    b.add_argument("--rate", type=_rate, nargs="+", default=None,
                   help="request rates (req/s; 'inf' = all at once); several = a sweep (default 1; a trace "
                        "without --rate keeps its recorded times)")
    b.add_argument("--cv", type=float, default=1.0,
                   help="coefficient of variation of the gamma inter-arrival gaps (1 = Poisson, 0 = fixed)")
    b.add_argument("--num-requests", "-n", type=int, default=50, help="requests per rate (default %(default)s)")
    b.add_argument("--duration", type=float, default=None,
                   help="seconds of sending per rate: requests scheduled later are not sent")
    b.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (a due request waits; 1 = one at a time)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO, s (default %(default)s)")
    b.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO, s (default %(default)s)")
    b.add_argument("--goodput-target", type=float, default=0.9,
                   help="share of requests that must meet both SLOs (DistServe: 0.9)")
    b.add_argument("--num-devices", type=int, default=None,
                   help="devices the server uses, for goodput per device (default: workers in /epd/workers)")
    b.add_argument("--max-model-len", type=int, default=None, help="default: what /v1/models reports")
    w = b.add_argument_group("workload")
    w.add_argument("--input-len", type=_span, default=(32, 128), help="chat prompt tokens, N or LOW-HIGH")
    w.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    w.add_argument("--long-share", type=float, default=0.2, help="long-mix: share of long prompts")
    w.add_argument("--long-input-len", type=_span, default=(768, 1024), help="long-mix: long prompt tokens")
    w.add_argument("--images", type=_span, default=(1, 4), help="multimodal: images per request (1-4)")
    w.add_argument("--media-reuse", type=float, default=0.0,
                   help="multimodal/voice: share of images and clips sent byte-identical (encoder-cache hits); "
                        "the others are altered slightly per request")
    w.add_argument("--audio-share", type=float, default=0.0,
                   help="multimodal: share of requests carrying a speech clip instead of images")
    w.add_argument("--system-prompt-len", type=int, default=0, help="tokens of a system message in every request")
    w.add_argument("--system-prompt", choices=("shared", "unique"), default="shared",
                   help="the same system message for all requests (prefix-cache hits) or a new one each")
    w.add_argument("--trace", type=Path, default=None, help="trace: a Mooncake .jsonl or Azure .csv file")
    w.add_argument("--trace-scale", type=float, default=None,
                   help="trace: length factor (default: the longest replayed request fills 90%% of max_model_len)")
    w.add_argument("--trace-start", type=int, default=0,
                   help="trace: the first row to replay (0-based; rows before it are skipped)")
    w.add_argument("--trace-speedup", type=float, default=1.0, help="trace without --rate: replay this much faster")
    w.add_argument("--tokenizer", default=None,
                   help="tokenizer dir to calibrate synthetic text's tokens per word (default: the served "
                        "model's, when it is a local directory or the embedded default)")
    o = b.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None,
                   help="results JSON (default ./bench_<workload>.json); plots next to it")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (by default ignore_eos is sent, so outputs have --output-len tokens)")
    o.add_argument("--no-stream-usage", dest="include_usage", action="store_false",
                   help="do not ask for stream_options.include_usage")
    o.add_argument("--warmup", type=int, default=1, help="unrecorded requests sent first (default %(default)s)")
    o.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    b.set_defaults(func=cmd_bench)
    return b


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from parsed ``epd bench`` arguments; raises ValueError on bad values."""
    tokens_per_word = None  # calibrated on the served model's tokenizer (runner.served_tokens_per_word)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokens_per_word = calibrate(AutoTokenizer.from_pretrained(args.tokenizer))
    if args.workload == "trace" and args.trace is None:
        raise ValueError("--workload trace needs --trace FILE")
    opts = WorkloadOptions(input_len=args.input_len, output_len=args.output_len, long_share=args.long_share,
                           long_input_len=args.long_input_len, images=args.images, media_reuse=args.media_reuse,
                           audio_share=args.audio_share, system_prompt_len=args.system_prompt_len,
                           system_prompt=args.system_prompt, trace_path=args.trace)
    rates = args.rate if args.rate is not None else ([] if args.workload == "trace" else [1.0])
    return BenchConfig(base_url=args.base_url, workload=args.workload, rates=rates, cv=args.cv,
                       num_requests=args.num_requests, duration_s=args.duration, seed=args.seed,
                       ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo, goodput_target=args.goodput_target,
                       num_devices=args.num_devices, model=args.model, max_model_len=args.max_model_len, options=opts,
                       trace_speedup=args.trace_speedup, trace_scale=args.trace_scale, trace_start=args.trace_start,
                       ignore_eos=args.ignore_eos,
                       include_usage=args.include_usage, warmup=args.warmup,
                       request_timeout_s=args.request_timeout, max_concurrency=args.max_concurrency,
                       progress=not args.no_progress,
                       tokens_per_word=tokens_per_word)


def _jsonable(obj):
    """Infinite floats (rate ``inf``) as the string "inf", NaN as null; Paths as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj


def write_results(result: dict, out: Path, plots: bool = True) -> list[Path]:
    """Write ``result`` as JSON to ``out`` and, with ``plots``, ``<stem>_cdf.png`` and
    ``<stem>_attainment.png`` beside it. Returns the paths written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(result), indent=1, allow_nan=False))
    written = [out]
    if plots:
        from epd.bench.plots import plot_attainment, plot_cdfs

        name = result["bench"]["workload"]
        written.append(plot_cdfs([(name, result)], out.with_name(out.stem + "_cdf.png")))
        written.append(plot_attainment([(name, result)], out.with_name(out.stem + "_attainment.png")))
    return written


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"epd bench: {e}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_bench(cfg))
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"epd bench: {e}", file=sys.stderr)
        return 2
    out = args.out or DEFAULT_OUT_DIR / f"bench_{cfg.workload}.json"
    written = write_results(result, out, plots=not args.no_plots)
    print(format_table(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
