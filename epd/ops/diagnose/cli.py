"""The ``epd diagnose`` subcommand: :func:`add_parser` adds it, :func:`cmd_diagnose` runs it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from epd.cli import validators
from epd.ops.diagnose.observe import diagnose
from epd.ops.diagnose.symptoms import SYMPTOMS, Settings
from epd.ops.diagnose.thresholds import DEFAULT_INTERVAL_S, DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S
from epd.ops.scrape import MetricsError

__all__ = ["add_parser", "cmd_diagnose"]


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``diagnose`` subcommand to an ``argparse`` sub-parser set."""
    d = sub.add_parser("diagnose", help="read a running server's /metrics over a window and name its bottleneck",
                       description="Scrapes URL/metrics twice, --window seconds apart (gauges every --interval), "
                                   "reports per pool the rates and p50/p95/p99 of every stage, KV usage, "
                                   "preemptions and cache hit rates, and the symptoms it matches with their likely "
                                   "cause and the fix to try. Exit code: 0 healthy, 1 a symptom, 2 the server "
                                   "could not be read, 3 nothing judged (no or too little traffic in the window).")
    d.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    d.add_argument("--window", type=validators.positive_float, default=60.0,
                   help="seconds between the two scrapes (default: %(default)s)")
    d.add_argument("--interval", type=validators.positive_float, default=DEFAULT_INTERVAL_S,
                   help="seconds between the gauge samples inside the window (default: %(default)s)")
    d.add_argument("--ttft-slo", type=validators.positive_float, default=DEFAULT_TTFT_SLO_S,
                   help="TTFT SLO of the goodput check, seconds (default: %(default)s)")
    d.add_argument("--tpot-slo", type=validators.positive_float, default=DEFAULT_TPOT_SLO_S,
                   help="TPOT SLO of the goodput check, seconds (default: %(default)s)")
    d.add_argument("--ignore", action="append", default=[], choices=sorted(SYMPTOMS), metavar="ID",
                   help="a symptom that does not count (repeatable), e.g. prefix_cache_miss for prompts that "
                        "never repeat")
    d.add_argument("--timeout", type=validators.positive_float, default=10.0, help="seconds one scrape may take")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_diagnose)
    return d


def cmd_diagnose(args: argparse.Namespace) -> int:
    """Run ``epd diagnose``: print the report (text or ``--json``); return its exit code, 2 when
    the server could not be read."""
    try:
        report = diagnose(args.url, args.window, interval_s=args.interval,
                          settings=Settings(args.ttft_slo, args.tpot_slo), ignore=tuple(args.ignore),
                          timeout_s=args.timeout)
    except MetricsError as e:
        return _unreadable(args, str(e))
    except Exception as e:  # never exit 1 (a symptom) for a failure of our own
        if os.environ.get("EPD_DEBUG"):
            raise
        return _unreadable(args, f"{type(e).__name__}: {e} (set EPD_DEBUG=1 for the traceback)")
    print(json.dumps(report.to_json(), indent=2) if args.json else report.format_text())
    return report.exit_code


def _unreadable(args: argparse.Namespace, message: str) -> int:
    """Exit code 2, saying why (also as JSON on stdout under ``--json``)."""
    if args.json:
        print(json.dumps({"url": args.url, "error": message}))
    print(f"epd diagnose: {message}", file=sys.stderr)
    return 2
