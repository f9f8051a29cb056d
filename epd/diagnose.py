"""``epd diagnose``: read a running server's ``/metrics`` over a window and name its bottleneck.

It reads ``URL/metrics`` at the start and at the end of ``--window`` seconds, and every
``--interval`` seconds in between for the gauges, and computes per pool, over the window
only (deltas of the counters and of the histogram buckets):

- rates: requests/s, prompt and output tokens/s, KV bytes/s, decode steps/s;
- count, mean and p50/p95/p99 of every stage histogram (seconds), from the bucket deltas
  (linear interpolation inside a bucket, as PromQL's ``histogram_quantile``: a quantile is
  only as fine as the buckets of epd/metrics.py);
- KV usage, queue depth and running batch (mean and max of the gauge samples),
  preemptions, prefix- and encoder-cache hit rates, cancellations, KV transfer failures.

Then it runs the checks of :data:`SYMPTOMS` (issue 18's list). Each check ends
``symptom`` (with its evidence, likely cause and the fix to try), ``ok``,
``not_applicable`` (the pool it is about is not deployed) or ``not_evaluated`` (a metric
it needs is missing or has fewer observations in the window than the check's minimum,
so an idle server has no symptom, yet is not called healthy: see the verdicts below).
The thresholds are the module constants below.

Where the numbers come from (epd/metrics.py): the request-level latencies (TTFT, TPOT,
ITL, e2e) and cancellations are observed by the API, ``pool="api"``; ``prefill_queue``,
``prefill`` and ``kv_transfer`` by prefill workers; ``decode_queue`` by decode workers;
``decode_step`` by decode and aggregated (``pd``) workers; gauges and the prefix-cache
and preemption counters by every engine worker; retries, migrations and routing
decisions by the router (labelled with the pool they concern).

Verdict and exit code (:attr:`Report.status`):

- ``symptoms``, exit 1: at least one symptom (whatever the traffic);
- ``healthy``, exit 0: no symptom, and at least one check was evaluated (judged ``ok``);
- ``no_traffic``, exit 3: no request in the window (no TTFT, e2e or routing decision), so
  nothing was judged: the server is idle, not found healthy;
- ``too_little_traffic``, exit 3: some requests, but no check had the observations it
  needs (every one ``not_evaluated`` or ``not_applicable``);
- exit 2: the server could not be read.

Units: ``prefix_*`` cache counts are prompt tokens (``epd_prefix_cache_*_tokens_total``);
``epd_kv_transfer_requests_total`` counts NIXL READ/WRITE operations, not client requests
(one per layer, and per TP rank with per-rank agents, for each P->D transfer), reported
here as ``kv_transfer_ops`` and ``nixl_ops_per_transfer``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

__all__ = ["SYMPTOMS", "Check", "HistogramWindow", "MetricsError", "Report", "Scrape", "Settings", "Window",
           "add_parser", "diagnose", "evaluate", "parse_metrics", "scrape"]

# ---- thresholds (seconds unless said otherwise) ---------------------------------------------
#: observations of a per-request histogram (TTFT, TPOT, e2e, prefill queue/exec, KV transfer,
#: decode queue) in the window before a check judges it: with fewer, a p99 is one request's luck
MIN_REQUESTS = 10
#: observations of a per-token or per-step histogram (ITL, decode step) before a check judges it
MIN_STEPS = 50
#: a spike: an ITL gap (or a decode step) at least this many times the median ...
SPIKE_RATIO = 3.0
#: ... and at least this long: a stall shorter than 50 ms is invisible to whoever reads the stream
SPIKE_MIN_S = 0.05
#: share (0..1) of the streams' time between tokens (the ITL sum) spent in spikes from which
#: they stall visibly; a time share, not a p99: one long prefill a second stalls every stream
#: for long, yet is a small fraction of the gaps when the streams are fast
SPIKE_TIME_SHARE = 0.1
#: ... and at least this many of them (gaps; for decode steps: steps), so one hiccup is not a pattern
SPIKE_MIN_COUNT = 5
#: prefill queue mean at least this many times the prefill execution mean: waiting, not
#: computing, makes the prefill stage's time
QUEUE_DOMINANCE_RATIO = 2.0
#: ... and at least this long: a queue of a few ms dominating a fast prefill is no problem
PREFILL_QUEUE_MIN_S = 0.2
#: ... and at least this share of the TTFT mean: the queue is what the client waits for
QUEUE_SHARE_OF_TTFT = 0.5
#: requests in prefill execution at once per prefill instance, mean over the window (Little's
#: law: prefill execution seconds / window / instances), under which a queueing prefill pool is
#: under-used: prompts are prefilled one at a time (each step's token budget holds one prompt's
#: chunk) instead of several per step
PREFILL_CONCURRENCY_MIN = 1.5
#: KV transfer p99 at least this long ...
KV_TRANSFER_P99_S = 0.25
#: ... and at least this many times the prefill execution p99: the transfer starts with the
#: first layer's write and overlaps the compute of the later layers, so only a transfer that
#: outlasts the compute is the wire's fault
KV_TRANSFER_OVER_PREFILL = 1.5
#: KV cache usage (used / total blocks, 0..1) counted as full
KV_USAGE_HIGH = 0.9
#: preemptions in the window of one pool that count as "many": at least this many ...
PREEMPTIONS_MIN = 2
#: ... and at least this fraction of the requests routed to the pool in the window
PREEMPTION_FRACTION = 0.05
#: decode queue p95 at least this long: requests whose KV arrived wait for a batch slot
DECODE_QUEUE_HIGH_S = 0.5
#: mean requests waiting per decode instance, with the cache full, that count as KV-bound
DECODE_WAITING_MIN = 1.0
#: prompt tokens looked up in a pool's prefix cache in the window before its hit rate is judged
PREFIX_MIN_QUERY_TOKENS = 2048
#: prefix-cache hit rate (hit tokens / looked-up tokens, 0..1) below which the cache is missed
PREFIX_HIT_RATE_MIN = 0.10
#: goodput / throughput (upper bound, 0..1) below which goodput is "far below" throughput:
#: fewer than half of the requests can have met both SLOs
GOODPUT_MIN_FRACTION = 0.5
#: busy fraction (instance-seconds of work / instances / window, 0..1) under which a pool idles
POOL_IDLE_MAX = 0.25
#: seconds between the gauge samples (an idle worker publishes its gauges at least every 2 s,
#: a busy one every 0.25 s)
DEFAULT_INTERVAL_S = 1.0
#: a suspected block leak is read again after this long before it is reported (longer than the
#: 2 s an idle worker may take to publish its gauges)
LEAK_CONFIRM_S = 3.0
#: SLOs of the goodput check (epd bench's defaults), seconds
DEFAULT_TTFT_SLO_S = 2.0
DEFAULT_TPOT_SLO_S = 0.1

# ---- metric names (epd/metrics.py) ------------------------------------------------------------
TTFT = "epd_time_to_first_token_seconds"
TPOT = "epd_time_per_output_token_seconds"
ITL = "epd_inter_token_latency_seconds"
E2E = "epd_e2e_request_latency_seconds"
PREFILL_QUEUE = "epd_prefill_queue_seconds"
PREFILL = "epd_prefill_seconds"
KV_TRANSFER = "epd_kv_transfer_seconds"
DECODE_QUEUE = "epd_decode_queue_seconds"
DECODE_STEP = "epd_decode_step_seconds"
KV_USAGE = "epd_kv_cache_usage_ratio"
QUEUE_DEPTH = "epd_queue_depth"
RUNNING = "epd_running_requests"
ROUTER_REQUESTS = "epd_router_requests"
POOL_INSTANCES = "epd_pool_instances"
PREEMPTIONS = "epd_preemptions_total"
CANCELLED = "epd_cancelled_requests_total"
ROUTED = "epd_routing_decisions_total"
PROMPT_TOKENS = "epd_prompt_tokens_total"
PREFIX_QUERIES = "epd_prefix_cache_queries_tokens_total"
PREFIX_HITS = "epd_prefix_cache_hits_tokens_total"
ENCODER_QUERIES = "epd_encoder_cache_queries_total"
ENCODER_HITS = "epd_encoder_cache_hits_total"
KV_BYTES = "epd_kv_transfer_bytes_total"
KV_FAILURES = "epd_kv_transfer_failures_total"
KV_RETRIES = "epd_kv_transfer_retries_total"
#: NIXL operations posted (one per layer and rank of each transfer), not client requests
KV_OPS = "epd_kv_transfer_requests_total"

#: stage histograms in report order: short name -> family
STAGES = {
    "ttft": TTFT, "tpot": TPOT, "itl": ITL, "e2e": E2E,
    "encode_queue": "epd_encode_queue_seconds", "encode": "epd_encode_seconds",
    "embedding_transfer": "epd_embedding_transfer_seconds",
    "prefill_queue": PREFILL_QUEUE, "prefill": PREFILL, "kv_transfer": KV_TRANSFER,
    "decode_queue": DECODE_QUEUE, "decode_step": DECODE_STEP,
    "tts_queue": "epd_tts_queue_seconds", "tts_first_audio": "epd_tts_time_to_first_audio_seconds",
    "tts_synthesis": "epd_tts_synthesis_seconds",
}
#: pools in report order (others follow alphabetically)
POOL_ORDER = ("api", "router", "encode", "prefill", "decode", "pd", "tts")
ENGINE_POOLS = ("prefill", "decode", "pd")

#: id -> (title, likely cause, fix to try); the ids are stable (``--json``, ``--ignore``)
SYMPTOMS: dict[str, tuple[str, str, str]] = {
    "prefill_steals_decode": (
        "decode ITL spikes on an aggregated pool: prefill steals decode steps",
        "long prompts are prefilled in the same engine steps as the running decodes, so every stream "
        "stalls while a prompt's chunk computes",
        "disaggregate (--pools p:N,d:M), or bound the prefill tokens of a step that carries decodes "
        "(lower --target-step-ms or --max-prefill-tokens-with-decodes)"),
    "prefill_queue_dominates_ttft": (
        "TTFT is made of prefill queueing: the prefill queue dominates prefill execution",
        "the prefill pool is saturated: requests wait for a prefill instance much longer than they compute",
        "add prefill instances (--pools p:N+1,...)"),
    "decode_tpot_jitter": (
        "TPOT/ITL jitter while TTFT is fine: decode steps are slow or the KV cache is full",
        "decode steps vary (a large batch or long contexts), or the decode KV cache is nearly full",
        "add decode instances, cap the context (--max-model-len), or quantize the KV cache"),
    "kv_transfer_slow": (
        "P->D KV transfer slow or failing",
        "the transport is slow or falls back (e.g. UCX over tcp instead of RDMA/NVLink/shared memory), "
        "or the decode peer is far away",
        "use RDMA or NVLink (UCX_TLS, --ucx-net-devices), place prefill and decode in the same zone/node"),
    "prefill_budget_small": (
        "prefill queue high while the prefill batch is under-used: the step token budget is too small",
        "prompts are prefilled one at a time, each over several steps (the step token budget holds "
        "less than a prompt or two), while the others queue",
        "raise the step token budget (--max-num-batched-tokens) toward the prompt length"),
    "decode_kv_short": (
        "decode KV cache short: preemptions, or a long decode queue",
        "the decode pool's KV cache cannot hold the running batch: sequences are preempted (recomputed) "
        "or wait for blocks",
        "add decode instances, lower --max-num-seqs, give the KV cache more memory "
        "(--kv-cache-memory-gb), or quantize the KV cache"),
    "goodput_low": (
        "goodput far below throughput: few requests meet both the TTFT and the TPOT SLO",
        "the SLOs and the workload mix do not fit this deployment",
        "scale the pool whose SLO fails (TTFT: prefill, TPOT: decode), relax the SLO, or serve the long "
        "prompts on their own deployment"),
    "prefix_cache_miss": (
        "prefix-cache hit rate under 10%",
        "if prompts repeat (system prompts, few-shot examples, multi-turn history): unstable templates "
        "(per-request text such as a date or an id before the shared part) or routing that ignores the "
        "cache; prompts that never repeat miss by nature (then --ignore prefix_cache_miss)",
        "keep the shared part first and byte-identical; route by prefix (--prefill-routing kv)"),
    "pool_ratio_mismatch": (
        "pools scaled out of proportion to the input/output token work",
        "one pool is overloaded while the other idles: the prefill:decode instance ratio does not match "
        "the work of the input and output tokens",
        "move instances to the overloaded pool (see the suggested --pools)"),
    "cancel_leak": (
        "cancelled requests whose KV blocks were not returned: leak suspected",
        "blocks of aborted requests (client disconnects) stay allocated on an idle worker",
        "report it with /epd/workers' output; restarting the worker frees its cache"),
}

STATUSES = ("symptom", "ok", "not_applicable", "not_evaluated")


class MetricsError(RuntimeError):
    """The server's ``/metrics`` could not be read or is not an epd server's."""


# ---- scrapes and windows --------------------------------------------------------------------
Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True, slots=True)
class Scrape:
    """One read of ``/metrics``: ``samples[sample name] = [(labels, value), ...]``;
    ``t``: when it was read, ``time.monotonic()`` seconds."""

    t: float
    samples: Samples

    def series(self, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
        """Samples of ``name`` whose labels include ``match``."""
        return [(lb, v) for lb, v in self.samples.get(name, ()) if all(lb.get(k) == x for k, x in match.items())]

    def total(self, name: str, **match: str) -> float:
        return sum(v for _, v in self.series(name, **match))


def parse_metrics(text: str, t: float = 0.0) -> Scrape:
    """Prometheus text exposition -> :class:`Scrape` (prometheus-client's parser).

    Raises:
        MetricsError: the text does not parse, or holds no ``epd_`` sample.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = defaultdict(list)
    families = set()
    try:
        for family in text_string_to_metric_families(text):
            families.add(family.name)
            for s in family.samples:
                samples[s.name].append((dict(s.labels), float(s.value)))
    except ValueError as e:
        raise MetricsError(f"not Prometheus text ({e})") from None
    if not any(name.startswith("epd_") for name in families):  # a fresh server declares them, unobserved
        raise MetricsError("no epd_ metric in it: is this an epd server?")
    return Scrape(t, dict(samples))


def _delta(start: Scrape, end: Scrape, name: str, **match: str) -> float:
    """Sum over the series of counter-like ``name`` of end - start; a series new since
    ``start`` starts at 0, one that went down was reset (a restarted process) and counts
    from 0. A series absent from ``end`` contributes nothing."""
    before = {_key(lb): v for lb, v in start.series(name, **match)}
    total = 0.0
    for lb, v in end.series(name, **match):
        v0 = before.get(_key(lb), 0.0)
        total += v - v0 if v >= v0 else v
    return total


def _key(labels: dict[str, str]) -> tuple:
    return tuple(sorted(labels.items()))


@dataclass(frozen=True, slots=True)
class HistogramWindow:
    """The observations of one histogram family in one pool over a window (instances summed).

    ``bounds``: bucket upper bounds in the metric's unit (seconds here), ascending, the
    last ``inf``; ``cumulative[i]``: observations <= ``bounds[i]``; ``sum``: their sum;
    ``count``: how many.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float
    count: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1), linearly interpolated inside its bucket (PromQL's
        ``histogram_quantile``: 0 is the first bucket's lower edge; a quantile that falls in
        the ``+Inf`` bucket is the largest finite bound). NaN without observations."""
        if not self.count:
            return math.nan
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative):
            if cum >= rank and cum > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cum - below)
            lower, below = (bound if not math.isinf(bound) else lower), cum
        return lower

    def fraction_le(self, x: float) -> float:
        """Fraction of the observations <= ``x`` (linear inside a bucket), 0..1; NaN without any."""
        if not self.count:
            return math.nan
        lower, below = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative):
            if x < bound:
                if math.isinf(bound):
                    return below / self.count
                return (below + (cum - below) * (x - lower) / (bound - lower)) / self.count
            lower, below = bound, cum
        return 1.0

    def stats(self, duration_s: float) -> dict[str, float]:
        """count, per_s (observations / s), mean_s, p50_s, p95_s, p99_s."""
        return {"count": self.count, "per_s": self.count / duration_s if duration_s > 0 else math.nan,
                "mean_s": self.mean, "p50_s": self.quantile(0.5), "p95_s": self.quantile(0.95),
                "p99_s": self.quantile(0.99)}


class Window:
    """What happened between two scrapes ``start`` and ``end``; ``gauges``: every scrape of
    the window, in order (``start`` and ``end`` included), for the gauge statistics."""

    def __init__(self, start: Scrape, end: Scrape, gauges: list[Scrape] | None = None) -> None:
        self.start, self.end = start, end
        self.gauges = gauges or [start, end]

    @property
    def duration_s(self) -> float:
        return self.end.t - self.start.t

    def pools(self) -> list[str]:
        """Every ``pool`` label of an ``epd_`` sample at the end, in report order."""
        found = {lb["pool"] for name, ss in self.end.samples.items() if name.startswith("epd_")
                 for lb, _ in ss if "pool" in lb and name != POOL_INSTANCES}
        found |= {lb["pool"] for lb, v in self.end.series(POOL_INSTANCES, state="live") if v > 0}
        order = {p: i for i, p in enumerate(POOL_ORDER)}
        return sorted(found, key=lambda p: (order.get(p, len(order)), p))

    def has_pool(self, pool: str) -> bool:
        return pool in self.pools()

    def instances(self, pool: str) -> int:
        """Live instances of ``pool``: the router's ``epd_pool_instances{state="live"}``, else
        the distinct ``instance`` labels of the pool's gauges."""
        live = self.end.series(POOL_INSTANCES, pool=pool, state="live")
        if live and max(v for _, v in live) > 0:
            return int(max(v for _, v in live))
        return len({lb["instance"] for name in (KV_USAGE, QUEUE_DEPTH, RUNNING)
                    for lb, _ in self.end.series(name, pool=pool)})

    def counter(self, name: str, **match: str) -> float:
        """Increase of counter ``name`` (``..._total``) over the window; 0 when never incremented
        (a labelled counter has no series before its first increment)."""
        return _delta(self.start, self.end, name, **match)

    def histogram(self, family: str, pool: str) -> HistogramWindow | None:
        """Bucket deltas of ``family`` in ``pool`` over the window; None when the pool has no
        series of it at the end (never observed there)."""
        end_buckets = self.end.series(family + "_bucket", pool=pool)
        if not end_buckets:
            return None
        per_bound: dict[float, float] = defaultdict(float)
        for lb, _ in end_buckets:
            le = lb.get("le")
            if le is not None:
                per_bound[float(le)] += _delta(self.start, self.end, family + "_bucket", **lb)
        bounds = tuple(sorted(per_bound))
        return HistogramWindow(bounds, tuple(per_bound[b] for b in bounds),
                               _delta(self.start, self.end, family + "_sum", pool=pool),
                               _delta(self.start, self.end, family + "_count", pool=pool))

    def gauge(self, name: str, pool: str, **match: str) -> dict[str, list[float]]:
        """Samples of gauge ``name`` over the window, per instance of ``pool``."""
        out: dict[str, list[float]] = defaultdict(list)
        for s in self.gauges:
            for lb, v in s.series(name, pool=pool, **match):
                out[lb.get("instance", "")].append(v)
        return dict(out)

    def gauge_stats(self, name: str, pool: str) -> dict[str, float] | None:
        """``mean``: mean over the samples and instances; ``max``: the largest sample of any
        instance; ``mean_total``: mean over the samples of the pool's sum. None when the pool
        never reported ``name``."""
        per = self.gauge(name, pool)
        if not per:
            return None
        values = [v for vs in per.values() for v in vs]
        totals = [sum(v for _, v in ss) for s in self.gauges if (ss := s.series(name, pool=pool))]
        return {"mean": sum(values) / len(values), "max": max(values), "mean_total": sum(totals) / len(totals)}


# ---- checks ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Check:
    """The outcome of one symptom check for one pool (``pool`` None: the deployment).

    ``status``: one of :data:`STATUSES`; ``detail``: the evidence (or why it was not
    evaluated) in words; ``evidence``: the numbers behind it (seconds, ratios 0..1, counts)."""

    id: str
    status: str
    pool: str | None = None
    detail: str = ""
    evidence: dict[str, float | str] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["evidence"] = {k: _clean(v) for k, v in self.evidence.items()}
        if self.status == "symptom":
            d["title"], d["cause"], d["fix"] = SYMPTOMS[self.id]
        return d


@dataclass(frozen=True, slots=True)
class Settings:
    """SLOs of the goodput check, seconds."""

    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S


def _too_few(family: str, h: HistogramWindow | None, need: int, pool: str) -> str | None:
    """Why ``h`` cannot be judged (missing or fewer than ``need`` observations), else None."""
    if h is None:
        return f"{family} has no series in pool {pool}"
    if h.count < need:
        return f"{family}{{pool={pool}}}: {h.count:.0f} observations in the window, need {need}"
    return None


def _ms(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 1.0:
        return f"{x:.2f}s"
    if x >= 0.0095:
        return f"{x * 1000:.0f}ms"
    return f"{x * 1000:.1f}ms"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _pc(x: float) -> str:
    """A fraction 0..1 as a percentage, one decimal under 10%."""
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def _spikes(h: HistogramWindow) -> tuple[float, float, float]:
    """(threshold s, observations above it, their estimated total s) of ``h``: threshold =
    max(SPIKE_MIN_S, SPIKE_RATIO x p50); each observation above it counts as its bucket's
    middle (the +Inf bucket's as its lower edge), the part of a bucket above the threshold
    in proportion."""
    threshold = max(SPIKE_MIN_S, SPIKE_RATIO * h.quantile(0.5))
    count = total = lower = below = 0.0
    for bound, cum in zip(h.bounds, h.cumulative):
        n = cum - below
        if n > 0 and bound > threshold:
            if math.isinf(bound):
                count, total = count + n, total + n * max(lower, threshold)
            else:
                lo = max(lower, threshold)
                part = n * (bound - lo) / (bound - lower)
                count, total = count + part, total + part * (lo + bound) / 2
        lower, below = (lower if math.isinf(bound) else bound), cum
    return threshold, count, total


def _itl_spiky(h: HistogramWindow) -> bool:
    _, n, t = _spikes(h)
    return n >= SPIKE_MIN_COUNT and t >= SPIKE_TIME_SHARE * h.sum


def _step_spiky(h: HistogramWindow) -> bool:
    return _spikes(h)[1] >= SPIKE_MIN_COUNT


def _spike_words(h: HistogramWindow, what: str) -> str:
    threshold, n, t = _spikes(h)
    share = f", {t / h.sum:.0%} of their time" if h.sum > 0 else ""
    return f"{n:.0f} of {h.count:.0f} {what} over {_ms(threshold)} (p50 {_ms(h.quantile(0.5))}){share}"


def check_prefill_steals_decode(w: Window, s: Settings) -> list[Check]:
    """Aggregated pool: ITL spikes (gaps over max(SPIKE_MIN_S, SPIKE_RATIO x p50): at least
    SPIKE_MIN_COUNT of them, holding SPIKE_TIME_SHARE of the ITL time) and pd decode steps as
    long (at least SPIKE_MIN_COUNT): some steps carry prefill chunks and stall every stream."""
    cid = "prefill_steals_decode"
    if not w.has_pool("pd"):
        return [Check(cid, "not_applicable", detail="no aggregated (pd) pool")]
    itl, step = w.histogram(ITL, "api"), w.histogram(DECODE_STEP, "pd")
    why = _too_few(ITL, itl, MIN_STEPS, "api") or _too_few(DECODE_STEP, step, MIN_STEPS, "pd")
    if why:
        return [Check(cid, "not_evaluated", "pd", why)]
    threshold, n, t = _spikes(itl)
    ev = {"itl_p50_s": itl.quantile(0.5), "itl_p99_s": itl.quantile(0.99), "itl_spikes": n,
          "itl_spike_threshold_s": threshold, "itl_spike_time_share": t / itl.sum if itl.sum else 0.0,
          "step_p50_s": step.quantile(0.5), "step_p99_s": step.quantile(0.99), "step_spikes": _spikes(step)[1]}
    routed = w.counter(ROUTED, pool="pd")
    if routed:
        ev["prompt_tokens_per_request"] = w.counter(PREFIX_QUERIES, pool="pd") / routed
    detail = f"{_spike_words(itl, 'ITL gaps')}; {_spike_words(step, 'pd decode steps')}"
    fired = _itl_spiky(itl) and _step_spiky(step)
    return [Check(cid, "symptom" if fired else "ok", "pd", detail, ev)]


def check_prefill_queue(w: Window, s: Settings) -> list[Check]:
    """Prefill pool: queue mean >= QUEUE_DOMINANCE_RATIO x execution mean, >= PREFILL_QUEUE_MIN_S
    and >= QUEUE_SHARE_OF_TTFT x TTFT mean. Then ``prefill_budget_small`` when the instances
    prefill fewer than PREFILL_CONCURRENCY_MIN requests at once (execution seconds / window /
    instances), else ``prefill_queue_dominates_ttft``."""
    ids = ("prefill_queue_dominates_ttft", "prefill_budget_small")
    if not w.has_pool("prefill"):
        return [Check(i, "not_applicable", detail="no prefill pool (an aggregated pool exports no prefill queue)")
                for i in ids]
    q, x, ttft = w.histogram(PREFILL_QUEUE, "prefill"), w.histogram(PREFILL, "prefill"), w.histogram(TTFT, "api")
    why = (_too_few(PREFILL_QUEUE, q, MIN_REQUESTS, "prefill") or _too_few(PREFILL, x, MIN_REQUESTS, "prefill")
           or _too_few(TTFT, ttft, MIN_REQUESTS, "api"))
    if why:
        return [Check(i, "not_evaluated", "prefill", why) for i in ids]
    n = max(1, w.instances("prefill"))
    concurrency = x.sum / w.duration_s / n
    ev = {"queue_mean_s": q.mean, "queue_p95_s": q.quantile(0.95), "prefill_mean_s": x.mean,
          "ttft_mean_s": ttft.mean, "ttft_p95_s": ttft.quantile(0.95), "instances": n,
          "prefilling_per_instance": concurrency}
    tpot = w.histogram(TPOT, "api")
    if tpot is not None and tpot.count:
        ev["tpot_p95_s"] = tpot.quantile(0.95)
    routed = w.counter(ROUTED, pool="prefill")
    if routed:
        ev["prompt_tokens_per_request"] = w.counter(PREFIX_QUERIES, pool="prefill") / routed
    detail = (f"prefill queue mean {_ms(q.mean)} vs prefill execution mean {_ms(x.mean)}, TTFT mean "
              f"{_ms(ttft.mean)}; {concurrency:.2f} requests in prefill at once per instance ({n} instance(s))")
    dominated = (q.mean >= QUEUE_DOMINANCE_RATIO * x.mean and q.mean >= PREFILL_QUEUE_MIN_S
                 and q.mean >= QUEUE_SHARE_OF_TTFT * ttft.mean)
    under_used = concurrency < PREFILL_CONCURRENCY_MIN
    if dominated and not under_used:
        detail += f"; try --pools p:{n + 1},..."
    if dominated and under_used and concurrency < 0.5:
        detail += (" (the engine computes less than half the time: requests may also wait for KV staging room "
                   "or decode reservations)")
    return [Check(ids[0], "symptom" if dominated and not under_used else "ok", "prefill", detail, ev),
            Check(ids[1], "symptom" if dominated and under_used else "ok", "prefill", detail, dict(ev))]


def check_decode_tpot_jitter(w: Window, s: Settings) -> list[Check]:
    """Decode pool: ITL spikes (as in ``prefill_steals_decode``) while TTFT p95 <= the TTFT SLO,
    and decode steps vary (at least SPIKE_MIN_COUNT spiky steps, or step p95 above the TPOT
    SLO) or the KV cache is nearly full (max usage >= KV_USAGE_HIGH)."""
    cid = "decode_tpot_jitter"
    if not w.has_pool("decode"):
        return [Check(cid, "not_applicable", detail="no decode pool (aggregated pools: prefill_steals_decode)")]
    itl, step, ttft = w.histogram(ITL, "api"), w.histogram(DECODE_STEP, "decode"), w.histogram(TTFT, "api")
    why = (_too_few(ITL, itl, MIN_STEPS, "api") or _too_few(DECODE_STEP, step, MIN_STEPS, "decode")
           or _too_few(TTFT, ttft, MIN_REQUESTS, "api"))
    if why:
        return [Check(cid, "not_evaluated", "decode", why)]
    kv = w.gauge_stats(KV_USAGE, "decode")
    ev = {"itl_p50_s": itl.quantile(0.5), "itl_p99_s": itl.quantile(0.99), "itl_spikes": _spikes(itl)[1],
          "step_p50_s": step.quantile(0.5), "step_p95_s": step.quantile(0.95), "step_p99_s": step.quantile(0.99),
          "step_spikes": _spikes(step)[1], "ttft_p95_s": ttft.quantile(0.95), "ttft_slo_s": s.ttft_slo_s}
    if kv is not None:
        ev["kv_usage_max"] = kv["max"]
    detail = (f"{_spike_words(itl, 'ITL gaps')}; {_spike_words(step, 'decode steps')}, p95 "
              f"{_ms(ev['step_p95_s'])}; TTFT p95 {_ms(ev['ttft_p95_s'])}"
              + (f"; KV usage max {_pc(kv['max'])}" if kv else ""))
    jitter = _itl_spiky(itl)
    ttft_fine = ev["ttft_p95_s"] <= s.ttft_slo_s
    step_cause = _step_spiky(step) or ev["step_p95_s"] > s.tpot_slo_s
    kv_cause = kv is not None and kv["max"] >= KV_USAGE_HIGH
    fired = jitter and ttft_fine and (step_cause or kv_cause)
    if jitter and not ttft_fine:
        detail += " (TTFT is high too: see the prefill checks)"
    elif jitter and not fired:
        detail += " (not explained by decode steps or KV usage: look at the API host and the network)"
    return [Check(cid, "symptom" if fired else "ok", "decode", detail, ev)]


def check_kv_transfer(w: Window, s: Settings) -> list[Check]:
    """Prefill pool: KV transfers failed or were retried in the window; or KV transfer p99 >=
    KV_TRANSFER_P99_S and >= KV_TRANSFER_OVER_PREFILL x prefill execution p99."""
    cid = "kv_transfer_slow"
    if not w.has_pool("prefill"):
        return [Check(cid, "not_applicable", detail="no prefill pool: no P->D transfer")]
    failures, retries = w.counter(KV_FAILURES), w.counter(KV_RETRIES)
    kt, x = w.histogram(KV_TRANSFER, "prefill"), w.histogram(PREFILL, "prefill")
    ev: dict[str, float | str] = {"failures": failures, "retries": retries}
    if failures or retries:
        return [Check(cid, "symptom", "prefill", f"{failures:.0f} KV transfers failed, {retries:.0f} retried "
                      "in the window", ev)]
    why = _too_few(KV_TRANSFER, kt, MIN_REQUESTS, "prefill") or _too_few(PREFILL, x, MIN_REQUESTS, "prefill")
    if why:
        return [Check(cid, "not_evaluated", "prefill", why, ev)]
    nbytes = w.counter(KV_BYTES, pool="prefill")
    ev.update({"p50_s": kt.quantile(0.5), "p99_s": kt.quantile(0.99), "prefill_p99_s": x.quantile(0.99),
               "bytes_per_request": nbytes / kt.count})
    if ops := w.counter(KV_OPS, pool="prefill"):
        ev["nixl_ops_per_transfer"] = ops / kt.count  # layers (x TP ranks with per-rank agents)
    if kt.sum > 0:
        ev["effective_gb_per_s"] = nbytes / kt.sum / 1e9  # a lower bound: the time overlaps compute
    fired = ev["p99_s"] >= KV_TRANSFER_P99_S and ev["p99_s"] >= KV_TRANSFER_OVER_PREFILL * ev["prefill_p99_s"]
    detail = (f"KV transfer p50/p99 {_ms(ev['p50_s'])}/{_ms(ev['p99_s'])} vs prefill execution p99 "
              f"{_ms(ev['prefill_p99_s'])}; {_bytes(ev['bytes_per_request'])} per request")
    return [Check(cid, "symptom" if fired else "ok", "prefill", detail, ev)]


def _decode_kv_evidence(w: Window, pool: str) -> tuple[bool, str | None, str, dict]:
    """(short, why-not-evaluated, detail, evidence) of the KV-shortage test of ``pool``."""
    preempt, routed = w.counter(PREEMPTIONS, pool=pool), w.counter(ROUTED, pool=pool)
    kv, waiting = w.gauge_stats(KV_USAGE, pool), w.gauge_stats(QUEUE_DEPTH, pool)
    dq = w.histogram(DECODE_QUEUE, pool) if pool == "decode" else None
    ev: dict[str, float | str] = {"preemptions": preempt, "requests": routed}
    parts = [f"{preempt:.0f} preemptions in {routed:.0f} requests"]
    preempted = preempt >= max(PREEMPTIONS_MIN, PREEMPTION_FRACTION * routed)
    queued = False
    if dq is not None and dq.count >= MIN_REQUESTS:
        ev["decode_queue_p95_s"] = dq.quantile(0.95)
        parts.append(f"decode queue p95 {_ms(ev['decode_queue_p95_s'])}")
        queued = ev["decode_queue_p95_s"] >= DECODE_QUEUE_HIGH_S
    full = False
    if kv is not None:
        ev["kv_usage_mean"], ev["kv_usage_max"] = kv["mean"], kv["max"]
        parts.append(f"KV usage mean/max {_pc(kv['mean'])}/{_pc(kv['max'])}")
        if waiting is not None:
            per_instance = waiting["mean_total"] / max(1, w.instances(pool))
            ev["waiting_per_instance_mean"] = per_instance
            parts.append(f"{per_instance:.1f} waiting per instance")
            full = kv["max"] >= KV_USAGE_HIGH and per_instance >= DECODE_WAITING_MIN
    short = preempted or queued or full
    why = None
    if not short and routed < MIN_REQUESTS and (dq is None or dq.count < MIN_REQUESTS):
        why = f"{routed:.0f} requests routed to pool {pool} in the window, need {MIN_REQUESTS}"
    return short, why, "; ".join(parts), ev


def check_decode_kv_short(w: Window, s: Settings) -> list[Check]:
    """Decode and pd pools: preemptions >= max(PREEMPTIONS_MIN, PREEMPTION_FRACTION x requests),
    or decode queue p95 >= DECODE_QUEUE_HIGH_S, or KV usage >= KV_USAGE_HIGH with
    >= DECODE_WAITING_MIN requests waiting per instance."""
    cid = "decode_kv_short"
    pools = [p for p in ("decode", "pd") if w.has_pool(p)]
    if not pools:
        return [Check(cid, "not_applicable", detail="no decode or pd pool")]
    out = []
    for pool in pools:
        short, why, detail, ev = _decode_kv_evidence(w, pool)
        out.append(Check(cid, "not_evaluated", pool, why, ev) if why else
                   Check(cid, "symptom" if short else "ok", pool, detail, ev))
    return out


def check_goodput(w: Window, s: Settings) -> list[Check]:
    """API: the share of requests that can have met both SLOs is at most min(TTFT attainment,
    TPOT attainment) (and at least their sum - 1); below GOODPUT_MIN_FRACTION: far below."""
    cid = "goodput_low"
    ttft, tpot, e2e = w.histogram(TTFT, "api"), w.histogram(TPOT, "api"), w.histogram(E2E, "api")
    why = _too_few(TTFT, ttft, MIN_REQUESTS, "api") or _too_few(TPOT, tpot, MIN_REQUESTS, "api")
    if why:
        return [Check(cid, "not_evaluated", "api", why)]
    a, b = ttft.fraction_le(s.ttft_slo_s), tpot.fraction_le(s.tpot_slo_s)
    upper, lower = min(a, b), max(0.0, a + b - 1.0)
    rate = (e2e.count if e2e is not None else ttft.count) / w.duration_s
    ev = {"ttft_slo_s": s.ttft_slo_s, "tpot_slo_s": s.tpot_slo_s, "ttft_attainment": a, "tpot_attainment": b,
          "goodput_fraction_max": upper, "goodput_fraction_min": lower, "throughput_per_s": rate,
          "goodput_per_s_max": upper * rate}
    detail = (f"{a:.0%} of requests meet TTFT <= {s.ttft_slo_s:g}s, {b:.0%} meet TPOT <= {s.tpot_slo_s:g}s: "
              f"goodput {lower * rate:.2f}..{upper * rate:.2f} of {rate:.2f} req/s")
    return [Check(cid, "symptom" if upper < GOODPUT_MIN_FRACTION else "ok", "api", detail, ev)]


def _policies(w: Window, pool: str) -> list[str]:
    """Routing policies the router used for ``pool`` in the window."""
    return sorted({lb.get("policy", "?") for lb, _ in w.end.series(ROUTED, pool=pool)
                   if _delta(w.start, w.end, ROUTED, **lb) > 0})


def check_prefix_cache(w: Window, s: Settings) -> list[Check]:
    """Prefill and pd pools: prefix-cache hit rate < PREFIX_HIT_RATE_MIN over at least
    PREFIX_MIN_QUERY_TOKENS looked-up prompt tokens."""
    cid = "prefix_cache_miss"
    pools = [p for p in ("prefill", "pd") if w.has_pool(p)]
    if not pools:
        return [Check(cid, "not_applicable", detail="no prefill or pd pool")]
    out = []
    for pool in pools:
        queries, hits = w.counter(PREFIX_QUERIES, pool=pool), w.counter(PREFIX_HITS, pool=pool)
        if queries < PREFIX_MIN_QUERY_TOKENS:
            out.append(Check(cid, "not_evaluated", pool, f"{queries:.0f} prompt tokens looked up in the prefix "
                             f"cache in the window, need {PREFIX_MIN_QUERY_TOKENS} (0 also when the engine runs without prefix caching)"))
            continue
        rate, policies, n = hits / queries, _policies(w, pool), w.instances(pool)
        ev = {"hit_rate": rate, "query_tokens": queries, "hit_tokens": hits, "instances": n,
              "routing": ",".join(policies)}
        detail = f"{rate:.1%} of {queries:.0f} prompt tokens hit the cache ({n} instance(s), routing {ev['routing']})"
        if n > 1 and policies and "kv" not in policies:
            detail += "; this routing ignores the cache"
        out.append(Check(cid, "symptom" if rate < PREFIX_HIT_RATE_MIN else "ok", pool, detail, ev))
    return out


def check_pool_ratio(w: Window, s: Settings) -> list[Check]:
    """Prefill + decode pools: one pool overloaded (prefill: the queue test of
    ``prefill_queue_dominates_ttft`` without the TTFT share, and not under-used as in
    ``prefill_budget_small``; decode: the KV-shortage test or TPOT p95 above its SLO) while the
    other is busy at most POOL_IDLE_MAX of the window (prefill: execution seconds, decode: step
    seconds, per instance). The suggested pools split the instances as the work seconds split."""
    cid = "pool_ratio_mismatch"
    if not (w.has_pool("prefill") and w.has_pool("decode")):
        return [Check(cid, "not_applicable", detail="needs a prefill and a decode pool")]
    q, x = w.histogram(PREFILL_QUEUE, "prefill"), w.histogram(PREFILL, "prefill")
    step = w.histogram(DECODE_STEP, "decode")
    why = (_too_few(PREFILL_QUEUE, q, MIN_REQUESTS, "prefill") or _too_few(PREFILL, x, MIN_REQUESTS, "prefill")
           or _too_few(DECODE_STEP, step, MIN_STEPS, "decode"))
    if why:
        return [Check(cid, "not_evaluated", detail=why)]
    n_p, n_d = max(1, w.instances("prefill")), max(1, w.instances("decode"))
    concurrency = x.sum / (w.duration_s * n_p)  # requests in prefill at once (batched prompts overlap)
    util_p, util_d = min(1.0, concurrency), min(1.0, step.sum / (w.duration_s * n_d))
    queueing = q.mean >= PREFILL_QUEUE_MIN_S and q.mean >= QUEUE_DOMINANCE_RATIO * x.mean
    prefill_over = queueing and concurrency >= PREFILL_CONCURRENCY_MIN  # else: prefill_budget_small's
    tpot = w.histogram(TPOT, "api")
    decode_over = _decode_kv_evidence(w, "decode")[0] or (
        tpot is not None and tpot.count >= MIN_REQUESTS and tpot.quantile(0.95) > s.tpot_slo_s)
    prompt_tok = w.counter(PREFIX_QUERIES, pool="prefill")
    itl, ttft = w.histogram(ITL, "api"), w.histogram(TTFT, "api")
    out_tok = (itl.count if itl else 0.0) + (ttft.count if ttft else 0.0)
    ev: dict[str, float | str] = {"prefill_busy": util_p, "decode_busy": util_d, "pools": f"p:{n_p},d:{n_d}",
                                  "prompt_tokens_per_s": prompt_tok / w.duration_s,
                                  "output_tokens_per_s": out_tok / w.duration_s}
    if out_tok:
        ev["input_output_ratio"] = prompt_tok / out_tok
    total = n_p + n_d
    need_p = x.sum / (x.sum + step.sum) if x.sum + step.sum > 0 else 0.5
    fired = (prefill_over and util_d <= POOL_IDLE_MAX) or (decode_over and util_p <= POOL_IDLE_MAX)
    detail = (f"p:{n_p},d:{n_d}: prefill busy {util_p:.0%} per instance{' and queueing' if queueing else ''}"
              f"{' (one prompt at a time: see prefill_budget_small)' if queueing and not prefill_over else ''}, "
              f"decode busy {util_d:.0%}{' and short of KV or over the TPOT SLO' if decode_over else ''}")
    if fired:  # keep the total and move instances toward the work split, else add one
        if prefill_over and util_d <= POOL_IDLE_MAX:
            p = min(total - 1, max(n_p + 1, round(total * need_p))) if n_d > 1 else n_p + 1
            d = total - p if n_d > 1 else n_d
        else:
            d = min(total - 1, max(n_d + 1, round(total * (1 - need_p)))) if n_p > 1 else n_d + 1
            p = total - d if n_p > 1 else n_p
        ev["suggested_pools"] = f"p:{p},d:{d}"
        detail += f"; try --pools p:{p},d:{d}"
    return [Check(cid, "symptom" if fired else "ok", None, detail, ev)]


def check_cancel_leak(w: Window, s: Settings) -> list[Check]:
    """Requests were cancelled in the window and, at its end, nothing is in flight (no open
    router request, nothing running or waiting on any engine instance) yet some engine
    instance still holds KV blocks (usage > 0; cached prefix blocks count as free)."""
    cid = "cancel_leak"
    cancelled = w.counter(CANCELLED)
    if not cancelled:
        return [Check(cid, "not_evaluated", detail=f"no request was cancelled in the window ({CANCELLED})")]
    engines = [p for p in ENGINE_POOLS if w.end.series(KV_USAGE, pool=p)]
    if not engines:
        return [Check(cid, "not_evaluated", detail=f"no engine pool exports {KV_USAGE}")]
    open_requests = w.end.total(ROUTER_REQUESTS)
    busy = sum(w.end.total(name, pool=p) for p in engines for name in (RUNNING, QUEUE_DEPTH))
    ev: dict[str, float | str] = {"cancelled": cancelled, "open_requests": open_requests}
    if open_requests or busy:
        return [Check(cid, "not_evaluated", detail=f"requests still in flight at the end of the window "
                      f"({open_requests:.0f} open in the router, {busy:.0f} running or waiting on workers): "
                      "judged only on an idle server", evidence=ev)]
    held = {lb.get("instance", "?"): v for p in engines for lb, v in w.end.series(KV_USAGE, pool=p) if v > 0}
    ev.update({f"kv_usage[{k}]": v for k, v in held.items()})
    if held:
        detail = (f"{cancelled:.0f} requests cancelled; idle now, yet KV usage is "
                  + ", ".join(f"{k} {v:.1%}" for k, v in sorted(held.items())))
        return [Check(cid, "symptom", None, detail, ev)]
    return [Check(cid, "ok", None, f"{cancelled:.0f} requests cancelled; idle now with every KV block free", ev)]


#: every check, in report order
CHECKS = (check_prefill_steals_decode, check_prefill_queue, check_decode_tpot_jitter, check_kv_transfer,
          check_decode_kv_short, check_goodput, check_prefix_cache, check_pool_ratio, check_cancel_leak)


def evaluate(w: Window, settings: Settings | None = None) -> list[Check]:
    """Run every check of :data:`CHECKS` on ``w``."""
    settings = settings or Settings()
    return [c for check in CHECKS for c in check(w, settings)]


# ---- the per-pool summary ------------------------------------------------------------------------
def summarize(w: Window) -> dict[str, dict]:
    """Per pool: instances, rates (per second), stages (:meth:`HistogramWindow.stats`), gauges
    (:meth:`Window.gauge_stats`), counters over the window, cache hit rates (0..1)."""
    out: dict[str, dict] = {}
    dur = w.duration_s
    for pool in w.pools():
        stages = {}
        for name, family in _stage_families(w.end).items():
            h = w.histogram(family, pool)
            if h is not None:
                stages[name] = h.stats(dur)
        rates: dict[str, float] = {}
        routed = w.counter(ROUTED, pool=pool)
        if routed:
            rates["routed_per_s"] = routed / dur
        if pool == "api":
            if "e2e" in stages:
                rates["requests_per_s"] = stages["e2e"]["count"] / dur
            rates["output_tokens_per_s"] = sum(stages[k]["count"] for k in ("ttft", "itl") if k in stages) / dur
        prompt = w.counter(PREFIX_QUERIES, pool=pool)
        if prompt:
            rates["prompt_tokens_per_s"] = prompt / dur
        nbytes = w.counter(KV_BYTES, pool=pool)
        if nbytes:
            rates["kv_bytes_per_s"] = nbytes / dur
        ops = w.counter(KV_OPS, pool=pool)
        if ops:  # NIXL operations, one per layer (and rank) of a transfer: not requests
            rates["kv_transfer_ops_per_s"] = ops / dur
            transfers = w.histogram(KV_TRANSFER, pool)
            if transfers is not None and transfers.count:
                rates["nixl_ops_per_transfer"] = ops / transfers.count
        step = w.histogram(DECODE_STEP, pool)
        if step is not None and step.count:  # fraction of the window an instance spent in steps, 0..1
            rates["decode_busy"] = min(1.0, step.sum / dur / max(1, w.instances(pool)))
        counters = {k: w.counter(name, pool=pool) for k, name in (
            ("preemptions", PREEMPTIONS), ("cancelled", CANCELLED), ("kv_transfer_failures", KV_FAILURES),
            ("kv_transfer_retries", KV_RETRIES), ("request_retries", "epd_request_retries_total"),
            ("migrated_requests", "epd_migrated_requests_total"), ("worker_failures", "epd_worker_failures_total"))}
        caches = {}
        if prompt:
            caches["prefix_hit_rate"] = w.counter(PREFIX_HITS, pool=pool) / prompt  # hit tokens / looked-up tokens
            caches["prefix_query_tokens"] = prompt
            caches["prefix_hit_tokens"] = w.counter(PREFIX_HITS, pool=pool)
        items = w.counter(ENCODER_QUERIES, pool=pool)
        if items:
            caches["encoder_hit_rate"] = w.counter(ENCODER_HITS, pool=pool) / items
            caches["encoder_queries"] = items
        gauges = {k: g for k, name in (("kv_cache_usage", KV_USAGE), ("queue_depth", QUEUE_DEPTH),
                                       ("running", RUNNING), ("queued_prompt_tokens", "epd_queued_prompt_tokens"))
                  if (g := w.gauge_stats(name, pool)) is not None}
        if pool == "router":
            gauges["open_requests"] = {"last": w.end.total(ROUTER_REQUESTS)}
        out[pool] = {"instances": w.instances(pool) if pool not in ("api", "router") else None,
                     "rates": rates, "stages": stages, "gauges": gauges,
                     "counters": {k: v for k, v in counters.items() if v}, "caches": caches}
    return out


def _stage_families(s: Scrape) -> dict[str, str]:
    """Short stage name -> histogram family: :data:`STAGES` first, then any other epd_ histogram."""
    found = {n[: -len("_bucket")] for n in s.samples if n.startswith("epd_") and n.endswith("_bucket")}
    known = {name: fam for name, fam in STAGES.items() if fam in found}
    extra = {f.removeprefix("epd_").removesuffix("_seconds"): f for f in sorted(found - set(STAGES.values()))}
    return {**known, **extra}


# ---- the report ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Report:
    """Everything ``epd diagnose`` found: ``window_s`` (seconds between the two scrapes),
    ``pools`` (:func:`summarize`), ``checks`` (:func:`evaluate`), ``ignored`` (ids)."""

    url: str
    window_s: float
    scrapes: int
    pools: dict[str, dict]
    checks: list[Check]
    ignored: tuple[str, ...] = ()

    @property
    def symptoms(self) -> list[Check]:
        return [c for c in self.checks if c.status == "symptom" and c.id not in self.ignored]

    @property
    def requests(self) -> float:
        """Requests seen in the window: the most of the API's TTFT and e2e observations and
        of any pool's routing decisions (0: no traffic)."""
        api = self.pools.get("api", {}).get("stages", {})
        seen = [api.get(k, {}).get("count", 0) or 0 for k in ("ttft", "e2e")]
        seen += [p.get("rates", {}).get("routed_per_s", 0) * self.window_s for p in self.pools.values()]
        return float(max(seen, default=0.0))

    @property
    def status(self) -> str:
        """``symptoms``, ``healthy``, ``no_traffic`` or ``too_little_traffic`` (the module docstring)."""
        if self.symptoms:
            return "symptoms"
        if any(c.status in ("ok", "symptom") for c in self.checks):
            return "healthy"
        return "no_traffic" if self.requests < 0.5 else "too_little_traffic"

    @property
    def healthy(self) -> bool:
        """No symptom and something judged: an idle window is not healthy (see :attr:`status`)."""
        return self.status == "healthy"

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 symptoms, 3 nothing judged (no or too little traffic in the window)."""
        return {"healthy": 0, "symptoms": 1}.get(self.status, 3)

    def to_json(self) -> dict:
        return {"url": self.url, "window_s": self.window_s, "scrapes": self.scrapes, "status": self.status,
                "healthy": self.healthy, "requests": self.requests,
                "symptoms": [c.to_json() for c in self.symptoms],
                "checks": [c.to_json() for c in self.checks], "ignored": list(self.ignored),
                "not_evaluated": [{"id": c.id, "pool": c.pool, "reason": c.detail} for c in self.checks
                                  if c.status == "not_evaluated"],
                "pools": _clean(self.pools)}

    def format_text(self) -> str:
        """The human report: stage table, pool table, symptoms, then what was fine or not judged."""
        lines = [f"epd diagnose {self.url}: {self.window_s:.1f} s window, {self.scrapes} scrapes", ""]
        lines += _stage_table(self.pools) + [""] + _pool_table(self.pools) + [""]
        if self.symptoms:
            lines.append(f"SYMPTOMS ({len(self.symptoms)})")
            for c in self.symptoms:
                title, cause, fix = SYMPTOMS[c.id]
                lines += [f"  [{c.id}]{' ' + c.pool if c.pool else ''}: {title}", f"    evidence: {c.detail}",
                          f"    cause:    {cause}", f"    fix:      {fix}"]
            lines.append("")
        for status, head in (("ok", "OK"), ("not_evaluated", "NOT EVALUATED"), ("not_applicable", "NOT APPLICABLE")):
            group = [c for c in self.checks if c.status == status or (
                status == "ok" and c.status == "symptom" and c.id in self.ignored)]
            if not group:
                continue
            lines.append(head)
            for c in group:
                tag = f"{c.id}{' (' + c.pool + ')' if c.pool else ''}"
                note = " [ignored symptom]" if c.status == "symptom" else ""
                lines.append(f"  {tag}: {c.detail}{note}")
        verdict = {"healthy": "healthy: no symptom found",
                   "symptoms": f"{len(self.symptoms)} symptom(s) found",
                   "no_traffic": f"no traffic in window: no request in {self.window_s:.1f} s, nothing judged "
                                 "(not healthy, not unhealthy: diagnose a window with traffic)",
                   "too_little_traffic": f"too little traffic in window: {self.requests:.0f} request(s) in "
                                         f"{self.window_s:.1f} s, no check had enough to judge (see NOT EVALUATED)"}
        lines += ["", verdict[self.status]]
        return "\n".join(lines)


def _clean(x):
    """JSON-safe: NaN/inf -> None, recursively."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
            for r in rows]


def _stage_table(pools: dict[str, dict]) -> list[str]:
    rows = [["pool", "stage", "count", "/s", "mean", "p50", "p95", "p99"]]
    for pool, p in pools.items():
        for name, st in p["stages"].items():
            if not st["count"]:
                continue
            rows.append([pool, name, f"{st['count']:.0f}", f"{st['per_s']:.2f}", _ms(st["mean_s"]), _ms(st["p50_s"]),
                         _ms(st["p95_s"]), _ms(st["p99_s"])])
    if len(rows) == 1:
        return ["no stage observed in the window (idle server)"]
    return _table(rows, right=set(range(2, 8)))


def _pct(g: dict | None) -> str:
    return "-" if not g else f"{_pc(g['mean'])}/{_pc(g['max'])}"


def _pool_table(pools: dict[str, dict]) -> list[str]:
    rows = [["pool", "inst", "req/s", "prompt tok/s", "out tok/s", "KV mean/max", "queue mean/max", "running",
             "preempt", "prefix hit (tokens)", "cancelled"]]
    for pool, p in pools.items():
        r, g, c, k = p["rates"], p["gauges"], p["counters"], p["caches"]
        req = r.get("requests_per_s", r.get("routed_per_s"))
        queue = g.get("queue_depth")
        hit = (f"{k['prefix_hit_rate']:.0%} of {k['prefix_query_tokens']:.0f} tok" if "prefix_hit_rate" in k else
               f"enc {k['encoder_hit_rate']:.0%}" if "encoder_hit_rate" in k else "-")
        rows.append([pool, "-" if p["instances"] is None else str(p["instances"]),
                     "-" if req is None else f"{req:.2f}",
                     f"{r['prompt_tokens_per_s']:.0f}" if "prompt_tokens_per_s" in r else "-",
                     f"{r['output_tokens_per_s']:.1f}" if "output_tokens_per_s" in r else "-",
                     _pct(g.get("kv_cache_usage")),
                     "-" if not queue else f"{queue['mean_total']:.1f}/{queue['max']:.0f}",
                     f"{g['running']['mean_total']:.1f}" if "running" in g else
                     f"{g['open_requests']['last']:.0f} open" if "open_requests" in g else "-",
                     f"{c.get('preemptions', 0):.0f}" if pool in ENGINE_POOLS else "-", hit,
                     f"{c['cancelled']:.0f}" if "cancelled" in c else "-"])
    return _table(rows, right={1, 2, 3, 4, 7, 8})


# ---- reading the server -------------------------------------------------------------------------
def metrics_url(url: str) -> str:
    """``URL/metrics`` for a server URL given with or without ``/v1`` or ``/metrics``."""
    base = url.rstrip("/")
    for tail in ("/metrics", "/v1"):
        base = base.removesuffix(tail)
    return base + "/metrics"


def scrape(client, url: str) -> Scrape:
    """GET ``url`` (the metrics URL) with ``client`` (an ``httpx.Client``) and parse it.

    Raises:
        MetricsError: unreachable, a non-200 answer, or not epd's metrics.
    """
    import httpx

    try:
        r = client.get(url)
    except httpx.HTTPError as e:
        raise MetricsError(f"cannot read {url}: {type(e).__name__}: {e or 'no answer'}") from None
    if r.status_code != 200:
        raise MetricsError(f"{url} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return parse_metrics(r.text, time.monotonic())
    except MetricsError as e:
        raise MetricsError(f"{url}: {e}") from None


def diagnose(url: str, window_s: float = 60.0, *, interval_s: float = DEFAULT_INTERVAL_S,
             settings: Settings | None = None, ignore: tuple[str, ...] = (), timeout_s: float = 10.0,
             sleep=time.sleep) -> Report:
    """Scrape ``url``'s metrics over ``window_s`` seconds (gauges every ``interval_s``) and
    check every symptom. A suspected ``cancel_leak`` is read again after LEAK_CONFIRM_S.

    Raises:
        MetricsError: the server could not be read (at any of the scrapes).
    """
    import httpx

    target = metrics_url(url)
    with httpx.Client(timeout=timeout_s) as client:
        first = scrape(client, target)
        scrapes = [first]
        deadline = first.t + window_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sleep(min(interval_s, left))
            scrapes.append(scrape(client, target))
        window = Window(first, scrapes[-1], scrapes)
        settings = settings or Settings()
        checks = evaluate(window, settings)
        if any(c.id == "cancel_leak" and c.status == "symptom" for c in checks):
            sleep(LEAK_CONFIRM_S)
            scrapes.append(scrape(client, target))
            again = check_cancel_leak(Window(first, scrapes[-1], scrapes), settings)
            checks = [c for c in checks if c.id != "cancel_leak"] + again
    return Report(url, window.duration_s, len(scrapes), summarize(window), checks, tuple(ignore))


# ---- command line ------------------------------------------------------------------------------
def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``diagnose`` subcommand to an ``argparse`` sub-parser set."""
    from epd.cli import validators

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
    try:
        report = diagnose(args.url, args.window, interval_s=args.interval,
                          settings=Settings(args.ttft_slo, args.tpot_slo), ignore=tuple(args.ignore),
                          timeout_s=args.timeout)
    except MetricsError as e:
        return _unreadable(args, str(e))
    except Exception as e:  # noqa: BLE001 - never exit 1 (a symptom) for a failure of our own
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
