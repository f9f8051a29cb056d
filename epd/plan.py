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
  prefill is measured again. ``--prefill-under-decode S`` keeps S long decode streams
  running meanwhile, for workers that share cores or a device (their interference is
  otherwise missing from the profile). Fit: ``prefill_s = c0 + c1*n + c2*n^2``
  (least squares, coefficients clipped at >= 0), ``n`` input tokens.
- decode: for each context (prompt length, default 64 and 512) and batch size (default
  1, 2, 4, 8), that many concurrent requests of ``--decode-tokens`` tokens (``ignore_eos``).
  The decode workers' ``epd_decode_step_seconds`` over them gives the step time (a running
  stream's ITL) and, as decode tokens / steps, the mean running batch (the requests' prefills
  are staggered, so fewer than ``batch`` may run at once). Fit: ``itl_s = a + b*batch +
  c*batch*context`` over (mean batch, mean context, step time); the step reads every
  running sequence's KV, so its cost grows with batch x context.

``epd plan recommend --profile profile.json (--trace PATH | --isl-mean N --osl-mean N --rate R)
--ttft-slo S --itl-slo S`` simulates, per candidate, the workload's arrivals (the trace's
recorded times, rescaled to ``--rate`` when given, or gamma arrivals of coefficient ``--cv``):

- prefill: ``M`` instances, each a FIFO single server (a prompt's chunks occupy the
  instance's steps until it is done; batching several prompts in one step does not raise a
  compute-bound worker's token throughput), a request joining the instance that frees up
  first; ``TTFT = queue wait + prefill_s(n) + overhead``.
- decode: ``K`` instances, a request (arriving when its prefill ends) joining the one with
  the fewest running streams; each instance steps all its running streams at once, one
  token each, the step lasting ``itl_s(batch, mean context)`` of the profile (continuous
  batching); every token's gap is one ITL sample.

The p90 over the simulated requests (TTFT) and tokens (ITL) are the predictions. Prefill
only depends on ``M`` and decode on ``K`` (given the prefill ends), so the search takes the
smallest ``M`` meeting the TTFT SLO, then the smallest ``K`` meeting the ITL SLO, within
``--max-devices`` (``M*tp_p + K*tp_d``; TP is the profile's ``tp`` per pool, which
``profile`` writes as 1: the TP of the profiled workers is not read from the server, so a
profile of TP workers needs its ``tp`` edited). ``e:N``: the traces hold no media, so the
encode pool is 0 (the profile's encode instances are not sized). Not modelled: KV
capacity (preemption when a decode instance's cache is full), ``max_num_seqs``,
prefix-cache hits, chunked prefill sharing steps with decodes (aggregated ``pd`` pools),
and the interference of workers that share cores or a device (see ``--prefill-under-decode``).

``--apply`` sets the replicas: ``--connector local`` writes ``{"encode": N, "prefill": M,
"decode": K}`` to ``--state`` (a JSON file), ``--connector kubernetes`` runs
``kubectl scale deployment/epd-<pool> --replicas=R -n NS`` for the per-pool Deployments of
deploy/ (the scale subresource), ``--dry-run`` printing the commands instead.

Exit codes: 0 done (recommend: the SLOs can be met), 1 no candidate within
``--max-devices`` meets them, 2 bad input (a missing or malformed profile or trace, a
server that cannot be read).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from epd.diagnose import MetricsError, Window, metrics_url, positive_float, scrape

__all__ = ["DecodeFit", "PlanError", "PrefillFit", "Profile", "Prediction", "Workload", "add_parser", "apply",
           "fit_decode", "fit_prefill", "kubectl_commands", "load_profile", "profile_server", "recommend",
           "simulate_decode", "simulate_prefill", "synthetic_workload", "trace_workload"]

PROFILE_VERSION = 1
DEFAULT_PREFILL_LENGTHS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_CONTEXTS = (64, 512)
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
    profiled server; ``tp``: tensor-parallel size per pool (1 where unknown);
    ``prefill_points``: ``[input_tokens, prefill_s, ttft_s]``; ``decode_points``:
    ``[batch, context, itl_s]``; ``prefill_under_decode``: the decode streams run while prefill was timed."""

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
    """Fit ``[input_tokens, prefill_s, ttft_s]`` points. Raises PlanError with fewer than
    2 distinct lengths or a non-positive time."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    if len(np.unique(p[:, 0])) < 2:
        raise PlanError("the prefill fit needs points at 2 or more input lengths")
    if not (p[:, 1] > 0).all():
        raise PlanError("prefill times must be > 0")
    n = p[:, 0]
    c = _nonneg_lstsq(np.stack([np.ones_like(n), n, n * n], axis=1), p[:, 1])
    overhead = float(np.median(np.maximum(p[:, 2] - p[:, 1], 0.0)))
    return PrefillFit(float(c[0]), float(c[1]), float(c[2]), overhead)


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
                       prefill_under_decode=int(d.get("prefill_under_decode", 0)))
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


class _Background:
    """``streams`` threads each running long-output requests (64-token prompt, as many
    tokens as the model's length allows) until :meth:`stop`: decode load on the server."""

    def __init__(self, client, base: str, model: str, streams: int, cap: int | None, rng: random.Random,
                 vocab_hi: int) -> None:
        self.done = threading.Event()
        tokens = max(2, min(512, (cap or 2048) - 64))
        prompts = [[rng.randrange(10, vocab_hi) for _ in range(64)] for _ in range(streams)]

        def loop(prompt: list[int]) -> None:
            while not self.done.is_set():
                try:
                    _complete(client, base, model, prompt, tokens)
                except Exception:  # noqa: BLE001 - cancelled by stop(), or the server's own error
                    return

        self.threads = [threading.Thread(target=loop, args=(p,), daemon=True) for p in prompts]
        for t in self.threads:
            t.start()
        if streams:
            time.sleep(1.0)  # their prefills are done: the measured windows see only decode steps

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join()


def profile_server(url: str, *, lengths=DEFAULT_PREFILL_LENGTHS, repeats: int = 3, batches=DEFAULT_BATCHES,
                   contexts=DEFAULT_CONTEXTS, decode_tokens: int = 64, prefill_background: int = 0, seed: int = 0,
                   timeout_s: float = 300.0, log=None) -> Profile:
    """Measure ``url``'s prefill and decode (the module docstring says how). Lengths and
    contexts are capped so prompt + output fits the model's ``max_model_len``.
    ``prefill_background``: decode streams kept running while prefill is timed.

    Raises:
        PlanError: the server cannot be read, has no prefill/pd pool, or a request fails.
    """
    import httpx

    log = log or (lambda msg: None)
    base = metrics_url(url).removesuffix("/metrics")
    rng = random.Random(seed)
    try:
        with httpx.Client(timeout=timeout_s) as client:
            model, max_len = _model_info(client, base)
            first = scrape(client, metrics_url(url))
            w0 = Window(first, first)
            pool = _prefill_pool(w0)
            pools = {p: w0.instances(p) for p in w0.pools() if p != "api"}
            cap = (max_len - 2) if max_len else None
            lens = sorted({min(n, cap) if cap else n for n in lengths})
            vocab_hi = 400  # the tiny models' vocabularies are >= 400; real ones far larger
            _complete(client, base, model, [rng.randrange(10, vocab_hi) for _ in range(16)], 1)  # warm-up
            background = _Background(client, base, model, prefill_background, cap, rng, vocab_hi)
            prefill_points = []
            try:
                for n in lens:
                    got = 0
                    for _ in range(repeats * 4):  # a window that holds a background prefill is measured again
                        before = scrape(client, metrics_url(url))
                        ttft = _complete(client, base, model, [rng.randrange(10, vocab_hi) for _ in range(n)], 1)
                        h = Window(before, scrape(client, metrics_url(url))).histogram("epd_prefill_seconds", pool)
                        if h is None or not h.count:
                            raise PlanError(f"the {pool} pool observed no epd_prefill_seconds for a request")
                        if h.count == 1:
                            prefill_points.append([n, h.sum, ttft])
                            got += 1
                            if got == repeats:
                                break
                    log(f"prefill {n:5d} tokens: {np.mean([p[1] for p in prefill_points[-got:]]) * 1e3:8.1f} ms"
                        + (f" (under {prefill_background} decode streams)" if prefill_background else ""))
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
    except httpx.HTTPError as e:
        raise PlanError(f"cannot profile {url}: {type(e).__name__}: {e}") from None
    except MetricsError as e:
        raise PlanError(str(e)) from None
    tp = {p: 1 for p in pools}
    return Profile(model=model, pools=pools, prefill=fit_prefill(prefill_points), decode=fit_decode(decode_points),
                   prefill_points=prefill_points, decode_points=decode_points, tp=tp, url=url,
                   measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   prefill_under_decode=prefill_background)


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
        t = np.asarray(rescale_to_rate(t, rate), dtype=np.float64)
    return Workload(t, np.asarray([r.input_len for r in rows])[order], np.asarray([r.output_len for r in rows])[order],
                    f"trace {path}: {len(rows)} rows" + (f", lengths x{scale:g}" if scale else "")
                    + (f", {rate:g} req/s" if rate else ""))


def simulate_prefill(w: Workload, fit: PrefillFit, instances: int) -> tuple[np.ndarray, np.ndarray]:
    """FIFO through ``instances`` single-server prefill instances. Returns (TTFT s, time the
    request's first token is out, s) per request."""
    free = [0.0] * instances
    heapq.heapify(free)
    service = fit.seconds(w.input_len.astype(np.float64))
    done = np.empty(len(w.arrival_s))
    for i, (t, s) in enumerate(zip(w.arrival_s, service)):
        start = max(t, heapq.heappop(free))
        done[i] = start + s
        heapq.heappush(free, done[i])
    ttft = done - w.arrival_s + fit.overhead_s
    return ttft, w.arrival_s + ttft


def simulate_decode(w: Workload, fit: DecodeFit, instances: int, first_token_s: np.ndarray) -> np.ndarray:
    """Continuous batching on ``instances`` decode instances (least running streams first);
    returns every inter-token gap (s) of every request's ``output_len - 1`` later tokens."""
    order = np.argsort(first_token_s, kind="stable")
    arrivals = [(float(first_token_s[i]), int(w.input_len[i]), int(w.output_len[i]) - 1) for i in order
                if w.output_len[i] > 1]
    # per instance: running [context, tokens left, time of last token]
    running: list[list[list[float]]] = [[] for _ in range(instances)]
    clock = [0.0] * instances
    gaps: list[float] = []
    nxt = 0
    while nxt < len(arrivals) or any(running):
        # the instance whose next step starts first; a new arrival joins before it if it is earlier
        busy = [k for k in range(instances) if running[k]]
        k = min(busy, key=lambda j: clock[j]) if busy else None
        if nxt < len(arrivals) and (k is None or arrivals[nxt][0] <= clock[k]):
            t, ctx, left = arrivals[nxt]
            nxt += 1
            j = min(range(instances), key=lambda j: len(running[j]))
            if not running[j]:
                clock[j] = max(clock[j], t)
            running[j].append([float(ctx), float(left), t])
            continue
        batch = running[k]
        step = fit.seconds(len(batch), sum(s[0] for s in batch) / len(batch))
        clock[k] += step
        for s in batch:
            gaps.append(clock[k] - s[2])
            s[0] += 1
            s[1] -= 1
            s[2] = clock[k]
        running[k] = [s for s in batch if s[1] > 0]
    return np.asarray(gaps)


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
    for m in range(1, (max_devices - tp_d) // tp_p + 1):
        ttft, first = simulate_prefill(workload, profile.prefill, m)
        ttft_p90 = _p90(ttft)
        tried.append(Prediction(0, m, 0, ttft_p90, math.nan, False))
        if ttft_p90 <= ttft_slo_s:
            break
    for k in range(1, (max_devices - m * tp_p) // tp_d + 1):
        itl_p90 = _p90(simulate_decode(workload, profile.decode, k, first))
        tried.append(Prediction(0, m, k, ttft_p90, itl_p90, ttft_p90 <= ttft_slo_s and itl_p90 <= itl_slo_s))
        if itl_p90 <= itl_slo_s:
            break
    return tried[-1], tried


# ---- applying the replica counts ---------------------------------------------------------------
def kubectl_commands(replicas: dict[str, int], namespace: str) -> list[list[str]]:
    """``kubectl scale deployment/epd-<pool> --replicas=R -n NS`` per pool (the scale subresource)."""
    return [["kubectl", "scale", f"deployment/{DEPLOYMENTS[pool]}", f"--replicas={n}", "-n", namespace]
            for pool, n in replicas.items()]


def apply(replicas: dict[str, int], connector: str, *, state: str | Path = "epd-plan-replicas.json",
          namespace: str = "epd", dry_run: bool = False, out=print) -> None:
    """Set each pool's replicas: ``local`` writes them to ``state`` (JSON), ``kubernetes``
    runs kubectl (``dry_run``: prints the commands). Raises PlanError when kubectl fails."""
    if connector == "local":
        if dry_run:
            out(f"would write {json.dumps(replicas)} to {state}")
            return
        Path(state).write_text(json.dumps(replicas, indent=2) + "\n")
        out(f"wrote {json.dumps(replicas)} to {state}")
        return
    for cmd in kubectl_commands(replicas, namespace):
        out(" ".join(cmd))
        if not dry_run:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise PlanError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()[:300]}")


# ---- command line ------------------------------------------------------------------------------
def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        xs = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"every number must be >= 1, got {text!r}")
    return xs


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand (``profile``, ``recommend``) to an ``argparse`` sub-parser set."""
    from epd.cli import _non_negative_int, _positive_int

    p = sub.add_parser("plan", help="profile a running server and size the pools for a workload and SLOs",
                       description=__doc__.split("\n\n")[0])
    psub = p.add_subparsers(dest="plan_command", required=True)
    pr = psub.add_parser("profile", help="measure prefill time vs input length and decode ITL vs batch size")
    pr.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    pr.add_argument("--out", default="profile.json", help="the profile JSON to write (default: %(default)s)")
    pr.add_argument("--lengths", type=_positive_ints, default=DEFAULT_PREFILL_LENGTHS,
                    help="prefill input lengths, tokens (default: 64,128,256,512,1024,2048)")
    pr.add_argument("--repeats", type=_positive_int, default=3, help="requests per input length")
    pr.add_argument("--batches", type=_positive_ints, default=DEFAULT_BATCHES, help="decode batch sizes")
    pr.add_argument("--contexts", type=_positive_ints, default=DEFAULT_CONTEXTS,
                    help="decode prompt lengths, tokens (default: 64,512)")
    pr.add_argument("--decode-tokens", type=_positive_int, default=64, help="tokens per decode request")
    pr.add_argument("--prefill-under-decode", type=_non_negative_int, default=0, metavar="STREAMS",
                    help="time prefill while this many long decode streams run (co-located workers that share "
                         "cores or a device interfere; default 0: prefill alone)")
    pr.add_argument("--timeout", type=positive_float, default=300.0, help="seconds one request may take")
    pr.set_defaults(func=cmd_profile)

    r = psub.add_parser("recommend", help="the smallest e:N,p:M,d:K meeting the TTFT and ITL SLOs")
    r.add_argument("--profile", required=True, help="a profile JSON of `epd plan profile`")
    r.add_argument("--trace", help="a ../shared/traces trace (.jsonl Mooncake or .csv Azure)")
    r.add_argument("--limit", type=_positive_int, default=1000, help="trace rows (default: %(default)s)")
    r.add_argument("--start", type=int, default=0, help="first trace row")
    r.add_argument("--scale", type=positive_float, default=None, help="trace length factor (as epd bench)")
    r.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="scale the trace's lengths to fit this (as epd bench), unless --scale")
    r.add_argument("--isl-mean", type=_positive_int, help="synthetic workload: input tokens")
    r.add_argument("--osl-mean", type=_positive_int, help="synthetic workload: output tokens")
    r.add_argument("--rate", type=positive_float, help="req/s (synthetic; rescales a trace's times)")
    r.add_argument("--num-requests", type=_positive_int, default=1000, help="synthetic requests")
    r.add_argument("--cv", type=positive_float, default=1.0, help="synthetic arrivals' coefficient of variation")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--ttft-slo", type=positive_float, required=True, help="p90 TTFT SLO, seconds")
    r.add_argument("--itl-slo", type=positive_float, required=True, help="p90 ITL SLO, seconds")
    r.add_argument("--max-devices", type=_positive_int, default=16, help="devices for p and d (default: 16)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--apply", action="store_true", help="set the recommended replicas through --connector")
    r.add_argument("--connector", choices=("local", "kubernetes"), default="local")
    r.add_argument("--state", default="epd-plan-replicas.json", help="the local connector's JSON file")
    r.add_argument("--namespace", "-n", default="epd", help="the Deployments' namespace (default: epd)")
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
        prof = profile_server(args.url, lengths=args.lengths, repeats=args.repeats, batches=args.batches,
                              contexts=args.contexts, decode_tokens=args.decode_tokens,
                              prefill_background=args.prefill_under_decode, timeout_s=args.timeout,
                              log=lambda m: print(m, file=sys.stderr))
    except PlanError as e:
        return _fail(args, str(e))
    Path(args.out).write_text(json.dumps(prof.to_json(), indent=2) + "\n")
    f, d = prof.prefill, prof.decode
    print(f"profiled {prof.model} on {', '.join(f'{k}:{v}' for k, v in prof.pools.items())} -> {args.out}\n"
          f"  prefill_s = {f.c0:.4g} + {f.c1:.4g}*n + {f.c2:.4g}*n^2, TTFT overhead {f.overhead_s * 1e3:.1f} ms\n"
          f"  itl_s = {d.a:.4g} + {d.b:.4g}*batch + {d.c:.4g}*batch*context")
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    try:
        prof = load_profile(args.profile)
        if args.trace:
            if args.isl_mean or args.osl_mean:
                raise PlanError("give either --trace or --isl-mean/--osl-mean/--rate, not both")
            work = trace_workload(args.trace, args.limit, args.start, args.scale, args.max_model_len, args.rate)
        elif args.isl_mean and args.osl_mean and args.rate:
            work = synthetic_workload(args.isl_mean, args.osl_mean, args.rate, args.num_requests, args.cv, args.seed)
        else:
            raise PlanError("a workload is needed: --trace PATH, or --isl-mean N --osl-mean N --rate R")
        best, tried = recommend(prof, work, args.ttft_slo, args.itl_slo, args.max_devices)
    except PlanError as e:
        return _fail(args, str(e))
    replicas = {"encode": best.encode, "prefill": best.prefill, "decode": best.decode}
    if args.json:
        print(json.dumps({"pools": best.pools, "replicas": replicas, "tp": prof.tp, "meets_slo": best.meets,
                          "predicted": {"ttft_p90_s": best.ttft_p90_s, "itl_p90_s": best.itl_p90_s},
                          "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo}, "workload": work.source,
                          "model": prof.model,
                          "candidates": [{"pools": c.pools, "ttft_p90_s": c.ttft_p90_s,
                                          "itl_p90_s": None if math.isnan(c.itl_p90_s) else c.itl_p90_s}
                                         for c in tried]}))
    else:
        print(f"{best.pools}  (tp p:{prof.tp.get('prefill', 1)},d:{prof.tp.get('decode', 1)})  "
              f"predicted p90 TTFT {best.ttft_p90_s * 1e3:.0f} ms (SLO {args.ttft_slo * 1e3:.0f}), "
              f"p90 ITL {best.itl_p90_s * 1e3:.1f} ms (SLO {args.itl_slo * 1e3:.1f})"
              + ("" if best.meets else f"  -- NOT met within {args.max_devices} devices"))
        print(f"  {work.source}; profile of {prof.model}", file=sys.stderr)
    if args.apply and not best.meets:
        print(f"epd plan recommend: not applied: no pool set within {args.max_devices} devices meets the SLOs",
              file=sys.stderr)
    elif args.apply:
        try:
            apply(replicas, args.connector, state=args.state, namespace=args.namespace, dry_run=args.dry_run,
                  out=(lambda m: print(m, file=sys.stderr)) if args.json else print)
        except PlanError as e:
            return _fail(args, str(e))
    return 0 if best.meets else 1
