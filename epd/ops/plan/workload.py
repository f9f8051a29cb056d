"""The requests ``epd plan`` simulates (:class:`Workload`): synthetic (constant lengths, gamma
arrivals) or a recorded trace's rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epd.ops.plan.errors import PlanError

__all__ = ["Workload", "synthetic_workload", "trace_workload"]


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests to simulate: ``arrival_s`` (ascending), ``input_len``, ``output_len``
    (tokens), arrays of one length; ``source``: where they came from, in words."""

    arrival_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    source: str


def synthetic_workload(isl_mean: int, osl_mean: int, rate: float, n: int = 1000, cv: float = 1.0,
                       seed: int = 0) -> Workload:
    """``n`` requests of ``isl_mean`` input and ``osl_mean`` output tokens at ``rate`` req/s
    (gamma inter-arrivals of coefficient of variation ``cv``: 1 is Poisson)."""
    from epd.bench.arrivals import arrival_times

    if isl_mean < 1 or osl_mean < 1:
        raise PlanError("--isl-mean and --osl-mean must be >= 1")
    if not (rate > 0 and math.isfinite(rate)):
        raise PlanError("--rate must be a finite number > 0")
    return Workload(np.asarray(arrival_times(n, rate, cv, seed), dtype=np.float64), np.full(n, isl_mean),
                    np.full(n, osl_mean), f"synthetic: {n} requests, ISL {isl_mean}, OSL {osl_mean}, "
                                          f"{rate:g} req/s, cv {cv:g}")


def trace_workload(path: str | Path, limit: int | None = 1000, start: int = 0, scale: float | None = None,
                   max_model_len: int | None = None, rate: float | None = None) -> Workload:
    """Rows of a ``../shared/traces`` trace (epd.bench.traces), lengths scaled as ``epd bench``
    does (``scale``, or fit to ``max_model_len``), times rescaled to ``rate`` when given."""
    from epd.bench.arrivals import rescale_to_rate
    from epd.bench.traces import TraceError, load_trace, scale_trace

    try:
        rows = load_trace(path, limit, start)
        if scale is not None or max_model_len is not None:
            rows, scale = scale_trace(rows, max_model_len or 10**9, scale)
    except FileNotFoundError:
        raise PlanError(f"{path}: no such trace") from None
    except TraceError as e:
        raise PlanError(str(e)) from None
    t = np.asarray([r.t_s for r in rows], dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order]
    if rate is not None:
        try:
            t = np.asarray(rescale_to_rate(t, rate), dtype=np.float64)
        except ValueError as e:
            raise PlanError(f"{path} rows {start}..: {e} (give more rows: --start, --limit)") from None
    return Workload(t, np.asarray([r.input_len for r in rows])[order], np.asarray([r.output_len for r in rows])[order],
                    f"trace {path}: {len(rows)} rows" + (f", lengths x{scale:g}" if scale else "")
                    + (f", {rate:g} req/s" if rate else ""))
