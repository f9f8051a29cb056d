"""Reading epd's Prometheus ``/metrics`` and the arithmetic of a window between two reads.

:func:`scrape` GETs and parses one read (:class:`Scrape`); a :class:`Window` is what
happened between two of them: counter increases (a series new since the first read counts
from 0, one that went down was reset and counts from 0), per-pool histograms of the bucket
deltas (:class:`HistogramWindow`: count, mean, quantiles interpolated inside a bucket as
PromQL's ``histogram_quantile``), and gauge statistics over the reads in between.
``epd diagnose`` and ``epd plan`` both read servers with it.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

from epd.metrics import KV_USAGE, POOL_INSTANCES, QUEUE_DEPTH, RUNNING
from epd.roles import ROLE_NAMES, Role

__all__ = ["ENGINE_POOLS", "POOL_ORDER", "HistogramWindow", "MetricsError", "Samples", "Scrape", "Window", "delta",
           "metrics_url", "parse_metrics", "scrape"]

#: pools in report order (others follow alphabetically): the API's and the router's, then the roles
POOL_ORDER = ("api", "router", *ROLE_NAMES)
#: pools whose workers run an engine (a KV cache, a running batch, preemptions)
ENGINE_POOLS = (Role.PREFILL, Role.DECODE, Role.PD)


class MetricsError(RuntimeError):
    """The server's ``/metrics`` could not be read or is not an epd server's."""


#: sample name -> [(labels, value), ...] of one read
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
        """Sum of the values of :meth:`series`."""
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


def delta(start: Scrape, end: Scrape, name: str, **match: str) -> float:
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
        return delta(self.start, self.end, name, **match)

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
                per_bound[float(le)] += delta(self.start, self.end, family + "_bucket", **lb)
        bounds = tuple(sorted(per_bound))
        return HistogramWindow(bounds, tuple(per_bound[b] for b in bounds),
                               delta(self.start, self.end, family + "_sum", pool=pool),
                               delta(self.start, self.end, family + "_count", pool=pool))

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

