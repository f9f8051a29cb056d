"""``epd plan``: size the pools (``e:N,p:M,d:K``) for a workload and TTFT/ITL SLOs.

Two steps, after Dynamo's SLA planner (ai-dynamo/dynamo, ``components/planner``: a
pre-deployment profile of prefill TTFT against input length and of decode ITL against
the batch's KV load, then replica counts from the predicted load; its virtual connector
is the model of ``--connector local``), with DistServe's (OSDI'24) placement search: a
simulation of the workload's arrivals through each candidate placement, keeping the
smallest that meets the SLOs.

``epd plan profile --url URL --out profile.json`` measures a running server's real workers:

- prefill: for each input length (default 64..2048 tokens, capped below the model's
  length), ``--repeats`` completions of fresh random token ids (no prefix-cache hit), one
  at a time, ``max_tokens=1``. Per request, the prefill workers' ``epd_prefill_seconds``
  (delta of the histogram over the request, read from ``/metrics`` with epd.diagnose's
  parser) is the service time and the client's TTFT minus it is the fixed overhead (API,
  routing, KV transfer, first decode step); a window that also holds another request's
  prefill is measured again. Fit: ``prefill_s = c0 + c1*n + c2*n^2`` (least squares,
  coefficients clipped at >= 0), ``n`` input tokens, over the points timed alone.
- interference: ``--prefill-under-decode 0,4,16`` repeats the prefill pass under each
  number of long *streamed* decode requests (tokens read as server-sent events, as a
  streaming client does). Where prefill and decode workers share cores (a CPU box) or a
  device, the decode steps, and the API's per-token streaming, take compute from prefill:
  on the 2-core VM a prefill under 16 streams took several times its time alone, which a
  profile of prefill alone misses (the first version of this planner under-predicted TTFT
  2.7-6x there). Per stream count ``s``, the table keeps ``slowdown(s)``, the median of
  prefill seconds over the alone fit, and ``overhead(s)``, the median TTFT outside the
  prefill worker. On separate devices it measures a slowdown near 1.
- decode: for each context (prompt length, default 64 and 512) and batch size (default
  1, 2, 4, 8), that many concurrent requests of ``--decode-tokens`` tokens (``ignore_eos``).
  The decode workers' ``epd_decode_step_seconds`` over them gives the step time (a running
  stream's ITL) and, as decode tokens / steps, the mean running batch (the requests' prefills
  are staggered, so fewer than ``batch`` may run at once). Fit: ``itl_s = a + b*batch +
  c*batch*context`` over (mean batch, mean context, step time); the step reads every
  running sequence's KV, so its cost grows with batch x context.
- decode under prefill, the mirror of the interference above: ``--decode-under-prefill
  0,0.5,1`` times one decode point (the middle batch size, the shortest context, as the
  decode pass does it, at least 3 times per duty) while background requests of
  ``--prefill-load-tokens`` fresh input tokens (``max_tokens=1``) keep the prefill pool
  busy that fraction of the time (1: two clients back to back, so
  its queue never empties; below 1: one client idling ``(1 - duty) / duty`` of each
  request's time). Where the workers share cores or a device, prefill compute (and the KV
  transfer to the decode worker) slows the decode steps; the decode profile above is taken
  with the prefill pool idle, which the first planner's ITL predictions missed (-31% /
  -51% on the 2-core VM). Per duty, the table keeps ``prefill_busy``, the fraction of a
  1 s window of the background load alone that the prefill pool was busy as its workers
  measured it (``epd_prefill_seconds`` over the wall seconds and the pool's instances, at
  most 1; 0 for duty 0), and ``slowdown``, the median step time over the decode fit's at
  the measured mean batch and context, over the same median at duty 0 (the duties are
  timed interleaved, so a drift of the machine's load hits each; the requests' own
  staggered prefills are in every pass and in the decode fit, so they cancel).
  Seconds throughout; the load is a fraction (0..1), the slowdown a ratio.

``epd plan recommend --profile profile.json (--trace PATH | --isl-mean N --osl-mean N --rate R)
--ttft-slo S --itl-slo S`` simulates, per candidate, the workload's arrivals (the trace's
recorded times, rescaled to ``--rate`` when given, or gamma arrivals of coefficient ``--cv``):

- prefill: ``M`` instances, each a FIFO single server (a prompt's chunks occupy the
  instance's steps until it is done; batching several prompts in one step does not raise a
  compute-bound worker's token throughput), a request joining the instance that frees up
  first; ``TTFT = queue wait + prefill_s(n) * slowdown(s) + overhead(s)``, ``s`` the decode
  streams running (in the simulation) when its prefill starts; without an interference
  table, slowdown 1 and the alone overhead.
- decode: ``K`` instances, a request (arriving when its prefill ends) joining the one with
  the fewest running streams; each instance steps all its running streams at once, one
  token each, the step lasting ``itl_s(batch, mean context)`` of the profile (continuous
  batching); every token's gap is one ITL sample. With a decode-under-prefill table, a
  step is slowed by ``slowdown(u)``, ``u`` the fraction of the ``M`` simulated prefill
  instances computing a prompt when the step starts (the prefill pool's utilization, 0..1,
  as the profile measured it on its pool; a larger pool is taken to bring its own cores or
  devices, so its interference scales with its utilization, not its size).

The two are coupled through ``s`` and ``u``: :func:`simulate` iterates prefill under the
previous round's decode streams and decode under the new prefills (their first tokens and
their busy intervals) to a fixed point. The p90
over the simulated requests (TTFT) and tokens (ITL) are the predictions. Without
interference prefill only depends on ``M`` and decode on ``K`` (given the prefills: their
ends and, with a decode-under-prefill table, their busy intervals), so the search takes the smallest ``M`` meeting the TTFT SLO, then the smallest ``K``
meeting the ITL SLO; with it, the two searches alternate until neither moves, within
``--max-devices`` (``M*tp_p + K*tp_d``; TP is the profile's ``tp`` per pool, which
``profile`` writes as 1: the TP of the profiled workers is not read from the server, so a
profile of TP workers needs its ``tp`` edited). ``e:N``: the traces hold no media, so the
encode pool is 0 (the profile's encode instances are not sized). Not modelled: KV
capacity (preemption when a decode instance's cache is full), ``max_num_seqs``,
prefix-cache hits, chunked prefill sharing steps with decodes (aggregated ``pd`` pools;
their decode-under-prefill table measures the shared steps, but at one batch size), and
the interference between more instances than the profiled server had (the tables are
measured on its pools, e.g. ``p:1,d:1``).

``epd plan correct --profile profile.json --url URL --window 60`` fits the profile to the
server's live traffic, after Dynamo's planner's correction factors (``actual / expected``
TTFT and ITL of its last interval): it reads ``/metrics`` twice, a window apart, takes the
window's request rate, mean ISL and OSL, pools, and the API's mean TTFT and ITL
(:class:`Observation`), and solves for the two factors on the profile's prefill seconds and
decode step seconds with which the simulation of that load (``--trace``: the lengths of the
trace the traffic follows, at the observed rate; else constant lengths at the observed
means) gives the same means (:func:`fit_corrections`). They are written into the profile,
and ``recommend`` simulates with them. A profile is taken one request or one batch at a time; under real traffic the
workers also share what the profile cannot see (on one host: the API's per-token work, the
clients, other requests' KV transfers), which the factors absorb.

``--apply`` sets the prefill and decode replicas (the encode pool, not modelled, is left
alone): ``--connector local`` writes ``{"prefill": M, "decode": K}`` into ``--state`` (a JSON
file, keeping its other pools), ``--connector kubernetes`` runs ``kubectl scale
deployment/epd-<pool> --replicas=R -n NS`` for the per-pool Deployments of deploy/ (the
scale subresource), ``--dry-run`` printing the commands instead.

Exit codes: 0 done (recommend: the SLOs can be met), 1 no candidate within
``--max-devices`` meets them, 2 bad input (a missing or malformed profile or trace, a
server that cannot be read, an output file that cannot be written; ``correct``: also a
server that serves another model than the profile's, or a window with fewer than
:data:`MIN_OBSERVED_REQUESTS` streamed requests).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from epd.cli.validators import non_negative_float, non_negative_int, positive_float, positive_int
from epd.diagnose import (ITL, PREFILL, PROMPT_TOKENS, TTFT, MetricsError, Window, metrics_url, scrape)

__all__ = ["DecodeFit", "DecodeInterference", "Observation", "PlanError", "PrefillFit", "Profile", "Prediction",
           "Workload", "add_parser", "apply", "extrapolation_warnings", "fit_corrections", "fit_decode",
           "fit_decode_interference", "fit_prefill", "kubectl_commands", "load_profile", "observe_server",
           "profile_server", "recommend", "simulate_decode", "simulate_prefill", "synthetic_workload",
           "trace_workload"]

PROFILE_VERSION = 1
DEFAULT_PREFILL_LENGTHS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_CONTEXTS = (64, 512)
#: the pools a profile counts and ``--pools`` names (the router and the API are no pools to size)
SERVING_POOLS = ("encode", "prefill", "decode", "pd", "tts")
POOL_SHORT = {"encode": "e", "prefill": "p", "decode": "d", "pd": "pd", "tts": "t"}
#: the quantile the SLOs are judged at (Dynamo's planner and DistServe: p90)
QUANTILE = 0.9
#: the pools' Deployments of deploy/base (the scale subresource ``kubectl scale`` drives)
DEPLOYMENTS = {"encode": "epd-encode", "prefill": "epd-prefill", "decode": "epd-decode"}


class PlanError(ValueError):
    """Bad input for ``epd plan``: a missing or malformed profile or trace, bad arguments,
    a server that cannot be profiled (exit code 2)."""


# ---- the profile -----------------------------------------------------------------------------
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
        return self.c0 + self.c1 * n + self.c2 * n * n


@dataclass(frozen=True, slots=True)
class DecodeFit:
    """``itl_s(batch, context) = a + b*batch + c*batch*context`` seconds (a, b, c >= 0);
    ``context``: tokens in a sequence's KV (mean over the batch)."""

    a: float
    b: float
    c: float

    def seconds(self, batch: float, context: float) -> float:
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


# ---- profiling a running server ----------------------------------------------------------------
def _prefill_pool(w: Window) -> str:
    pools = w.pools()
    for p in ("prefill", "pd"):
        if p in pools:
            return p
    raise PlanError(f"no prefill or pd pool in the server's metrics (pools: {', '.join(pools) or 'none'})")


def _model_info(client, base: str) -> tuple[str, int | None]:
    r = client.get(base + "/v1/models")
    if r.status_code != 200:
        raise PlanError(f"{base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    m = r.json()["data"][0]
    return m["id"], m.get("max_model_len")


def _complete(client, base: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """One non-streamed completion; returns its wall seconds."""
    t0 = time.perf_counter()
    r = client.post(base + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:
        raise PlanError(f"a profiling request failed: HTTP {r.status_code}: {r.text[:200]}")
    return time.perf_counter() - t0


def _stream(client, base: str, model: str, prompt: list[int], max_tokens: int, done: threading.Event) -> None:
    """One streamed completion (server-sent events, one per token, as a streaming client
    reads them), read until its end or until ``done`` is set."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise PlanError(f"a background request failed: HTTP {r.status_code}")
        for line in r.iter_lines():
            if done.is_set() or line.strip() == "data: [DONE]":
                return
            if line.startswith("data: "):
                json.loads(line[6:])  # parsed, as a client does


class _Background:
    """``streams`` threads each running long-output streamed requests (64-token prompt, up
    to 1024 tokens, as many as the model's length allows) until :meth:`stop`: the decode
    load of ``streams`` running streams on the server, with the API's per-token streaming."""

    def __init__(self, client, base: str, model: str, streams: int, cap: int | None, rng: random.Random,
                 vocab_hi: int) -> None:
        self.done = threading.Event()
        tokens = max(2, min(1024, (cap or 2048) - 64))
        prompts = [[rng.randrange(10, vocab_hi) for _ in range(64)] for _ in range(streams)]

        def loop(prompt: list[int]) -> None:
            while not self.done.is_set():
                try:
                    _stream(client, base, model, prompt, tokens, self.done)
                except Exception:  # noqa: BLE001 - cancelled by stop(), or the server's own error
                    return

        self.threads = [threading.Thread(target=loop, args=(p,), daemon=True) for p in prompts]
        for t in self.threads:
            t.start()
        if streams:
            time.sleep(1.0 + 0.1 * streams)  # their prefills are done: the measured windows see only decode steps

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join()


class _PrefillLoad:
    """Background prefills keeping ``url``'s prefill pool busy ``duty`` of the time until
    :meth:`stop`: completions of ``tokens`` fresh random input tokens, ``max_tokens=1``
    (prefill, its KV transfer, no decode step); ``duty >= 1``: two clients back to back, so
    the pool's queue never empties; below 1: one client that idles ``(1 - duty) / duty``
    of each request's wall seconds after it. The busy fraction reached is measured, not
    assumed (:func:`profile_server`)."""

    def __init__(self, client, base: str, model: str, duty: float, tokens: int, rng: random.Random,
                 vocab_hi: int) -> None:
        self.done = threading.Event()

        def loop(seed: int) -> None:
            r = random.Random(seed)
            while not self.done.is_set():
                try:
                    wall = _complete(client, base, model, [r.randrange(10, vocab_hi) for _ in range(tokens)], 1)
                except Exception:  # noqa: BLE001 - the server's own error; the measured busy fraction shows it
                    return
                if duty < 1:
                    self.done.wait(wall * (1 - duty) / duty)

        self.threads = [threading.Thread(target=loop, args=(rng.randrange(2**31),), daemon=True)
                        for _ in range(2 if duty >= 1 else 1)]
        for t in self.threads:
            t.start()
        time.sleep(0.3)  # the first background prefills are running

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join()


def _prefill_busy(client, url: str, pool: str, instances: int, seconds: float = 1.0) -> float:
    """The ``pool`` prefill pool's busy fraction over the next ``seconds``: its
    ``epd_prefill_seconds`` over the window's wall seconds and ``instances``, at most 1
    (prompts batched into one step each count the step's seconds, so the sum can pass the
    wall time of a saturated pool)."""
    before = scrape(client, metrics_url(url))
    t0 = time.perf_counter()
    time.sleep(seconds)
    h = Window(before, scrape(client, metrics_url(url))).histogram("epd_prefill_seconds", pool)
    wall = time.perf_counter() - t0
    return min(1.0, (h.sum if h is not None else 0.0) / (wall * instances))


def profile_server(url: str, *, lengths=DEFAULT_PREFILL_LENGTHS, repeats: int = 3, batches=DEFAULT_BATCHES,
                   contexts=DEFAULT_CONTEXTS, decode_tokens: int = 64, prefill_background: int | tuple[int, ...] = 0,
                   decode_under_prefill: tuple[float, ...] = (), prefill_load_tokens: int = 512,
                   seed: int | None = None, timeout_s: float = 300.0, log=None) -> Profile:
    """Measure ``url``'s prefill and decode (the module docstring says how). Lengths and
    contexts are capped so prompt + output fits the model's ``max_model_len``.
    ``prefill_background``: the decode stream counts prefill is timed under, one pass each
    (0: prefill alone); two or more give the profile's interference table.
    ``seed``: of the random prompts (None: fresh ones on every call, so a second profile of
    the same server does not time prefix-cache hits of the first one's prompts).
    ``decode_under_prefill``: the prefill duty cycles (0..1) one decode point (the middle
    of ``batches``, the shortest context, ``max(3, repeats)`` times) is timed under, with
    background prefills of ``prefill_load_tokens`` input tokens; any duty above 0 gives the
    profile's decode-under-prefill table (none: decode timed with the prefill pool idle only).

    Raises:
        PlanError: the server cannot be read, has no prefill/pd pool, or a request fails.
    """
    import httpx

    log = log or (lambda msg: None)
    levels = sorted({int(prefill_background)} if isinstance(prefill_background, int) else set(prefill_background))
    base = metrics_url(url).removesuffix("/metrics")
    rng = random.Random(seed)
    try:
        with httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=max(levels) + 16)) as client:
            model, max_len = _model_info(client, base)
            first = scrape(client, metrics_url(url))
            w0 = Window(first, first)
            pool = _prefill_pool(w0)
            pools = {p: w0.instances(p) for p in w0.pools() if p in SERVING_POOLS}
            cap = (max_len - 2) if max_len else None
            lens = sorted({min(n, cap) if cap else n for n in lengths})
            few = []  # what fit_prefill / fit_decode need, checked before measuring
            if len(lens) < 2:
                capped = f" (capped at the model's max_model_len {max_len} - 2)" if cap and max(lengths) > cap else ""
                few.append(f"--lengths {', '.join(map(str, lens))}{capped}")
            if len(set(batches)) < 2:
                few.append(f"--batches {', '.join(map(str, sorted(set(batches))))}")
            if few:
                raise PlanError(f"the fits need 2 or more distinct --lengths and --batches; got {' and '.join(few)}")
            vocab_hi = 400  # the tiny models' vocabularies are >= 400; real ones far larger
            _complete(client, base, model, [rng.randrange(10, vocab_hi) for _ in range(16)], 1)  # warm-up
            prefill_points = []
            for level in levels:
                background = _Background(client, base, model, level, cap, rng, vocab_hi)
                try:
                    for n in lens:
                        got = 0
                        for _ in range(repeats * 6):  # a window that holds a background prefill is measured again
                            before = scrape(client, metrics_url(url))
                            ttft = _complete(client, base, model, [rng.randrange(10, vocab_hi) for _ in range(n)], 1)
                            h = Window(before, scrape(client, metrics_url(url))).histogram("epd_prefill_seconds",
                                                                                            pool)
                            if h is None or not h.count:
                                raise PlanError(f"the {pool} pool observed no epd_prefill_seconds for a request")
                            if h.count == 1:
                                prefill_points.append([n, h.sum, ttft, level])
                                got += 1
                                if got == repeats:
                                    break
                        if got:
                            log(f"prefill {n:5d} tokens: {np.mean([p[1] for p in prefill_points[-got:]]) * 1e3:8.1f}"
                                f" ms" + (f" (under {level} decode streams)" if level else ""))
                finally:
                    background.stop()
            dpool = next((p for p in ("decode", "pd") if p in pools), None)
            if dpool is None:
                raise PlanError(f"no decode or pd pool in the server's metrics (pools: {', '.join(pools)})")
            decode_points = []
            for ctx in sorted({min(c, cap - decode_tokens) if cap else c for c in contexts}):
                for b in batches:
                    prompts = [[rng.randrange(10, vocab_hi) for _ in range(ctx)] for _ in range(b)]
                    before = scrape(client, metrics_url(url))
                    with ThreadPoolExecutor(b) as pool_:
                        list(pool_.map(lambda pr: _complete(client, base, model, pr, decode_tokens), prompts))
                    h = Window(before, scrape(client, metrics_url(url))).histogram("epd_decode_step_seconds", dpool)
                    if h is None or not h.count:
                        raise PlanError(f"the {dpool} pool observed no epd_decode_step_seconds")
                    # mean running batch: the decode tokens over the steps that made them
                    batch = min(b, b * (decode_tokens - 1) / h.count)
                    decode_points.append([batch, ctx + decode_tokens / 2, h.mean])
                    log(f"decode {b:3d} streams (mean batch {batch:4.1f}) context {ctx:5d}: "
                        f"step {h.mean * 1e3:7.2f} ms")
            if len({round(p[0], 6) for p in decode_points}) < 2:
                raise PlanError(f"the decode requests of --batches {','.join(map(str, batches))} did not overlap (mean "
                                f"running batch {decode_points[0][0]:.1f} each time), so the decode fit has one "
                                f"batch size: raise --decode-tokens (now {decode_tokens}) or the batch sizes")
            dfit = fit_decode(decode_points)
            duties = sorted(set(decode_under_prefill)) if any(d > 0 for d in decode_under_prefill) else []
            dup_points: list[list[float]] = []
            load_tokens = min(prefill_load_tokens, cap) if cap else prefill_load_tokens
            b = sorted(batches)[len(batches) // 2]
            ctx = min(min(c, cap - decode_tokens) if cap else c for c in contexts)
            for _ in range(max(3, repeats)):  # the duties interleaved: a drift of the machine's load hits all
                for duty in duties:
                    load = _PrefillLoad(client, base, model, duty, load_tokens, rng, vocab_hi) if duty > 0 else None
                    try:
                        busy = _prefill_busy(client, url, pool, max(1, pools.get(pool, 1))) if load else 0.0
                        prompts = [[rng.randrange(10, vocab_hi) for _ in range(ctx)] for _ in range(b)]
                        before = scrape(client, metrics_url(url))
                        with ThreadPoolExecutor(b) as pool_:
                            list(pool_.map(lambda pr: _complete(client, base, model, pr, decode_tokens), prompts))
                        h = Window(before, scrape(client, metrics_url(url))).histogram("epd_decode_step_seconds",
                                                                                        dpool)
                    finally:
                        if load is not None:
                            load.stop()
                    if h is None or not h.count:
                        raise PlanError(f"the {dpool} pool observed no epd_decode_step_seconds")
                    batch = min(b, b * (decode_tokens - 1) / h.count)
                    context = ctx + decode_tokens / 2
                    dup_points.append([duty, busy, batch, context, h.mean])
                    log(f"decode {b:3d} streams (mean batch {batch:4.1f}) context {ctx:5d} under prefill duty "
                        f"{duty:g} (busy {busy:.2f}): step {h.mean * 1e3:7.2f} ms, "
                        f"x{h.mean / max(dfit.seconds(batch, context), 1e-9):.2f} of the fit")
    except httpx.HTTPError as e:
        raise PlanError(f"cannot profile {url}: {type(e).__name__}: {e}") from None
    except MetricsError as e:
        raise PlanError(str(e)) from None
    tp = {p: 1 for p in pools}
    fit = fit_prefill(prefill_points)
    return Profile(model=model, pools=pools, prefill=fit, decode=dfit,
                   prefill_points=prefill_points, decode_points=decode_points, tp=tp, url=url,
                   measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   prefill_under_decode=max(levels), interference=fit_interference(prefill_points, fit),
                   decode_under_prefill=[float(d) for d in duties],
                   decode_under_prefill_tokens=load_tokens if duties else 0,
                   decode_under_prefill_points=dup_points,
                   decode_interference=fit_decode_interference(dup_points, dfit), max_model_len=int(max_len or 0))


# ---- the workload and the simulation ---------------------------------------------------------
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


def simulate_prefill(w: Workload, fit: PrefillFit, instances: int, interference: Interference | None = None,
                     streams_at=None, correction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """FIFO through ``instances`` single-server prefill instances. A request's service time
    is ``fit.seconds(input_len)`` times ``correction`` (the profile's ``prefill_correction``)
    times the interference slowdown at ``streams_at(start)``
    decode streams (a function of the time, s, the prefill starts; None: no streams), and
    ``TTFT = done - arrival + overhead`` (the interference's overhead at the same streams).
    Returns (TTFT s, time the request's first token is out, s) per request."""
    return _prefill_run(w, fit, instances, interference, streams_at, correction)[:2]


def _prefill_run(w: Workload, fit: PrefillFit, instances: int, interference: Interference | None = None,
                 streams_at=None, correction: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`simulate_prefill`'s TTFT and first-token times and, per request, when its
    prefill compute starts and ends on its instance (s): the prefill pool's busy intervals."""
    interference = interference or Interference([], fit.overhead_s)
    free = [0.0] * instances
    heapq.heapify(free)
    base = fit.seconds(w.input_len.astype(np.float64)) * correction
    done = np.empty(len(w.arrival_s))
    begin = np.empty(len(w.arrival_s))
    overhead = np.empty(len(w.arrival_s))
    for i, (t, s) in enumerate(zip(w.arrival_s, base)):
        begin[i] = start = max(t, heapq.heappop(free))
        slow, overhead[i] = interference.at(streams_at(start) if streams_at is not None else 0.0)
        done[i] = start + s * float(slow)
        heapq.heappush(free, done[i])
    ttft = done - w.arrival_s + overhead
    return ttft, w.arrival_s + ttft, begin, done


def prefill_busy_over_time(start_s: np.ndarray, done_s: np.ndarray, per: float = 1.0):
    """A function of time t (s) -> prefill instances computing a prompt at t (``start <= t <
    done``, intervals of :func:`_prefill_run`), over ``per``: with ``per`` the simulated
    pool's instances, the utilization (0..1) :class:`DecodeInterference` is read at."""
    starts, ends = sorted(map(float, start_s)), sorted(map(float, done_s))
    per = float(per) or 1.0

    def at(t: float) -> float:
        return (bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)) / per

    return at


def _decode_run(w: Workload, fit: DecodeFit, instances: int, first_token_s: np.ndarray, slowdown_at=None,
                correction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """:func:`simulate_decode`'s gaps (s) and, per request, the time (s) of its last token
    (its first token's time when it has no later one)."""
    order = np.argsort(first_token_s, kind="stable")
    arrivals = [(float(first_token_s[i]), int(w.input_len[i]), int(w.output_len[i]) - 1, int(i)) for i in order
                if w.output_len[i] > 1]
    end = np.asarray(first_token_s, dtype=np.float64).copy()
    # per instance: running [context, tokens left, time of last token, request index]
    running: list[list[list[float]]] = [[] for _ in range(instances)]
    clock = [0.0] * instances
    gaps: list[float] = []
    nxt = 0
    while nxt < len(arrivals) or any(running):
        # the instance whose next step starts first; a new arrival joins before it if it is earlier
        busy = [k for k in range(instances) if running[k]]
        k = min(busy, key=lambda j: clock[j]) if busy else None
        if nxt < len(arrivals) and (k is None or arrivals[nxt][0] <= clock[k]):
            t, ctx, left, i = arrivals[nxt]
            nxt += 1
            j = min(range(instances), key=lambda j: len(running[j]))
            if not running[j]:
                clock[j] = max(clock[j], t)
            running[j].append([float(ctx), float(left), t, i])
            continue
        batch = running[k]
        step = fit.seconds(len(batch), sum(s[0] for s in batch) / len(batch)) * correction
        if slowdown_at is not None:  # decode under prefill: the factor when the step starts
            step *= slowdown_at(clock[k])
        clock[k] += step
        for s in batch:
            gaps.append(clock[k] - s[2])
            s[0] += 1
            s[1] -= 1
            s[2] = clock[k]
            if s[1] <= 0:
                end[int(s[3])] = clock[k]
        running[k] = [s for s in batch if s[1] > 0]
    return np.asarray(gaps), end


def simulate_decode(w: Workload, fit: DecodeFit, instances: int, first_token_s: np.ndarray,
                    slowdown_at=None, correction: float = 1.0) -> np.ndarray:
    """Continuous batching on ``instances`` decode instances (least running streams first);
    returns every inter-token gap (s) of every request's ``output_len - 1`` later tokens.
    ``slowdown_at``: a function of a step's start time (s) -> the factor its
    :class:`DecodeFit` seconds are multiplied by (None: 1; :func:`simulate` passes the
    decode-under-prefill slowdown at the prefill pool's simulated busy state); ``correction``:
    the profile's ``decode_correction``, multiplying every step."""
    return _decode_run(w, fit, instances, first_token_s, slowdown_at, correction)[0]


def streams_over_time(first_token_s: np.ndarray, end_s: np.ndarray):
    """A function of time t (s) -> decode streams running at t (requests whose first token
    is out by t and whose last is not), over every decode instance."""
    starts, ends = np.sort(first_token_s), np.sort(end_s)

    def at(t: float) -> int:
        return int(np.searchsorted(starts, t, "right") - np.searchsorted(ends, t, "right"))

    return at


#: fixed-point rounds of :func:`simulate` and the TTFT change (s) that ends them early
SIM_ROUNDS = 12
SIM_TOL_S = 1e-4


def decode_slowdown_at(profile: Profile, start_s: np.ndarray, done_s: np.ndarray, prefill_instances: int):
    """A function of time t (s) -> the decode-under-prefill slowdown at the prefill pool's
    utilization at t (the prefill intervals ``start_s``..``done_s`` of a simulation of
    ``prefill_instances``), or None when the profile has no table (decode not slowed)."""
    table = DecodeInterference(profile.decode_interference)
    if not table:
        return None
    busy = prefill_busy_over_time(start_s, done_s, prefill_instances)
    return lambda t: table.at(busy(t))


def simulate(profile: Profile, w: Workload, prefill_instances: int, decode_instances: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Prefill and decode together: (TTFT s per request, every ITL gap s). Without an
    interference table, one pass of :func:`simulate_prefill` then :func:`simulate_decode`,
    each decode step slowed by the decode-under-prefill factor at the prefill pool's busy
    state when it starts (:func:`decode_slowdown_at`; 1 without that table). With a
    prefill-under-decode table, a fixed point: prefill is simulated under the decode
    streams of the previous round's decode simulation (none in the first), decode from that
    round's first tokens and under its prefills, until no TTFT moves by more than
    :data:`SIM_TOL_S` (at most :data:`SIM_ROUNDS` rounds; decode is a function of the
    prefill round, so a round whose TTFTs did not move leaves decode where it was)."""
    inter = Interference(profile.interference, profile.prefill.overhead_s)
    cp, cd = profile.prefill_correction, profile.decode_correction
    ttft, first, start, done = _prefill_run(w, profile.prefill, prefill_instances, inter, correction=cp)
    gaps, end = _decode_run(w, profile.decode, decode_instances, first,
                            decode_slowdown_at(profile, start, done, prefill_instances), cd)
    if not inter:
        return ttft, gaps
    for _ in range(SIM_ROUNDS):
        prev = ttft
        ttft, first, start, done = _prefill_run(w, profile.prefill, prefill_instances, inter,
                                                streams_over_time(first, end), cp)
        gaps, end = _decode_run(w, profile.decode, decode_instances, first,
                                decode_slowdown_at(profile, start, done, prefill_instances), cd)
        if np.max(np.abs(ttft - prev), initial=0.0) < SIM_TOL_S:
            break
    return ttft, gaps


@dataclass(frozen=True, slots=True)
class Prediction:
    """One pool set's predicted p90s (s); ``meets``: both within the SLOs."""

    encode: int
    prefill: int
    decode: int
    ttft_p90_s: float
    itl_p90_s: float
    meets: bool

    @property
    def pools(self) -> str:
        return f"e:{self.encode},p:{self.prefill},d:{self.decode}"


def pools_text(pools: dict[str, int]) -> str:
    """``pools`` (pool name -> instances) in ``epd launch --pools`` syntax, e.g. ``p:1,d:1``;
    pools that are not sized (router, api) are left out."""
    return ",".join(f"{POOL_SHORT[p]}:{pools[p]}" for p in SERVING_POOLS if p in pools)


def _p90(x: np.ndarray) -> float:
    return float(np.quantile(x, QUANTILE)) if len(x) else 0.0


def recommend(profile: Profile, workload: Workload, ttft_slo_s: float, itl_slo_s: float,
              max_devices: int = 16) -> tuple[Prediction, list[Prediction]]:
    """The smallest pool set meeting both SLOs (the search of the module docstring) and the
    candidates tried. When none fits ``max_devices``, the returned prediction is the
    largest tried, ``meets=False``."""
    tp_p, tp_d = profile.tp.get("prefill", 1), profile.tp.get("decode", 1)
    if tp_p + tp_d > max_devices:
        raise PlanError(f"--max-devices {max_devices} cannot hold one prefill (tp {tp_p}) and one decode "
                        f"(tp {tp_d}) instance")
    tried: list[Prediction] = []
    seen: dict[tuple[int, int], Prediction] = {}
    kept = profile.pools.get("encode", 0)  # media is not modelled: the encode pool stays as profiled

    def predict(m: int, k: int) -> Prediction:
        if (m, k) not in seen:
            ttft, gaps = simulate(profile, workload, m, k)
            t, g = _p90(ttft), _p90(gaps)
            seen[m, k] = Prediction(kept, m, k, t, g, t <= ttft_slo_s and g <= itl_slo_s)
            tried.append(seen[m, k])
        return seen[m, k]

    if not profile.interference:  # prefill does not depend on the decode pool: size it first, alone
        runs = {}
        for m in range(1, (max_devices - tp_d) // tp_p + 1):
            runs[m] = _prefill_run(workload, profile.prefill, m, correction=profile.prefill_correction)
            ttft_p90 = _p90(runs[m][0])
            tried.append(Prediction(kept, m, 0, ttft_p90, math.nan, False))
            if ttft_p90 <= ttft_slo_s:
                break
        else:  # none meets the TTFT SLO: the fewest instances as close to it as any
            closest = min(p.ttft_p90_s for p in tried)
            m = min(p.prefill for p in tried if p.ttft_p90_s <= closest * 1.02)
            ttft_p90 = _p90(runs[m][0])
        _, first, start, done = runs[m]
        slowdown_at = decode_slowdown_at(profile, start, done, m)  # decode under this M's prefills
        for k in range(1, (max_devices - m * tp_p) // tp_d + 1):
            itl_p90 = _p90(simulate_decode(workload, profile.decode, k, first, slowdown_at,
                                           profile.decode_correction))
            tried.append(Prediction(kept, m, k, ttft_p90, itl_p90, ttft_p90 <= ttft_slo_s and itl_p90 <= itl_slo_s))
            if itl_p90 <= itl_slo_s:
                break
        return _closest(tried, ttft_slo_s, itl_slo_s, tp_p, tp_d), tried
    # with interference, prefill slows with the decode streams, which the decode pool's speed sets:
    # the smallest M for the current K, then the smallest K for that M, until neither moves
    m = k = 1
    for _ in range(4):
        for m2 in range(1, (max_devices - k * tp_d) // tp_p + 1):
            if predict(m2, k).ttft_p90_s <= ttft_slo_s:
                break
        for k2 in range(1, (max_devices - m2 * tp_p) // tp_d + 1):
            if predict(m2, k2).itl_p90_s <= itl_slo_s:
                break
        if (m2, k2) == (m, k):
            break
        m, k = m2, k2
    best = seen[m2, k2]
    if not best.meets:  # the alternation can stop at a pair with a later, smaller one meeting both
        best = _closest(tried, ttft_slo_s, itl_slo_s, tp_p, tp_d)
    return best, tried


def _closest(tried: list[Prediction], ttft_slo_s: float, itl_slo_s: float, tp_p: int, tp_d: int) -> Prediction:
    """The smallest of the fully simulated candidates that meets both SLOs, else the smallest of
    those whose worse SLO ratio (p90 over SLO) is within 2 % of the best one's: more devices
    that do not bring the prediction closer are not recommended."""
    full = [p for p in tried if not math.isnan(p.itl_p90_s)]
    size = lambda p: (p.prefill * tp_p + p.decode * tp_d, p.prefill)  # noqa: E731
    if any(p.meets for p in full):
        return min((p for p in full if p.meets), key=size)
    ratio = {id(p): max(p.ttft_p90_s / ttft_slo_s, p.itl_p90_s / itl_slo_s) for p in full}
    best = min(ratio.values())
    return min((p for p in full if ratio[id(p)] <= best * 1.02), key=size)


def extrapolation_warnings(profile: Profile, workload: Workload) -> list[str]:
    """Where ``workload`` leaves what ``profile`` measured, in words: prompts longer than the
    longest profiled prefill (their prefill time comes from the fit's quadratic, outside the
    points it was fitted to). Empty for a profile without points (written by hand)."""
    if not profile.prefill_points or not len(workload.input_len):
        return []
    longest = int(max(p[0] for p in profile.prefill_points))
    over = int((workload.input_len > longest).sum())
    if not over:
        return []
    return [f"{over} of {len(workload.input_len)} prompts are longer than the longest profiled ({longest} "
            f"tokens; the longest is {int(workload.input_len.max())}): their prefill time is extrapolated from "
            f"the fit; profile with --lengths up to {int(workload.input_len.max())} to measure it"]


# ---- live correction (Dynamo's correction factors) ---------------------------------------------
#: requests a window must hold for ``epd plan correct`` to fit factors to it
MIN_OBSERVED_REQUESTS = 10
#: the range a correction factor is searched in (the profile too fast / too slow by 16x at most)
CORRECTION_RANGE = (1 / 16, 16.0)


@dataclass(frozen=True, slots=True)
class Observation:
    """A live server's traffic over a window of its ``/metrics``: ``requests`` whose first
    token came out in it, ``rate`` (req/s), ``isl_mean`` (prompt tokens per prefill: the
    prefill pool's ``epd_prompt_tokens_total`` over its prefills, both counted as each ends),
    ``osl_mean`` (output chunks per request: the API's inter-token gaps per request + 1), the
    API's mean ``ttft_s`` and ``itl_s``, and the live ``prefill`` and ``decode`` instances;
    ``window_s``: seconds."""

    requests: int
    rate: float
    isl_mean: float
    osl_mean: float
    ttft_s: float
    itl_s: float
    prefill: int
    decode: int
    window_s: float

    @classmethod
    def from_window(cls, w: Window) -> "Observation":
        """Raises PlanError when the window has no prefill and decode pool or too few requests."""
        if not (w.has_pool("prefill") and w.has_pool("decode")):
            raise PlanError(f"the server has no prefill and decode pools to correct (pools: {', '.join(w.pools())})")
        ttft, itl, pre = w.histogram(TTFT, "api"), w.histogram(ITL, "api"), w.histogram(PREFILL, "prefill")
        n = int(ttft.count) if ttft is not None else 0
        if n < MIN_OBSERVED_REQUESTS or pre is None or not pre.count or itl is None or not itl.count:
            raise PlanError(f"the window holds {n} requests with a first token (and "
                            f"{int(itl.count) if itl is not None else 0} later tokens); at least "
                            f"{MIN_OBSERVED_REQUESTS} streamed requests are needed: run the traffic during it, "
                            f"or widen --window")
        return cls(requests=n, rate=n / w.duration_s, isl_mean=w.counter(PROMPT_TOKENS, pool="prefill") / pre.count,
                   osl_mean=itl.count / n + 1, ttft_s=ttft.mean, itl_s=itl.mean, prefill=w.instances("prefill"),
                   decode=w.instances("decode"), window_s=w.duration_s)


def observe_server(url: str, window_s: float, timeout_s: float = 30.0, model: str | None = None,
                   log=None) -> Observation:
    """Read ``url``'s ``/metrics`` twice, ``window_s`` seconds apart, while its traffic runs.
    ``model``: the profile's model, which the server must serve.

    Raises:
        PlanError: the server cannot be read, serves another model than ``model``, or the
            window is unusable (:meth:`Observation.from_window`).
    """
    import httpx

    try:
        with httpx.Client(timeout=timeout_s) as client:
            if model is not None:
                served, _ = _model_info(client, metrics_url(url).removesuffix("/metrics"))
                if served != model:
                    raise PlanError(f"the profile is of {model!r} but {url} serves {served!r}: profile this server "
                                    f"first (`epd plan profile --url {url}`)")
            first = scrape(client, metrics_url(url))
            if log is not None:
                log(f"observing {url} for {window_s:g} s ...")
            time.sleep(window_s)
            return Observation.from_window(Window(first, scrape(client, metrics_url(url))))
    except MetricsError as e:
        raise PlanError(str(e)) from None
    except httpx.HTTPError as e:
        raise PlanError(f"cannot read {url}: {type(e).__name__}: {e}") from None


def _solve_factor(f, target: float, iters: int = 12) -> float:
    """The ``c`` in :data:`CORRECTION_RANGE` with ``f(c) = target`` for a nondecreasing ``f``
    (bisection on log c), clamped to the range's ends."""
    lo, hi = math.log(CORRECTION_RANGE[0]), math.log(CORRECTION_RANGE[1])
    if f(math.exp(lo)) >= target:
        return math.exp(lo)
    if f(math.exp(hi)) <= target:
        return math.exp(hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(math.exp(mid)) < target else (lo, mid)
    return math.exp((lo + hi) / 2)


def fit_corrections(profile: Profile, obs: Observation, workload: Workload | None = None, num_requests: int = 300,
                    rounds: int = 2) -> tuple[float, float]:
    """``(prefill_correction, decode_correction)``: the factors on the profile's prefill
    seconds and decode step seconds with which :func:`simulate`, run on the observed load
    on the observed pools, gives the observed mean TTFT and mean ITL. The load: ``workload``
    (the lengths the traffic follows, e.g. the trace being replayed) with its times rescaled
    to the observed rate, else a Poisson workload of ``num_requests`` requests of the observed
    mean ISL and OSL (constant lengths queue less than a trace's long tail, so a factor fitted
    on them comes out larger).

    After Dynamo's planner, which scales its profile's predictions by ``actual / expected``
    TTFT and ITL of the last interval (``prefill_correction``, ``decode_correction``). Here
    each factor scales a service time inside the simulation instead, solved for (bisection),
    so that queueing grows with it as it does on the server: at low load it is that ratio.
    What it absorbs is whatever the profile did not measure (on shared cores: the API, the
    clients and the KV transfers taking compute from the workers; the prompts' real template
    and tokenizer). The two are solved in turn, ``rounds`` times (they interact through the
    interference tables)."""
    if workload is None:
        w = synthetic_workload(max(1, round(obs.isl_mean)), max(1, round(obs.osl_mean)), obs.rate, num_requests)
    else:
        from epd.bench.arrivals import rescale_to_rate

        n = min(len(workload.arrival_s), max(num_requests, obs.requests))  # the first n rows: as many as were seen
        if n < 2:
            raise PlanError(f"{workload.source}: at least 2 rows are needed to replay it at the observed rate")
        w = Workload(np.asarray(rescale_to_rate(workload.arrival_s[:n], obs.rate), dtype=np.float64),
                     workload.input_len[:n], workload.output_len[:n], workload.source)
    cp = cd = 1.0
    for _ in range(rounds):
        cp = _solve_factor(lambda c, cd=cd: float(np.mean(simulate(_corrected(profile, c, cd), w, obs.prefill,
                                                                   obs.decode)[0])), obs.ttft_s)
        cd = _solve_factor(lambda c, cp=cp: float(np.mean(simulate(_corrected(profile, cp, c), w, obs.prefill,
                                                                   obs.decode)[1])), obs.itl_s)
    return cp, cd


def _corrected(profile: Profile, prefill: float, decode: float, observed: dict | None = None) -> Profile:
    return replace(profile, prefill_correction=prefill, decode_correction=decode,
                   correction_observed=profile.correction_observed if observed is None else observed)


# ---- applying the replica counts ---------------------------------------------------------------
def kubectl_commands(replicas: dict[str, int], namespace: str) -> list[list[str]]:
    """``kubectl scale deployment/epd-<pool> --replicas=R -n NS`` per pool (the scale subresource)."""
    return [["kubectl", "scale", f"deployment/{DEPLOYMENTS[pool]}", f"--replicas={n}", "-n", namespace]
            for pool, n in replicas.items()]


def apply(replicas: dict[str, int], connector: str, *, state: str | Path = "epd-plan-replicas.json",
          namespace: str = "epd", dry_run: bool = False, out=print) -> None:
    """Set the replicas of the pools ``replicas`` names (others are left alone): ``local``
    writes them into ``state`` (JSON, keeping its other pools), ``kubernetes`` runs kubectl
    (``dry_run``: prints the commands). Raises PlanError when kubectl fails or ``state`` is
    not a connector state."""
    if connector == "local":
        merged = {**_state_of(Path(state)), **replicas}  # pools not named keep their replicas
        if dry_run:
            out(f"would write {json.dumps(merged)} to {state}")
            return
        _write(Path(state), json.dumps(merged, indent=2) + "\n")
        out(f"wrote {json.dumps(merged)} to {state}")
        return
    for cmd in kubectl_commands(replicas, namespace):
        out(" ".join(cmd))
        if not dry_run:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise PlanError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")


def _state_of(path: Path) -> dict:
    """The local connector's replicas so far ({} when the file is missing); raises PlanError
    when it is not a JSON object of pool -> replicas."""
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read the local connector's state {path}: {e}") from None
    if not isinstance(state, dict):
        raise PlanError(f"{path} is not the local connector's state (a JSON object of pool -> replicas)")
    return state


# ---- command line ------------------------------------------------------------------------------
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


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise PlanError(f"cannot write {path}: {e.strerror or e}") from None


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
                       description=__doc__.split("\n\n")[0])
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
    pr.add_argument("--decode-tokens", type=positive_int, default=64, help="tokens per decode request (default: %(default)s)")
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
    pr.add_argument("--timeout", type=positive_float, default=300.0, help="seconds one request may take (default: %(default)g)")
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
        _write(out, json.dumps(prof.to_json(), indent=2) + "\n")
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
        _write(out, json.dumps(_corrected(prof, cp, cd, asdict(obs)).to_json(), indent=2) + "\n")
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
    replicas = {"prefill": best.prefill, "decode": best.decode}  # the pools it sizes; encode stays as it is
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
        print(f"{best.pools}  (tp p:{prof.tp.get('prefill', 1)},d:{prof.tp.get('decode', 1)})  "
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
