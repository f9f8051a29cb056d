"""The ``epd plan`` subcommand and its ``profile``, ``correct`` and ``recommend`` commands
(:func:`add_parser`).

Exit codes: 0 done (recommend: the SLOs can be met), 1 no candidate within
``--max-devices`` meets them, 2 bad input (a missing or malformed profile or trace, a
server that cannot be read, an output file that cannot be written; ``correct``: also a
server that serves another model than the profile's, or a window with fewer than
:data:`~epd.ops.plan.correct.MIN_OBSERVED_REQUESTS` streamed requests).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import epd.ops.plan
from epd.cli.validators import non_negative_float, non_negative_int, positive_float, positive_int
from epd.ops.plan.apply import apply, write_file
from epd.ops.plan.correct import corrected, fit_corrections, observe_server
from epd.ops.plan.errors import PlanError
from epd.ops.plan.fit import CORRECTION_RANGE, Profile, load_profile
from epd.ops.plan.profile import DEFAULT_BATCHES, DEFAULT_CONTEXTS, DEFAULT_PREFILL_LENGTHS, profile_server
from epd.ops.plan.recommend import extrapolation_warnings, pools_text, recommend
from epd.ops.plan.workload import Workload, synthetic_workload, trace_workload
from epd.roles import Role

__all__ = ["add_parser", "cmd_correct", "cmd_profile", "cmd_recommend"]


def _ints_at_least(text: str, floor: int) -> tuple[int, ...]:
    try:
        xs = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not xs or min(xs) < floor:
        raise argparse.ArgumentTypeError(f"every number must be >= {floor}, got {text!r}")
    return xs


def _positive_ints(text: str) -> tuple[int, ...]:
    return _ints_at_least(text, 1)


def _non_negative_ints(text: str) -> tuple[int, ...]:
    return _ints_at_least(text, 0)


def _duties(text: str) -> tuple[float, ...]:
    try:
        xs = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not xs or not all(0 <= x <= 1 for x in xs):
        raise argparse.ArgumentTypeError(f"every duty must be within 0..1, got {text!r}")
    return xs


#: the longest ``epd plan correct --window`` (a day), seconds
MAX_WINDOW_S = 86400.0


def _window(text: str) -> float:
    x = positive_float(text)
    if x > MAX_WINDOW_S:
        raise argparse.ArgumentTypeError(f"at most {MAX_WINDOW_S:g} s, got {text}")
    return x


def _writable(path: str | Path) -> Path:
    """``path`` as a file that can be written (its folder exists, it is no folder), checked
    before any measuring. Raises PlanError."""
    p = Path(path)
    if p.is_dir():
        raise PlanError(f"{p} is a folder: give a file path")
    if not p.parent.is_dir():
        raise PlanError(f"{p.parent}: no such folder (for {p})")
    return p



def _trace_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--trace", help=what)
    p.add_argument("--limit", type=positive_int, default=None, help="trace rows (default: 1000)")
    p.add_argument("--start", type=non_negative_int, default=None, help="first trace row (0-based; default: 0)")
    p.add_argument("--scale", type=positive_float, default=None, help="trace length factor (as epd bench)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="scale the trace's lengths to fit this (as epd bench), unless --scale (default: the "
                        "profiled server's max_model_len)")


def _trace_workload_of(args: argparse.Namespace, prof: Profile, rate: float | None = None) -> Workload | None:
    """``--trace``'s workload (``--limit`` 1000 and ``--start`` 0 unless given; lengths scaled
    to fit ``--max-model-len``, else the profile's ``max_model_len``, unless ``--scale``), or
    None without ``--trace``. Raises PlanError when a trace-only option is given without it."""
    given = _given(args, ("--limit", "--start", "--scale", "--max-model-len"))
    if not args.trace:
        if given:
            raise PlanError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --trace only; give "
                            f"--trace PATH or leave {'it' if len(given) == 1 else 'them'} out")
        return None
    if args.scale is not None and args.max_model_len is not None:
        raise PlanError("give --scale or --max-model-len, not both (--max-model-len sets the scale)")
    limit = prof.max_model_len
    if args.max_model_len is not None and limit and args.max_model_len > limit:
        raise PlanError(f"--max-model-len {args.max_model_len} is beyond the profiled server's max_model_len {limit}")
    fit_to = args.max_model_len or (None if args.scale is not None else limit or None)
    work = trace_workload(args.trace, 1000 if args.limit is None else args.limit, args.start or 0, args.scale,
                          fit_to, rate)
    over = int((work.input_len + work.output_len > limit).sum()) if limit else 0
    if over:
        raise PlanError(f"{over} of {len(work.input_len)} trace rows are longer than the profiled server's "
                        f"max_model_len {limit} ({work.source}): lower --scale, or leave it out to fit them")
    return work


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand (``profile``, ``recommend``) to an ``argparse`` sub-parser set."""
    p = sub.add_parser("plan", help="profile a running server and size the pools for a workload and SLOs",
                       description=epd.ops.plan.__doc__.split("\n\n")[0])
    psub = p.add_subparsers(dest="plan_command", required=True)
    pr = psub.add_parser("profile", help="measure prefill time vs input length and decode ITL vs batch size")
    pr.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    pr.add_argument("--out", default="profile.json", help="the profile JSON to write (default: %(default)s)")
    pr.add_argument("--lengths", type=_positive_ints, default=DEFAULT_PREFILL_LENGTHS,
                    help="prefill input lengths, tokens (default: 64,128,256,512,1024,2048)")
    pr.add_argument("--repeats", type=positive_int, default=3, help="requests per input length (default: %(default)s)")
    pr.add_argument("--batches", type=_positive_ints, default=DEFAULT_BATCHES,
                    help="decode batch sizes (default: 1,2,4,8)")
    pr.add_argument("--contexts", type=_positive_ints, default=DEFAULT_CONTEXTS,
                    help="decode prompt lengths, tokens (default: 64,512)")
    pr.add_argument("--decode-tokens", type=positive_int, default=64,
                    help="tokens per decode request (default: %(default)s)")
    pr.add_argument("--prefill-under-decode", type=_non_negative_ints, default=(0, 4, 16), metavar="STREAMS",
                    help="time prefill alone (0) and/or while this many long streamed decode requests run, "
                         "comma-separated, e.g. 0,4,16: two or more counts give the interference table that "
                         "`recommend` slows prefill by at the simulated decode load (co-located workers that "
                         "share cores or a device interfere; default: 0,4,16; 0 alone: prefill alone, no table)")
    pr.add_argument("--decode-under-prefill", type=_duties, default=(0.0, 0.5, 1.0), metavar="DUTIES",
                    help="time one decode point (the middle batch size, the shortest context) while background "
                         "prefills keep the prefill pool busy this fraction of the time, comma-separated, e.g. "
                         "0,0.5,1: any duty above 0 gives the decode-under-prefill table that `recommend` slows "
                         "each decode step by at the simulated prefill pool's busy state (the mirror of "
                         "--prefill-under-decode; default: 0,0.5,1; 0 alone: no table)")
    pr.add_argument("--prefill-load-tokens", type=positive_int, default=512,
                    help="input tokens of each background prefill of --decode-under-prefill (default: 512)")
    pr.add_argument("--timeout", type=positive_float, default=300.0,
                    help="seconds one request may take (default: %(default)g)")
    pr.set_defaults(func=cmd_profile)

    c = psub.add_parser("correct", help="fit the profile to a live server's traffic (correction factors)",
                        description="Read the server's /metrics twice, --window seconds apart, while its traffic "
                                    "runs, and fit two factors (prefill seconds, decode step seconds) with which the "
                                    "profile's simulation of that load gives the mean TTFT and ITL the server saw; "
                                    "`recommend` then predicts with them (Dynamo's planner's correction factors).")
    c.add_argument("--profile", required=True, help="a profile JSON of `epd plan profile`")
    c.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    c.add_argument("--window", type=_window, default=60.0,
                   help=f"seconds between the two reads (default: 60, at most {MAX_WINDOW_S:g})")
    c.add_argument("--out", help="the corrected profile to write (default: --profile, in place)")
    _trace_arguments(c, "the trace the traffic follows (its lengths, at the observed rate; default: constant "
                        "lengths at the observed means)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_correct)

    r = psub.add_parser("recommend", help="the smallest e:N,p:M,d:K meeting the TTFT and ITL SLOs")
    r.add_argument("--profile", required=True, help="a profile JSON of `epd plan profile`")
    _trace_arguments(r, "a ../shared/traces trace (.jsonl Mooncake or .csv Azure)")
    r.add_argument("--isl-mean", type=positive_int, help="synthetic workload: input tokens")
    r.add_argument("--osl-mean", type=positive_int, help="synthetic workload: output tokens")
    r.add_argument("--rate", type=positive_float, help="req/s (synthetic; rescales a trace's times)")
    r.add_argument("--num-requests", type=positive_int, default=None, help="synthetic requests (default: 1000)")
    r.add_argument("--cv", type=non_negative_float, default=None,
                   help="synthetic arrivals' coefficient of variation (default: 1, Poisson; 0: fixed gaps)")
    r.add_argument("--seed", type=int, default=None, help="synthetic arrivals' seed (default: 0)")
    r.add_argument("--ttft-slo", type=positive_float, required=True, help="p90 TTFT SLO, seconds")
    r.add_argument("--itl-slo", type=positive_float, required=True, help="p90 ITL SLO, seconds")
    r.add_argument("--max-devices", type=positive_int, default=16, help="devices for p and d (default: 16)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--apply", action="store_true", help="set the recommended replicas through --connector")
    r.add_argument("--connector", choices=("local", "kubernetes"), default=None, help="with --apply (default: local)")
    r.add_argument("--state", default=None, help="the local connector's JSON file (default: epd-plan-replicas.json)")
    r.add_argument("--namespace", "-n", default=None, help="the Deployments' namespace (default: epd)")
    r.add_argument("--dry-run", action="store_true", help="print what --apply would do, change nothing")
    r.set_defaults(func=cmd_recommend)
    return p


def _fail(args: argparse.Namespace, message: str) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": message}))
    print(f"epd plan {args.plan_command}: {message}", file=sys.stderr)
    return 2


def cmd_profile(args: argparse.Namespace) -> int:
    try:
        if 0 not in args.prefill_under_decode:
            raise PlanError(f"--prefill-under-decode {','.join(map(str, args.prefill_under_decode))} lacks 0: the "
                            f"prefill fit is of prefill alone, the other counts give its slowdown (e.g. 0,4,16)")
        out = _writable(args.out)
        prof = profile_server(args.url, lengths=args.lengths, repeats=args.repeats, batches=args.batches,
                              contexts=args.contexts, decode_tokens=args.decode_tokens,
                              prefill_background=args.prefill_under_decode,
                              decode_under_prefill=args.decode_under_prefill,
                              prefill_load_tokens=args.prefill_load_tokens, timeout_s=args.timeout,
                              log=lambda m: print(m, file=sys.stderr))
        write_file(out, json.dumps(prof.to_json(), indent=2) + "\n")
    except PlanError as e:
        return _fail(args, str(e))
    f, d = prof.prefill, prof.decode
    print(f"profiled {prof.model} on {pools_text(prof.pools)} -> {args.out}\n"
          f"  prefill_s = {f.c0:.4g} + {f.c1:.4g}*n + {f.c2:.4g}*n^2, TTFT overhead {f.overhead_s * 1e3:.1f} ms\n"
          f"  itl_s = {d.a:.4g} + {d.b:.4g}*batch + {d.c:.4g}*batch*context"
          + "".join(f"\n  under {s:g} decode streams: prefill x{x:.2f}, TTFT overhead {o * 1e3:.1f} ms"
                    for s, x, o in prof.interference)
          + "".join(f"\n  under the prefill pool {u:.0%} busy: decode step x{x:.2f}"
                    for u, x in prof.decode_interference))
    return 0


def cmd_correct(args: argparse.Namespace) -> int:
    try:
        prof = load_profile(args.profile)
        out = _writable(args.out or args.profile)
        work = _trace_workload_of(args, prof)
        obs = observe_server(args.url, args.window, model=prof.model, log=lambda m: print(m, file=sys.stderr))
        if work is not None and not 0.5 <= float(work.input_len.mean()) / obs.isl_mean <= 2:
            raise PlanError(f"the traffic does not follow --trace: its prompts averaged {obs.isl_mean:.0f} tokens, "
                            f"the trace's {float(work.input_len.mean()):.0f} (after scaling); fix --scale, or leave "
                            f"--trace out to simulate the observed means")
        cp, cd = fit_corrections(prof, obs, work)
        write_file(out, json.dumps(corrected(prof, cp, cd, asdict(obs)).to_json(), indent=2) + "\n")
    except PlanError as e:
        return _fail(args, str(e))
    if args.json:
        print(json.dumps({"prefill_correction": cp, "decode_correction": cd, "observed": asdict(obs),
                          "profile": str(out)}))
    else:
        clamp = [name for name, x in (("prefill", cp), ("decode", cd))
                 if min(abs(math.log(x / end)) for end in CORRECTION_RANGE) < 1e-6]
        print(f"observed {obs.requests} requests in {obs.window_s:.0f} s on p:{obs.prefill},d:{obs.decode} "
              f"({obs.rate:.3g} req/s, ISL {obs.isl_mean:.0f}, OSL {obs.osl_mean:.0f}): mean TTFT "
              f"{obs.ttft_s * 1e3:.1f} ms, mean ITL {obs.itl_s * 1e3:.2f} ms\n"
              f"  prefill correction x{cp:.2f}, decode correction x{cd:.2f} -> {out}"
              + (f"\n  ({' and '.join(clamp)} at the end of the searched range "
                 f"{CORRECTION_RANGE[0]:g}..{CORRECTION_RANGE[1]:g}: the profile is not of this server?)"
                 if clamp else ""))
    return 0


def _or(value, default):
    return default if value is None else value


def _given(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """Which of ``flags`` (``--name``) the command line set (their defaults are None / False)."""
    values = {f: getattr(args, f[2:].replace("-", "_")) for f in flags}
    return [f for f, v in values.items() if v is not None and v is not False]  # 0 is given: 0 == False


def _refuse_unused(args: argparse.Namespace) -> None:
    """Raises PlanError for `recommend` options its other options make meaningless."""
    def refuse(flags: list[str], scope: str) -> None:
        if flags:
            raise PlanError(f"{', '.join(flags)} {'applies' if len(flags) == 1 else 'apply'} to {scope}")

    if args.trace:
        refuse(_given(args, ("--num-requests", "--cv", "--seed")),
               "synthetic workloads only (--isl-mean, --osl-mean), not to --trace")
    if not args.apply:
        refuse(_given(args, ("--connector", "--state", "--namespace", "--dry-run")), "--apply only")
    elif _or(args.connector, "local") == "local":
        refuse(_given(args, ("--namespace",)), "--connector kubernetes only")
    else:
        refuse(_given(args, ("--state",)), "--connector local only")


def cmd_recommend(args: argparse.Namespace) -> int:
    try:
        prof = load_profile(args.profile)
        if args.trace and (args.isl_mean or args.osl_mean):
            raise PlanError("give either --trace or --isl-mean/--osl-mean, not both (--rate goes with either)")
        _refuse_unused(args)
        work = _trace_workload_of(args, prof, args.rate)
        if work is None:
            if not (args.isl_mean and args.osl_mean and args.rate):
                raise PlanError("a workload is needed: --trace PATH, or --isl-mean N --osl-mean N --rate R")
            if prof.max_model_len and args.isl_mean + args.osl_mean > prof.max_model_len:
                raise PlanError(f"--isl-mean + --osl-mean is {args.isl_mean + args.osl_mean} tokens, beyond the "
                                f"profiled server's max_model_len {prof.max_model_len}")
            work = synthetic_workload(args.isl_mean, args.osl_mean, args.rate, _or(args.num_requests, 1000),
                                      _or(args.cv, 1.0), _or(args.seed, 0))
        best, tried = recommend(prof, work, args.ttft_slo, args.itl_slo, args.max_devices)
    except PlanError as e:
        return _fail(args, str(e))
    warnings = extrapolation_warnings(prof, work) + [
        f"{flag} {v:g} is seconds ({v / 60:.3g} minutes); an SLO in milliseconds is {v / 1e3:g} here"
        for flag, v, most in (("--ttft-slo", args.ttft_slo, 60.0), ("--itl-slo", args.itl_slo, 5.0)) if v > most]
    for w in warnings:
        print(f"epd plan recommend: warning: {w}", file=sys.stderr)
    replicas = {Role.PREFILL: best.prefill, Role.DECODE: best.decode}  # the pools it sizes; encode stays as it is
    if args.json:
        print(json.dumps({"pools": best.pools, "replicas": replicas, "tp": prof.tp, "meets_slo": best.meets,
                          "predicted": {"ttft_p90_s": best.ttft_p90_s, "itl_p90_s": best.itl_p90_s},
                          "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo}, "workload": work.source,
                          "model": prof.model,
                          "correction": {"prefill": prof.prefill_correction, "decode": prof.decode_correction},
                          "warnings": warnings,
                          "candidates": [{"pools": c.pools, "ttft_p90_s": c.ttft_p90_s, "itl_p90_s": c.itl_p90_s}
                                         for c in tried if not math.isnan(c.itl_p90_s)]}))
    else:
        print(f"{best.pools}  (tp p:{prof.tp.get(Role.PREFILL, 1)},d:{prof.tp.get(Role.DECODE, 1)})  "
              f"predicted p90 TTFT {best.ttft_p90_s * 1e3:.0f} ms (SLO {args.ttft_slo * 1e3:.6g}), "
              f"p90 ITL {best.itl_p90_s * 1e3:.1f} ms (SLO {args.itl_slo * 1e3:.6g})"
              + ("" if best.meets else f"  -- NOT met within {args.max_devices} devices")
              + (f"  (encode not modelled: kept at {best.encode})" if best.encode else ""))
        print(f"  {work.source}; profile of {prof.model}"
              + (f"; corrected x{prof.prefill_correction:.2f} prefill, x{prof.decode_correction:.2f} decode"
                 if (prof.prefill_correction, prof.decode_correction) != (1.0, 1.0) else ""), file=sys.stderr)
    if args.apply and not best.meets:
        print(f"epd plan recommend: not applied: no pool set within {args.max_devices} devices meets the SLOs",
              file=sys.stderr)
    elif args.apply:
        try:
            apply(replicas, _or(args.connector, "local"), state=_or(args.state, "epd-plan-replicas.json"),
                  namespace=_or(args.namespace, "epd"), dry_run=args.dry_run,
                  out=(lambda m: print(m, file=sys.stderr)) if args.json else print)
        except PlanError as e:
            return _fail(args, str(e))
    return 0 if best.meets else 1
