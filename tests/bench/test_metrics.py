"""The benchmark's arithmetic on hand-made traces with known answers."""

import math

import pytest

from epd.bench.metrics import RequestRecord, goodput, meets_slo, percentiles, slo_attainment, summarize, tpot


def rec(chunks, n_out=None, ok=True, e2e=None, i=0):
    r = RequestRecord(i, "chat", 0.0, ok=ok, chunk_s=list(chunks), n_out=len(chunks) if n_out is None else n_out)
    r.e2e_s = e2e if e2e is not None else (chunks[-1] if chunks else None)
    return r


def test_tpot_definition():
    # first token at 0.5 s, last (5th) at 1.3 s: 4 gaps of decode for 4 tokens after the first
    assert tpot(0.5, 1.3, 5) == pytest.approx(0.2)
    assert tpot(0.5, 0.5, 1) is None  # one token: no decode to time
    assert tpot(0.0, 0.0, 0) is None
    with pytest.raises(ValueError):
        tpot(1.0, 0.5, 3)
    with pytest.raises(ValueError):
        tpot(0.0, 1.0, -1)


def test_record_ttft_itl_tpot():
    r = rec([0.25, 0.35, 0.55, 0.60])
    assert r.ttft_s == 0.25
    assert r.itls_s == pytest.approx([0.10, 0.20, 0.05])
    assert r.tpot_s == pytest.approx((0.60 - 0.25) / 3)
    # 2 chunks carrying 8 tokens (usage count): TPOT uses the token count, ITL the chunk gaps
    r2 = rec([1.0, 2.4], n_out=8)
    assert r2.tpot_s == pytest.approx(1.4 / 7)
    assert r2.itls_s == pytest.approx([1.4])
    assert rec([]).ttft_s is None and rec([]).tpot_s is None


def test_record_json_roundtrip():
    r = rec([0.1, 0.2, 0.4], n_out=3)
    d = r.to_json()
    assert d["ttft_s"] == 0.1 and d["tpot_s"] == pytest.approx(0.15) and d["itls_s"] == pytest.approx([0.1, 0.2])
    back = RequestRecord.from_json(d)
    assert back.chunk_s == r.chunk_s and back.tpot_s == r.tpot_s


def test_percentiles_known_values():
    vals = [float(v) for v in range(1, 101)]  # 1..100
    p = percentiles(vals)
    # numpy linear interpolation: position q/100 * (n - 1) between sorted values
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5)
    assert percentiles([3.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "p95": 3.0, "p99": 3.0}
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    # order does not matter
    assert percentiles([4.0, 1.0, 3.0, 2.0])["p50"] == pytest.approx(2.5)


def test_slo_attainment():
    recs = [
        rec([0.5, 0.6, 0.7, 0.8, 0.9]),        # TTFT 0.5, TPOT 0.1: meets both
        rec([2.5, 2.55, 2.6]),                 # TTFT 2.5 misses, TPOT 0.05 ok
        rec([0.2, 0.5, 0.8]),                  # TTFT ok, TPOT 0.3 misses
        rec([1.0]),                            # one token: TPOT undefined -> met
        rec([], ok=False),                     # failed: meets neither
    ]
    a = slo_attainment(recs, ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert a == {"ttft": pytest.approx(3 / 5), "tpot": pytest.approx(3 / 5), "both": pytest.approx(2 / 5)}
    assert meets_slo(recs[0], 0.5, 0.1) == (True, True)  # boundaries are inclusive
    assert slo_attainment(recs, None, None)["both"] == pytest.approx(4 / 5)  # no SLO: only failures miss
    assert slo_attainment([], 1.0, 1.0) == {"ttft": None, "tpot": None, "both": None}


def test_summarize():
    recs = [rec([0.5, 0.6, 0.7], e2e=0.75, i=0), rec([1.0, 1.4, 1.8], e2e=1.9, i=1), rec([], ok=False, i=2)]
    s = summarize(recs, duration_s=4.0, ttft_slo_s=0.8, tpot_slo_s=0.15)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["output_tokens"] == 6 and s["output_token_throughput"] == pytest.approx(1.5)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.75)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 0.4) / 2)
    assert s["itl_s"]["p50"] == pytest.approx(0.25)  # gaps 0.1 0.1 0.4 0.4
    assert s["e2e_s"]["p99"] == pytest.approx(0.75 + 0.99 * (1.9 - 0.75))
    assert s["attainment"]["both"] == pytest.approx(1 / 3)


def test_goodput_interpolates_between_sweep_points():
    # 1 req/s: 100 %, 2 req/s: 95 %, 3 req/s: 80 % -> crosses 90 % a third of the way from 2 to 3
    g = goodput([1.0, 2.0, 3.0], [1.0, 0.95, 0.80])
    assert g.status == "interpolated" and g.rate == pytest.approx(2 + (0.95 - 0.9) / (0.95 - 0.80))
    assert g.per_device(3) == pytest.approx(g.rate / 3)
    # unsorted input gives the same answer
    assert goodput([3.0, 1.0, 2.0], [0.80, 1.0, 0.95]).rate == pytest.approx(g.rate)


def test_goodput_edges():
    never = goodput([0.5, 1.0], [0.7, 0.4])
    assert (never.rate, never.status) == (0.0, "never_met")
    always = goodput([0.5, 1.0, 2.0], [1.0, 0.99, 0.92])
    assert (always.rate, always.status) == (2.0, "lower_bound")
    exact = goodput([1.0, 2.0, 4.0], [1.0, 0.9, 0.5])
    assert (exact.rate, exact.status) == (2.0, "exact")
    # not monotone: the highest rate that still meets the target counts
    bumpy = goodput([1.0, 2.0, 3.0, 4.0], [0.95, 0.85, 0.92, 0.52])
    assert bumpy.rate == pytest.approx(3.0 + 0.02 / 0.40)
    single = goodput([2.0], [0.95])
    assert (single.rate, single.status) == (2.0, "lower_bound")
    other_target = goodput([1.0, 2.0], [1.0, 0.0], target=0.5)
    assert other_target.rate == pytest.approx(1.5)
    for bad in (([], []), ([1.0], [0.5, 0.6]), ([1.0, 1.0], [0.9, 0.9]), ([0.0], [1.0]), ([math.inf], [1.0])):
        with pytest.raises(ValueError):
            goodput(*bad)
    with pytest.raises(ValueError):
        always.per_device(0)
