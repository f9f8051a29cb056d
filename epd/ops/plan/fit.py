"""``epd plan``'s performance model: the fits of a profile and the profile itself.

- :class:`PrefillFit`: ``prefill_s = c0 + c1*n + c2*n^2`` (least squares, coefficients
  clipped at >= 0), ``n`` input tokens, over the prefill points timed alone, and the fixed
  TTFT overhead outside the prefill worker (API, routing, KV transfer, first decode step).
- :class:`DecodeFit`: ``itl_s = a + b*batch + c*batch*context`` over (mean batch, mean
  context, step time); the step reads every running sequence's KV, so its cost grows with
  batch x context.
- :class:`Interference`: how prefill slows under running decode streams (per stream count
  ``s``: ``slowdown(s)``, the median of prefill seconds over the alone fit, and
  ``overhead(s)``, the median TTFT outside the prefill worker).
- :class:`DecodeInterference`: the mirror, how decode steps slow while the prefill pool is
  busy (per measured busy fraction: the median step time over the decode fit's, relative to
  the same median with the prefill pool idle).
- :class:`Profile`: all of them as ``epd plan profile`` writes them (JSON), with the live
  correction factors of ``epd plan correct``; :func:`load_profile` reads one.

Seconds throughout; a load is a fraction (0..1), a slowdown a ratio.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from epd.ops.plan.errors import PlanError

__all__ = ["CORRECTION_RANGE", "PROFILE_VERSION", "DecodeFit", "DecodeInterference", "Interference", "PrefillFit",
           "Profile", "fit_decode", "fit_decode_interference", "fit_interference", "fit_prefill", "load_profile"]

PROFILE_VERSION = 1
#: the range a correction factor is searched in (the profile too fast / too slow by 16x at most)
CORRECTION_RANGE = (1 / 16, 16.0)


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """``prefill_s(n) = c0 + c1*n + c2*n^2`` seconds for ``n`` input tokens, each c >= 0;
    ``overhead_s``: the rest of TTFT outside the prefill worker (API, routing, KV transfer,
    first decode step), the median over the profiled requests."""

    c0: float
    c1: float
    c2: float
    overhead_s: float

    def seconds(self, n: np.ndarray | float) -> np.ndarray | float:
        """Prefill seconds of ``n`` input tokens (elementwise for an array)."""
        return self.c0 + self.c1 * n + self.c2 * n * n


@dataclass(frozen=True, slots=True)
class DecodeFit:
    """``itl_s(batch, context) = a + b*batch + c*batch*context`` seconds (a, b, c >= 0);
    ``context``: tokens in a sequence's KV (mean over the batch)."""

    a: float
    b: float
    c: float

    def seconds(self, batch: float, context: float) -> float:
        """One decode step's seconds with ``batch`` running sequences of ``context`` tokens (mean)."""
        return self.a + self.b * batch + self.c * batch * context


@dataclass(frozen=True, slots=True)
class Profile:
    """What ``epd plan profile`` measured. ``pools``: live instances per pool on the
    profiled server (``encode``, ``prefill``, ``decode``, ``pd``, ``tts``); ``tp``:
    tensor-parallel size per pool (1 where unknown); ``prefill_points``: ``[input_tokens,
    prefill_s, ttft_s, decode_streams]`` (version 1 profiles: no ``decode_streams``, 0);
    ``decode_points``: ``[batch, context, itl_s]``; ``prefill_under_decode``: the most decode
    streams run while prefill was timed; ``interference``: ``[decode_streams, slowdown,
    overhead_s]`` rows, ascending in streams (see :class:`Interference`), empty when
    prefill was only timed alone. The mirror, decode under prefill:
    ``decode_under_prefill``: the prefill duty cycles (0..1) decode was timed under;
    ``decode_under_prefill_tokens``: the input tokens of each background prefill;
    ``decode_under_prefill_points``: ``[duty, prefill_busy, batch, context, itl_s]`` (the
    duty asked for, the busy fraction measured, the mean running batch, mean context, step
    seconds); ``decode_interference``: ``[prefill_busy, slowdown]`` rows, ascending in
    busy (see :class:`DecodeInterference`). Profiles without these fields (written before
    the term) load with them empty: decode is not slowed by prefill. Live correction
    (``epd plan correct``, Dynamo's planner's correction factors): ``prefill_correction``
    multiplies every simulated prefill's seconds and ``decode_correction`` every decode
    step's (1: none); ``correction_observed``: the server window they were fitted to
    (:class:`Observation` as JSON). ``max_model_len``: the profiled server's context length,
    tokens (0: unknown), which bounds the workloads ``recommend`` and ``correct`` simulate."""

    model: str
    pools: dict[str, int]
    prefill: PrefillFit
    decode: DecodeFit
    prefill_points: list[list[float]] = field(default_factory=list)
    decode_points: list[list[float]] = field(default_factory=list)
    tp: dict[str, int] = field(default_factory=dict)
    url: str = ""
    measured_at: str = ""
    prefill_under_decode: int = 0
    interference: list[list[float]] = field(default_factory=list)
    decode_under_prefill: list[float] = field(default_factory=list)
    decode_under_prefill_tokens: int = 0
    decode_under_prefill_points: list[list[float]] = field(default_factory=list)
    decode_interference: list[list[float]] = field(default_factory=list)
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    correction_observed: dict = field(default_factory=dict)
    max_model_len: int = 0

    def to_json(self) -> dict:
        """The profile JSON :func:`load_profile` reads (with its format's ``version``)."""
        return {"version": PROFILE_VERSION, **asdict(self)}


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``x @ c ~ y`` with every ``c >= 0``: drop the most negative coefficient
    and refit until none is negative (an active-set sketch of NNLS, enough for 3 columns)."""
    active = list(range(x.shape[1]))
    while True:
        c = np.zeros(x.shape[1])
        if active:
            c[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        neg = [i for i in active if c[i] < 0]
        if not neg:
            return c
        active.remove(min(neg, key=lambda i: c[i]))


def fit_prefill(points: list[list[float]]) -> PrefillFit:
    """Fit ``[input_tokens, prefill_s, ttft_s(, decode_streams)]`` points; with a streams
    column, only the points of the fewest streams (prefill alone, as a rule) are fitted.
    Raises PlanError with fewer than 2 distinct lengths or a non-positive time."""
    p = np.asarray(points, dtype=np.float64)
    if p.ndim == 2 and p.shape[1] == 4:
        p = p[p[:, 3] == p[:, 3].min(), :3]
    p = p.reshape(-1, 3)
    if len(np.unique(p[:, 0])) < 2:
        raise PlanError("the prefill fit needs points at 2 or more input lengths")
    if not (p[:, 1] > 0).all():
        raise PlanError("prefill times must be > 0")
    n = p[:, 0]
    c = _nonneg_lstsq(np.stack([np.ones_like(n), n, n * n], axis=1), p[:, 1])
    overhead = float(np.median(np.maximum(p[:, 2] - p[:, 1], 0.0)))
    return PrefillFit(float(c[0]), float(c[1]), float(c[2]), overhead)


class Interference:
    """How prefill slows while decode streams run on the same server: rows ``[streams,
    slowdown, overhead_s]`` (``slowdown``: prefill seconds over :class:`PrefillFit`'s, a
    ratio; ``overhead_s``: the TTFT outside the prefill worker, seconds), linearly
    interpolated in ``streams`` and held constant past the last row. Where the prefill and
    decode workers share cores (a CPU box) or a device, their compute interferes, and the
    API's per-token streaming competes too; on separate devices the profile finds a
    slowdown near 1. No rows: slowdown 1 and ``default_overhead_s`` at any load."""

    def __init__(self, rows: list[list[float]], default_overhead_s: float) -> None:
        r = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
        r = r[np.argsort(r[:, 0], kind="stable")]
        self.streams, self.slowdown, self.overhead_s = r[:, 0], r[:, 1], r[:, 2]
        self.default_overhead_s = default_overhead_s

    def __bool__(self) -> bool:
        return len(self.streams) > 0

    def at(self, streams: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """(slowdown, overhead_s) at ``streams`` running decode streams."""
        s = np.asarray(streams, dtype=np.float64)
        if not self:
            return np.ones_like(s), np.full_like(s, self.default_overhead_s)
        return np.interp(s, self.streams, self.slowdown), np.interp(s, self.streams, self.overhead_s)


def fit_interference(points: list[list[float]], fit: PrefillFit) -> list[list[float]]:
    """``[streams, slowdown, overhead_s]`` per profiled stream count of ``[input_tokens,
    prefill_s, ttft_s, decode_streams]`` points: the median of ``prefill_s / fit(n)`` and of
    ``ttft_s - prefill_s``. Empty when every point was timed at one stream count."""
    p = np.asarray(points, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] != 4 or len(np.unique(p[:, 3])) < 2:
        return []
    rows = []
    for s in np.unique(p[:, 3]):
        q = p[p[:, 3] == s]
        rows.append([float(s), float(np.median(q[:, 1] / np.maximum(fit.seconds(q[:, 0]), 1e-9))),
                     float(np.median(np.maximum(q[:, 2] - q[:, 1], 0.0)))])
    return rows


class DecodeInterference:
    """How decode steps slow while the prefill pool is busy, the mirror of
    :class:`Interference` (Dynamo's SLA planner profiles each engine alone, on its own
    GPUs; where prefill and decode workers share cores or a device, prefill compute takes
    from the decode steps): rows ``[prefill_busy, slowdown]``, ``prefill_busy`` the
    fraction of the prefill pool's instances computing a prompt (its utilization, 0..1),
    ``slowdown`` a decode step's seconds over
    :class:`DecodeFit`'s, a ratio. Linearly interpolated in ``prefill_busy``, held constant
    past the ends. No rows: slowdown 1 at any load."""

    def __init__(self, rows: list[list[float]]) -> None:
        r = sorted((float(row[0]), float(row[1])) for row in rows)
        self.busy, self.slowdown = [b for b, _ in r], [x for _, x in r]

    def __bool__(self) -> bool:
        return bool(self.busy)

    def at(self, busy: float) -> float:
        """The slowdown at ``busy`` (a float; the simulation calls it once per decode step)."""
        b, x = self.busy, self.slowdown
        if not b:
            return 1.0
        if busy <= b[0]:
            return x[0]
        if busy >= b[-1]:
            return x[-1]
        j = bisect.bisect_right(b, busy)
        f = (busy - b[j - 1]) / (b[j] - b[j - 1])
        return x[j - 1] + f * (x[j] - x[j - 1])


def fit_decode_interference(points: list[list[float]], fit: DecodeFit) -> list[list[float]]:
    """``[prefill_busy, slowdown]`` per profiled duty of ``[duty, prefill_busy, batch,
    context, itl_s]`` points: the median measured busy fraction and the median of
    ``itl_s / fit(batch, context)`` over that median at duty 0 (so the duty-0 row is
    ``[0, 1]``: the decode fit is of steps with the prefill pool idle), ascending in busy.
    Without a duty-0 pass the ratios are the fit's and a ``[0, 1]`` row leads. Empty
    without points."""
    p = np.asarray(points, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] != 5 or not len(p):
        return []
    rows = []
    for duty in np.unique(p[:, 0]):
        q = p[p[:, 0] == duty]
        ref = np.maximum([fit.seconds(b, c) for b, c in q[:, 2:4]], 1e-9)
        rows.append([float(np.clip(np.median(q[:, 1]), 0.0, 1.0)), float(np.median(q[:, 4] / ref)), duty])
    # relative to the duty-0 pass (timed interleaved with the others): the decode fit stays the
    # idle-prefill baseline, and the pass's offset from it (noise, its shorter windows) cancels
    idle = next((r[1] for r in rows if r[2] == 0), None)
    rows = [[u, x / idle if idle else x] for u, x, _ in rows]
    if idle is None:
        rows.append([0.0, 1.0])
    return sorted(rows)


def fit_decode(points: list[list[float]]) -> DecodeFit:
    """Fit ``[batch, context, itl_s]`` points. Raises PlanError with fewer than 2 distinct
    batch sizes or a non-positive ITL."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    if len(np.unique(p[:, 0])) < 2:
        raise PlanError("the decode fit needs points at 2 or more batch sizes")
    if not (p[:, 2] > 0).all():
        raise PlanError("ITLs must be > 0")
    b, ctx = p[:, 0], p[:, 1]
    cols = [np.ones_like(b), b] + ([b * ctx] if len(np.unique(ctx)) > 1 else [])
    c = _nonneg_lstsq(np.stack(cols, axis=1), p[:, 2])
    return DecodeFit(float(c[0]), float(c[1]), float(c[2]) if len(c) > 2 else 0.0)


def _factor(x, name: str) -> float:
    """A correction factor read from a profile: a JSON number within :data:`CORRECTION_RANGE`."""
    lo, hi = CORRECTION_RANGE
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (lo * (1 - 1e-9) <= x <= hi * (1 + 1e-9)):
        raise ValueError(f"{name} must be a number within {lo:g}..{hi:g} (what `epd plan correct` fits), got {x!r}")
    return float(x)


def _observed(x) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"correction_observed must be a JSON object, got {x!r}")
    return x


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON. Raises PlanError when missing or malformed."""
    try:
        d = json.loads(Path(path).read_text())
        return Profile(model=str(d["model"]), pools={k: int(v) for k, v in d["pools"].items()},
                       prefill=PrefillFit(**{k: float(d["prefill"][k]) for k in ("c0", "c1", "c2", "overhead_s")}),
                       decode=DecodeFit(**{k: float(d["decode"][k]) for k in ("a", "b", "c")}),
                       prefill_points=d.get("prefill_points", []), decode_points=d.get("decode_points", []),
                       tp={k: int(v) for k, v in d.get("tp", {}).items()}, url=d.get("url", ""),
                       measured_at=d.get("measured_at", ""),
                       prefill_under_decode=int(d.get("prefill_under_decode", 0)),
                       interference=[[float(x) for x in row] for row in d.get("interference", [])],
                       decode_under_prefill=[float(x) for x in d.get("decode_under_prefill", [])],
                       decode_under_prefill_tokens=int(d.get("decode_under_prefill_tokens", 0)),
                       decode_under_prefill_points=[[float(x) for x in row]
                                                    for row in d.get("decode_under_prefill_points", [])],
                       decode_interference=[[float(x) for x in row] for row in d.get("decode_interference", [])],
                       prefill_correction=_factor(d.get("prefill_correction", 1.0), "prefill_correction"),
                       decode_correction=_factor(d.get("decode_correction", 1.0), "decode_correction"),
                       correction_observed=_observed(d.get("correction_observed", {})),
                       max_model_len=int(d.get("max_model_len") or 0))
    except FileNotFoundError:
        raise PlanError(f"{path}: no such profile (write one with `epd plan profile --url URL --out {path}`)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanError(f"{path}: not an epd plan profile ({type(e).__name__}: {e})") from None
