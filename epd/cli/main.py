"""The ``epd`` command line: its parser, and how a subcommand's errors become exit codes.

Subcommands: generate, launch, serve, worker, keys generate, model create-tiny
(``epd.cli.<name>``), bench (``epd.bench.cli``), diagnose and plan (``epd.ops``).
"""

from __future__ import annotations

import argparse
import os
import sys

from epd.cli import generate, keys, launch, model, serve, worker


def build_parser() -> argparse.ArgumentParser:
    """The ``epd`` parser: one subparser per subcommand, each with ``func`` set to run it."""
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, launch, serve, worker, keys, model):
        command.add_parser(sub)
    from epd.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)  # `epd bench`: the serving benchmark (epd/bench/)
    from epd.ops.diagnose.cli import add_parser as add_diagnose_parser

    add_diagnose_parser(sub)  # `epd diagnose`: a running server's bottleneck from its /metrics (epd/ops/diagnose/)
    from epd.ops.plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub)  # `epd plan`: profile a server, size the pools for a workload and SLOs (epd/ops/plan/)
    return parser


def _catch_signals_while_starting() -> list[int]:
    """SIGTERM / SIGINT caught from here on, before the slow imports (torch) and the
    model load: a worker signalled while it starts (a pod deleted, an autoscaler's
    churn) exits 0 instead of dying by the signal, and one signalled after its
    imports but before its loop runs has them replayed (it drains)."""
    import signal

    caught: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    return caught


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors that are the user's to fix (exit code 2). Imported only once one is raised:
    ``epd.config`` imports torch, which commands such as ``diagnose`` never need."""
    from epd.cluster_auth import ClusterKeysError
    from epd.config import ConfigError
    from epd.launch.spec import LaunchSpecError
    from epd.models.checkpoints import ModelLoadError, ModelNotFoundError

    return ModelNotFoundError, ModelLoadError, ConfigError, LaunchSpecError, ClusterKeysError


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand ``argv`` names (default: ``sys.argv[1:]``); its exit code: 2 for a
    mistake of the user's (the message on stderr), 130 when interrupted, 1 for anything else."""
    args = build_parser().parse_args(argv)
    if args.func is worker.cmd_worker:
        args.early_signals = _catch_signals_while_starting()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"epd {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(e, _user_errors()):
            print(f"epd {args.command}: {e}", file=sys.stderr)
            return 2
        # a user mistake the checks above missed: a message, not a traceback
        if os.environ.get("EPD_DEBUG"):
            raise
        print(f"epd {args.command}: {type(e).__name__}: {e} (set EPD_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
