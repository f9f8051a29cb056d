"""``epd diagnose`` on synthetic /metrics: every symptom check fires on its pattern and stays
quiet on a healthy one; quantiles from bucket deltas; counter resets; the command line
(exit codes 0 / 1 / 2, ``--json``) against a small HTTP server serving saved metric text.

The synthetic metrics are epd's own families (names, labels, buckets from epd/metrics.py),
registered in a private prometheus-client registry; a scenario observes values between two
renders, so each check sees exactly the histogram deltas the test built."""

from __future__ import annotations

import http.server
import json
import math
import subprocess
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from epd import metrics as em
from epd.ops import diagnose as dg
from epd.ops.diagnose import thresholds
from epd.ops.scrape import ENGINE_POOLS

WINDOW_S = 10.0


class FakeEpd:
    """epd's metric families in a private registry: observe / inc / set, then :meth:`scrape`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.h = {name: Histogram(name, doc, em.LABELS, buckets=b, registry=self.registry)
                  for name, doc, b in em._HISTOGRAMS.values()}
        self.c = {name + "_total": Counter(name, doc, em.LABELS, registry=self.registry)
                  for name, doc in em._COUNTERS.values()}
        self.c |= {name + "_total": Counter(name, doc, (*em.LABELS, *extra), registry=self.registry)
                   for name, doc, extra in em._LABELLED_COUNTERS.values()}
        self.g = {name: Gauge(name, doc, em.LABELS, registry=self.registry) for name, doc, _ in em._GAUGES.values()}
        self.g["epd_router_requests"] = Gauge("epd_router_requests", "r", (*em.LABELS, "state"), registry=self.registry)
        self.g["epd_pool_instances"] = Gauge("epd_pool_instances", "i", ("pool", "state"), registry=self.registry)

    def observe(self, family: str, pool: str, values, instance: str | None = None) -> None:
        child = self.h[family].labels(pool=pool, instance=instance or _instance(pool))
        for v in values:
            child.observe(v)

    def inc(self, name: str, pool: str, value: float, instance: str | None = None, **extra: str) -> None:
        self.c[name].labels(pool=pool, instance=instance or _instance(pool), **extra).inc(value)

    def set(self, name: str, pool: str, value: float, instance: str | None = None) -> None:
        self.g[name].labels(pool=pool, instance=instance or _instance(pool)).set(value)

    def pools(self, **counts: int) -> None:
        """Deploy pools: the router's live-instance gauge and idle engine gauges per instance."""
        for pool, n in counts.items():
            self.g["epd_pool_instances"].labels(pool=pool, state="live").set(n)
            if pool in ENGINE_POOLS:
                for i in range(n):
                    for g in (em.KV_USAGE, em.QUEUE_DEPTH, em.RUNNING):
                        self.set(g, pool, 0.0, instance=f"{pool}-{i}")

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def scrape(self, t: float) -> dg.Scrape:
        return dg.parse_metrics(self.text(), t)


def _instance(pool: str) -> str:
    return pool if pool in ("api", "router") else f"{pool}-0"


def _window(f: FakeEpd, scenario, gauge_samples: int = 3) -> dg.Window:
    """Scrape, run ``scenario(f)`` (the window's traffic), scrape ``gauge_samples`` more times."""
    start = f.scrape(0.0)
    scenario(f)
    scrapes = [start] + [f.scrape(WINDOW_S * (i + 1) / gauge_samples) for i in range(gauge_samples)]
    return dg.Window(start, scrapes[-1], scrapes)


def _status(w: dg.Window, cid: str, pool: str | None = "any", settings: dg.Settings | None = None) -> str:
    got = [c for c in dg.evaluate(w, settings) if c.id == cid and (pool == "any" or c.pool == pool)]
    assert len(got) == 1, got
    return got[0].status


def _requests(f: FakeEpd, n: int, ttft: float = 0.2, tpot: float = 0.02, e2e: float = 1.0, itl=None,
              tokens: int = 20) -> None:
    """``n`` requests seen by the API: TTFT, TPOT, e2e each, and ``tokens - 1`` ITL gaps."""
    f.observe(em.TTFT, "api", [ttft] * n)
    f.observe(em.TPOT, "api", [tpot] * n)
    f.observe(em.E2E, "api", [e2e] * n)
    f.observe(em.ITL, "api", itl if itl is not None else [tpot] * (n * (tokens - 1)))


# ---- histograms, counters, parsing -------------------------------------------------------------------
SAVED = """\
# HELP epd_prefill_seconds Prefill compute of one request, seconds
# TYPE epd_prefill_seconds histogram
epd_prefill_seconds_bucket{instance="prefill-0",le="0.1",pool="prefill"} 50.0
epd_prefill_seconds_bucket{instance="prefill-0",le="0.2",pool="prefill"} 100.0
epd_prefill_seconds_bucket{instance="prefill-0",le="+Inf",pool="prefill"} 100.0
epd_prefill_seconds_count{instance="prefill-0",pool="prefill"} 100.0
epd_prefill_seconds_sum{instance="prefill-0",pool="prefill"} 12.5
epd_prefill_seconds_bucket{instance="prefill-1",le="0.1",pool="prefill"} 0.0
epd_prefill_seconds_bucket{instance="prefill-1",le="0.2",pool="prefill"} 0.0
epd_prefill_seconds_bucket{instance="prefill-1",le="+Inf",pool="prefill"} 100.0
epd_prefill_seconds_count{instance="prefill-1",pool="prefill"} 100.0
epd_prefill_seconds_sum{instance="prefill-1",pool="prefill"} 100.0
# HELP epd_preemptions_total Sequences preempted
# TYPE epd_preemptions_total counter
epd_preemptions_total{instance="decode-0",pool="decode"} 5.0
"""


def test_quantiles_interpolate_inside_buckets_and_sum_instances():
    empty = dg.parse_metrics("# TYPE epd_x gauge\nepd_x 1\n", 0.0)
    w = dg.Window(empty, dg.parse_metrics(SAVED, 10.0))
    one = dg.Window(empty, dg.parse_metrics(SAVED.split("epd_prefill_seconds_bucket{instance=\"prefill-1\"")[0], 10.0))
    h = one.histogram(em.PREFILL, "prefill")
    assert h.count == 100 and h.sum == 12.5 and h.mean == 0.125
    assert h.quantile(0.5) == pytest.approx(0.1)
    assert h.quantile(0.25) == pytest.approx(0.05)  # first bucket: from 0
    assert h.quantile(0.75) == pytest.approx(0.15)
    assert h.fraction_le(0.15) == pytest.approx(0.75) and h.fraction_le(5.0) == 1.0
    both = w.histogram(em.PREFILL, "prefill")  # the two instances summed
    assert both.count == 200 and both.cumulative == (50.0, 100.0, 200.0)
    assert both.quantile(0.99) == 0.2  # in the +Inf bucket: the largest finite bound
    assert both.fraction_le(0.2) == pytest.approx(0.5)
    assert w.histogram(em.DECODE_STEP, "decode") is None
    assert math.isnan(dg.HistogramWindow((0.1, math.inf), (0.0, 0.0), 0.0, 0.0).quantile(0.5))


def test_counter_deltas_new_series_and_resets():
    start = dg.parse_metrics(SAVED, 0.0)
    reset = SAVED.replace('pool="decode"} 5.0', 'pool="decode"} 2.0') + \
        'epd_preemptions_total{instance="decode-1",pool="decode"} 3.0\n'
    w = dg.Window(start, dg.parse_metrics(reset, 10.0))
    # decode-0 went 5 -> 2: restarted, counts 2; decode-1 is new since the start: counts 3
    assert w.counter(em.PREEMPTIONS, pool="decode") == 5.0
    assert w.counter(em.PREEMPTIONS, pool="pd") == 0.0
    assert w.histogram(em.PREFILL, "prefill").count == 0  # nothing new in the window
    assert w.pools() == ["prefill", "decode"]


def test_not_epd_metrics_is_an_error():
    with pytest.raises(dg.MetricsError, match="no epd_ metric"):
        dg.parse_metrics("# TYPE go_goroutines gauge\ngo_goroutines 7\n")
    with pytest.raises(dg.MetricsError, match="not Prometheus text"):
        dg.parse_metrics("<html>hello</html>\n")


def test_every_metric_diagnose_reads_is_declared_by_epd_metrics():
    declared = {n for n, _, _ in em._HISTOGRAMS.values()} | {n + "_total" for n, _ in em._COUNTERS.values()} | {
        n for n, _, _ in em._GAUGES.values()} | {n + "_total" for n, *_ in em._LABELLED_COUNTERS.values()} | {
        "epd_router_requests", "epd_pool_instances"}
    used = {v for k, v in vars(em).items() if k.isupper() and isinstance(v, str) and v.startswith("epd_")}
    used |= set(dg.STAGES.values())
    assert used and used <= declared, sorted(used - declared)


# ---- an idle server --------------------------------------------------------------------------------------
def test_idle_server_is_not_called_healthy_and_says_what_it_could_not_judge():
    f = FakeEpd()
    f.pools(prefill=1, decode=1)
    w = _window(f, lambda f: None)
    checks = dg.evaluate(w)
    assert {c.id for c in checks} == set(dg.SYMPTOMS) and {c.status for c in checks} <= set(dg.STATUSES)
    assert all(c.status in ("not_evaluated", "not_applicable") for c in checks), \
        [(c.id, c.status, c.detail) for c in checks if c.status not in ("not_evaluated", "not_applicable")]
    report = dg.Report("http://x", w.duration_s, 4, dg.summarize(w), checks)
    # nothing was judged: no traffic, neither healthy nor a symptom, exit 3
    assert report.requests == 0 and report.status == "no_traffic"
    assert not report.healthy and not report.symptoms and report.exit_code == 3
    text = report.format_text()
    assert "no traffic in window" in text and "healthy: no symptom found" not in text
    assert "NOT EVALUATED" in text and "idle server" in text
    data = report.to_json()
    json.dumps(data, allow_nan=False)
    assert data["status"] == "no_traffic" and not data["healthy"] and data["symptoms"] == []
    assert {d["id"] for d in data["not_evaluated"]} >= {"goodput_low", "kv_transfer_slow", "cancel_leak"}


def test_a_few_requests_that_nothing_can_judge_are_too_little_traffic():
    w = _window(FakeEpd(), _prefill_traffic(queue_s=0.01, n=3))
    checks = dg.evaluate(w)
    assert not any(c.status in ("ok", "symptom") for c in checks), [(c.id, c.status) for c in checks]
    report = dg.Report("http://x", w.duration_s, 4, dg.summarize(w), checks)
    assert report.requests == 3 and report.status == "too_little_traffic" and report.exit_code == 3
    assert "too little traffic in window: 3 request(s)" in report.format_text()
    # with enough of them the same traffic is judged, and healthy
    w = _window(FakeEpd(), _prefill_traffic(queue_s=0.01))
    report = dg.Report("http://x", w.duration_s, 4, dg.summarize(w), dg.evaluate(w))
    assert report.status == "healthy" and report.healthy and report.exit_code == 0


def test_nixl_operations_are_reported_per_transfer_not_as_requests():
    layers = 4

    def traffic(f: FakeEpd) -> None:
        _prefill_traffic(0.01)(f)  # 20 transfers
        f.inc(em.KV_OPS, "prefill", 20 * layers)
    w = _window(FakeEpd(), traffic)
    check = next(c for c in dg.evaluate(w) if c.id == "kv_transfer_slow")
    assert check.evidence["nixl_ops_per_transfer"] == layers
    rates = dg.summarize(w)["prefill"]["rates"]
    assert rates["nixl_ops_per_transfer"] == layers and "kv_transfer_requests_per_s" not in rates
    assert rates["kv_transfer_ops_per_s"] == pytest.approx(20 * layers / w.duration_s)
    assert "not client requests" in em._COUNTERS["kv_transfer_requests"][1]


def test_prefix_cache_counts_are_reported_as_tokens():
    w = _window(FakeEpd(), _prefill_traffic(0.01))  # 200 looked-up tokens a request, 150 hit
    caches = dg.summarize(w)["prefill"]["caches"]
    assert caches["prefix_query_tokens"] == 4000 and caches["prefix_hit_tokens"] == 3000
    assert caches["prefix_hit_rate"] == 0.75
    report = dg.Report("http://x", w.duration_s, 4, dg.summarize(w), dg.evaluate(w))
    text = report.format_text()
    assert "prefix hit (tokens)" in text and "75% of 4000 tok" in text


# ---- each symptom: its pattern fires it, a healthy one does not -------------------------------------------
def _pd_streams(long_prompts: bool):
    def scenario(f: FakeEpd) -> None:
        f.pools(pd=1)
        f.inc(em.ROUTED, "pd", 30, policy="kv")
        steps = [0.01] * 300 + ([0.6] * 10 if long_prompts else [0.012] * 10)
        f.observe(em.DECODE_STEP, "pd", steps)
        _requests(f, 30, itl=steps)
    return scenario


def test_prefill_steals_decode():
    assert _status(_window(FakeEpd(), _pd_streams(long_prompts=True)), "prefill_steals_decode") == "symptom"
    assert _status(_window(FakeEpd(), _pd_streams(long_prompts=False)), "prefill_steals_decode") == "ok"

    def spikes_not_from_steps(f: FakeEpd) -> None:  # streams stall, but every engine step is short
        _pd_streams(False)(f)
        f.observe(em.ITL, "api", [0.6] * 10)
    assert _status(_window(FakeEpd(), spikes_not_from_steps), "prefill_steals_decode") == "ok"
    assert _status(_window(FakeEpd(), _prefill_traffic(0.01)), "prefill_steals_decode") == "not_applicable"


def _prefill_traffic(queue_s: float, n: int = 20, kv_s: float = 0.02,
                     prefill_s: float = 0.1, p: int = 1, d: int = 1, decode_step_s: float = 0.01):
    def scenario(f: FakeEpd) -> None:
        f.pools(prefill=p, decode=d)
        f.inc(em.ROUTED, "prefill", n, policy="kv")
        f.inc(em.ROUTED, "decode", n, policy="free-kv")
        f.inc(em.PREFIX_QUERIES, "prefill", 200 * n)
        f.inc(em.PREFIX_HITS, "prefill", 150 * n, tier="device")
        f.inc(em.KV_BYTES, "prefill", 2**20 * n)
        f.observe(em.PREFILL_QUEUE, "prefill", [queue_s] * n)
        f.observe(em.PREFILL, "prefill", [prefill_s] * n)
        f.observe(em.KV_TRANSFER, "prefill", [kv_s] * n)
        f.observe(em.DECODE_QUEUE, "decode", [0.005] * n)
        f.observe(em.DECODE_STEP, "decode", [decode_step_s] * (19 * n))
        _requests(f, n, ttft=queue_s + prefill_s + kv_s + 0.01, tpot=decode_step_s)
    return scenario


def test_prefill_queue_dominates_ttft_and_prefill_budget_small():
    # 40 requests x 0.5 s of prefill in 10 s: two in prefill at once, the instance batches them
    saturated = _window(FakeEpd(), _prefill_traffic(queue_s=1.5, n=40, prefill_s=0.5))
    assert _status(saturated, "prefill_queue_dominates_ttft") == "symptom"
    assert _status(saturated, "prefill_budget_small") == "ok"
    check = next(c for c in dg.evaluate(saturated) if c.id == "prefill_queue_dominates_ttft")
    assert check.evidence["prefilling_per_instance"] == pytest.approx(2.0) and "p:2" in check.detail
    # 20 x 0.4 s: one prompt at a time (0.8 in prefill at once) while the queue grows
    one_at_a_time = _window(FakeEpd(), _prefill_traffic(queue_s=1.5, prefill_s=0.4))
    assert _status(one_at_a_time, "prefill_queue_dominates_ttft") == "ok"
    assert _status(one_at_a_time, "prefill_budget_small") == "symptom"
    for healthy in (_prefill_traffic(queue_s=0.01), _prefill_traffic(queue_s=0.15, prefill_s=0.01)):
        w = _window(FakeEpd(), healthy)  # a short queue, or a long one that is still under 0.2 s
        assert _status(w, "prefill_queue_dominates_ttft") == "ok" and _status(w, "prefill_budget_small") == "ok"
    few = _window(FakeEpd(), _prefill_traffic(queue_s=0.9, n=thresholds.MIN_REQUESTS - 1))
    assert _status(few, "prefill_queue_dominates_ttft") == "not_evaluated"


def _decode_traffic(itl_spikes: bool, step_spikes: bool, ttft: float = 0.2, kv_max: float = 0.3):
    def scenario(f: FakeEpd) -> None:
        _prefill_traffic(queue_s=0.01)(f)
        f.observe(em.ITL, "api", [0.01] * 300 + ([0.5] * 10 if itl_spikes else []))
        f.observe(em.DECODE_STEP, "decode", [0.5] * 10 if step_spikes else [])
        f.observe(em.TTFT, "api", [ttft] * 100)
        f.set(em.KV_USAGE, "decode", kv_max)
    return scenario


def test_decode_tpot_jitter():
    assert _status(_window(FakeEpd(), _decode_traffic(True, True)), "decode_tpot_jitter") == "symptom"
    assert _status(_window(FakeEpd(), _decode_traffic(True, False, kv_max=0.95)), "decode_tpot_jitter") == "symptom"
    assert _status(_window(FakeEpd(), _decode_traffic(False, False)), "decode_tpot_jitter") == "ok"
    assert _status(_window(FakeEpd(), _decode_traffic(True, False)), "decode_tpot_jitter") == "ok"  # not decode's
    assert _status(_window(FakeEpd(), _decode_traffic(True, True, ttft=5.0)), "decode_tpot_jitter") == "ok"


def test_kv_transfer_slow():
    assert _status(_window(FakeEpd(), _prefill_traffic(0.01, kv_s=0.8)), "kv_transfer_slow") == "symptom"
    healthy = _window(FakeEpd(), _prefill_traffic(0.01, kv_s=0.11))
    assert _status(healthy, "kv_transfer_slow") == "ok"
    check = next(c for c in dg.evaluate(healthy) if c.id == "kv_transfer_slow")
    assert check.evidence["bytes_per_request"] == 2**20
    # a transfer as long as the long prefill it overlaps with is the compute's, not the wire's
    assert _status(_window(FakeEpd(), _prefill_traffic(0.01, kv_s=0.8, prefill_s=0.75)), "kv_transfer_slow") == "ok"

    def failing(f: FakeEpd) -> None:
        _prefill_traffic(0.01)(f)
        f.inc(em.KV_FAILURES, "prefill", 1)
    assert _status(_window(FakeEpd(), failing), "kv_transfer_slow") == "symptom"


def test_decode_kv_short():
    def preempting(f: FakeEpd) -> None:
        _prefill_traffic(0.01)(f)
        f.inc(em.PREEMPTIONS, "decode", 4)
    assert _status(_window(FakeEpd(), preempting), "decode_kv_short", "decode") == "symptom"

    def queueing(f: FakeEpd) -> None:
        _prefill_traffic(0.01)(f)
        f.observe(em.DECODE_QUEUE, "decode", [1.5] * 20)
    assert _status(_window(FakeEpd(), queueing), "decode_kv_short", "decode") == "symptom"

    def full_and_waiting(f: FakeEpd) -> None:
        _prefill_traffic(0.01)(f)
        f.set(em.KV_USAGE, "decode", 0.97)
        f.set(em.QUEUE_DEPTH, "decode", 3)
    assert _status(_window(FakeEpd(), full_and_waiting), "decode_kv_short", "decode") == "symptom"

    def one_preemption(f: FakeEpd) -> None:  # a single preemption in the window is not "many"
        _prefill_traffic(0.01)(f)
        f.inc(em.PREEMPTIONS, "decode", 1)
        f.set(em.KV_USAGE, "decode", 0.97)  # full, but nobody waits
    assert _status(_window(FakeEpd(), one_preemption), "decode_kv_short", "decode") == "ok"

    def pd_preempting(f: FakeEpd) -> None:
        _pd_streams(False)(f)
        f.inc(em.PREEMPTIONS, "pd", 6)
    assert _status(_window(FakeEpd(), pd_preempting), "decode_kv_short", "pd") == "symptom"


def test_goodput_low():
    def slow(f: FakeEpd) -> None:
        _prefill_traffic(0.01)(f)
        f.observe(em.TTFT, "api", [3.0] * 60)  # 60 of 80 requests over the 2 s TTFT SLO
    w = _window(FakeEpd(), slow)
    assert _status(w, "goodput_low") == "symptom"
    check = next(c for c in dg.evaluate(w) if c.id == "goodput_low")
    assert check.evidence["ttft_attainment"] == pytest.approx(0.25)
    assert _status(w, "goodput_low", settings=dg.Settings(ttft_slo_s=5.0)) == "ok"
    assert _status(_window(FakeEpd(), _prefill_traffic(0.01)), "goodput_low") == "ok"


def test_prefix_cache_miss():
    def traffic(hits: int, queries: int, policy: str = "kv", p: int = 1):
        def scenario(f: FakeEpd) -> None:
            f.pools(prefill=p, decode=1)
            f.inc(em.ROUTED, "prefill", 40, policy=policy)
            f.inc(em.PREFIX_QUERIES, "prefill", queries)
            f.inc(em.PREFIX_HITS, "prefill", hits, tier="device")
        return scenario

    assert _status(_window(FakeEpd(), traffic(100, 8000)), "prefix_cache_miss", "prefill") == "symptom"
    assert _status(_window(FakeEpd(), traffic(6000, 8000)), "prefix_cache_miss", "prefill") == "ok"
    assert _status(_window(FakeEpd(), traffic(0, 100)), "prefix_cache_miss", "prefill") == "not_evaluated"
    rr = _window(FakeEpd(), traffic(100, 8000, policy="round-robin", p=2))
    check = next(c for c in dg.evaluate(rr) if c.id == "prefix_cache_miss")
    assert check.status == "symptom" and "ignores the cache" in check.detail and check.evidence["instances"] == 2

    def tier_full(f: FakeEpd) -> None:  # the host tier drops blocks: capacity, named as the cause
        traffic(400, 8000)(f)
        f.inc(em.PREFIX_HITS, "prefill", 300, tier="host")
        f.inc(em.KV_HOST_EVICTED, "prefill", 120)
    check = next(c for c in dg.evaluate(_window(FakeEpd(), tier_full)) if c.id == "prefix_cache_miss")
    assert check.status == "symptom" and "capacity limits the hit rate" in check.detail
    assert check.evidence["host_evicted_blocks"] == 120 and check.evidence["host_hit_tokens"] == 300

    def disk_kept(f: FakeEpd) -> None:  # a disk tier keeps what the host drops: not capacity, until it drops too
        tier_full(f)
        f.inc(em.KV_DISK_STORED, "prefill", 120)
        f.inc(em.PREFIX_HITS, "prefill", 100, tier="disk")
    check = next(c for c in dg.evaluate(_window(FakeEpd(), disk_kept)) if c.id == "prefix_cache_miss")
    assert "capacity" not in check.detail and check.evidence["disk_hit_tokens"] == 100

    def disk_full(f: FakeEpd) -> None:
        disk_kept(f)
        f.inc(em.KV_DISK_EVICTED, "prefill", 50)
    check = next(c for c in dg.evaluate(_window(FakeEpd(), disk_full)) if c.id == "prefix_cache_miss")
    assert "capacity limits the hit rate" in check.detail and check.evidence["disk_evicted_blocks"] == 50


def test_pool_ratio_mismatch():
    # p:1,d:2: prefill busy (two prompts at once) and queueing, both decode instances nearly idle
    w = _window(FakeEpd(), _prefill_traffic(queue_s=1.5, n=40, prefill_s=0.5, d=2, decode_step_s=0.002))
    check = next(c for c in dg.evaluate(w) if c.id == "pool_ratio_mismatch")
    assert check.status == "symptom" and check.evidence["suggested_pools"] == "p:2,d:1"
    # p:1,d:1 with no instance to move: add one
    w = _window(FakeEpd(), _prefill_traffic(queue_s=1.5, n=40, prefill_s=0.5, decode_step_s=0.002))
    assert next(c for c in dg.evaluate(w) if c.id == "pool_ratio_mismatch").evidence["suggested_pools"] == "p:2,d:1"
    # queueing, but one prompt at a time: the step budget's (prefill_budget_small), not the ratio's
    w = _window(FakeEpd(), _prefill_traffic(queue_s=1.5, prefill_s=0.4, d=2, decode_step_s=0.002))
    assert _status(w, "pool_ratio_mismatch") == "ok" and _status(w, "prefill_budget_small") == "symptom"
    # decode preempting while prefill idles
    def decode_short(f: FakeEpd) -> None:
        _prefill_traffic(queue_s=0.01, prefill_s=0.01, p=3, d=1, decode_step_s=0.4)(f)
        f.inc(em.PREEMPTIONS, "decode", 8)
    check = next(c for c in dg.evaluate(_window(FakeEpd(), decode_short)) if c.id == "pool_ratio_mismatch")
    assert check.status == "symptom" and check.evidence["suggested_pools"] == "p:1,d:3"
    assert _status(_window(FakeEpd(), _prefill_traffic(queue_s=0.01)), "pool_ratio_mismatch") == "ok"
    assert _status(_window(FakeEpd(), _pd_streams(False)), "pool_ratio_mismatch") == "not_applicable"


def _cancelled(kv_end: float, running_end: float = 0.0, open_end: float = 0.0):
    def scenario(f: FakeEpd) -> None:
        _prefill_traffic(0.01)(f)
        f.inc(em.CANCELLED, "api", 5)
        f.set(em.KV_USAGE, "decode", kv_end)
        f.set(em.RUNNING, "decode", running_end)
        f.g[em.ROUTER_REQUESTS].labels(pool="router", instance="router", state="decode").set(open_end)
    return scenario


def test_cancel_leak():
    w = _window(FakeEpd(), _cancelled(kv_end=0.05))
    check = next(c for c in dg.evaluate(w) if c.id == "cancel_leak")
    assert check.status == "symptom" and "decode-0 5.0%" in check.detail
    assert _status(_window(FakeEpd(), _cancelled(kv_end=0.0)), "cancel_leak") == "ok"
    assert _status(_window(FakeEpd(), _cancelled(kv_end=0.05, running_end=2)), "cancel_leak") == "not_evaluated"
    assert _status(_window(FakeEpd(), _cancelled(kv_end=0.05, open_end=1)), "cancel_leak") == "not_evaluated"
    assert _status(_window(FakeEpd(), _prefill_traffic(0.01)), "cancel_leak") == "not_evaluated"  # none cancelled


def test_a_healthy_busy_server_has_no_symptom():
    w = _window(FakeEpd(), _prefill_traffic(queue_s=0.01))
    checks = dg.evaluate(w)
    assert not [c for c in checks if c.status == "symptom"], [(c.id, c.detail) for c in checks]
    assert {c.id for c in checks if c.status == "ok"} >= {
        "prefill_queue_dominates_ttft", "prefill_budget_small", "kv_transfer_slow", "decode_kv_short",
        "goodput_low", "prefix_cache_miss", "pool_ratio_mismatch", "decode_tpot_jitter"}
    pools = dg.summarize(w)
    assert pools["api"]["rates"]["requests_per_s"] == pytest.approx(2.0)
    assert pools["prefill"]["caches"]["prefix_hit_rate"] == pytest.approx(0.75)
    assert pools["prefill"]["stages"]["prefill_queue"]["p50_s"] == pytest.approx(0.01, rel=0.3)
    assert pools["decode"]["instances"] == 1
    text = dg.Report("http://x", w.duration_s, 4, pools, checks).format_text()
    assert "prefill_queue" in text and "75% of 4000" in text


# ---- the command line against an HTTP server serving saved metric text ---------------------------------
class _Metrics(http.server.BaseHTTPRequestHandler):
    pages: list[str] = []  # one per GET; the last repeats

    def do_GET(self):  # http.server's name
        if self.path != "/metrics":
            self.send_error(404)
            return
        text = self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd.cli", "diagnose", *args], capture_output=True, text=True,
                          timeout=60)


def _pages(scenario) -> list[str]:
    f = FakeEpd()
    first = f.text()
    scenario(f)
    return [first, f.text()]


def test_cli_exit_codes_and_json(metrics_server):
    server, url = metrics_server
    _Metrics.pages = _pages(_prefill_traffic(queue_s=0.01))
    r = _cli("--url", url + "/v1", "--window", "0.3", "--interval", "0.1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "healthy: no symptom found" in r.stdout and "prefill_queue" in r.stdout

    _Metrics.pages = _pages(_prefill_traffic(queue_s=1.5, kv_s=0.8))
    r = _cli("--url", url, "--window", "0.3", "--interval", "0.1", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads(r.stdout)
    ids = {s["id"] for s in data["symptoms"]}
    assert {"prefill_queue_dominates_ttft", "kv_transfer_slow"} <= ids
    assert all(s["cause"] and s["fix"] and s["title"] for s in data["symptoms"])
    assert data["healthy"] is False and data["pools"]["prefill"]["instances"] == 1

    _Metrics.pages = _pages(_prefill_traffic(queue_s=1.5, kv_s=0.8))
    r = _cli("--url", url, "--window", "0.2", "--interval", "0.1", "--ignore", "prefill_queue_dominates_ttft",
             "--ignore", "kv_transfer_slow", "--ignore", "goodput_low", "--ignore", "pool_ratio_mismatch")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[ignored symptom]" in r.stdout


def test_cli_idle_window_exits_3_not_0(metrics_server):
    server, url = metrics_server
    f = FakeEpd()
    f.pools(prefill=1, decode=1)
    _Metrics.pages = [f.text(), f.text()]
    r = _cli("--url", url, "--window", "0.2", "--interval", "0.1")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no traffic in window" in r.stdout and "healthy: no symptom" not in r.stdout
    r = _cli("--url", url, "--window", "0.2", "--interval", "0.1", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["status"] == "no_traffic"


def test_cli_unreadable_server_exits_2(metrics_server):
    server, url = metrics_server
    r = _cli("--url", "http://127.0.0.1:9", "--window", "0.1")
    assert r.returncode == 2 and "cannot read http://127.0.0.1:9/metrics" in r.stderr
    assert "Traceback" not in r.stderr
    _Metrics.pages = ["# TYPE go_goroutines gauge\ngo_goroutines 7\n"]
    r = _cli("--url", url, "--window", "0.1", "--json")
    assert r.returncode == 2 and "is this an epd server" in r.stderr
    assert json.loads(r.stdout)["error"]
    r = _cli("--url", url + "/nothing-here/x", "--window", "0.1")
    assert r.returncode == 2 and "HTTP 404" in r.stderr
    r = _cli("--url", url, "--window", "0")
    assert r.returncode == 2 and "must be a number > 0" in r.stderr
