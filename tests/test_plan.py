"""epd.ops.plan without a server: the fits, the simulation on synthetic profiles, the search,
the connectors and the command line's errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epd.cli import main
from epd.ops.plan.apply import apply, kubectl_commands
from epd.ops.plan.errors import PlanError
from epd.ops.plan.fit import DecodeFit, PrefillFit, Profile, fit_decode, fit_prefill, load_profile
from epd.ops.plan.recommend import extrapolation_warnings, recommend
from epd.ops.plan.simulate import simulate_decode, simulate_prefill
from epd.ops.plan.workload import synthetic_workload, trace_workload

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"

PREFILL = PrefillFit(c0=0.005, c1=2e-4, c2=0.0, overhead_s=0.02)  # 512 tokens: ~0.11 s
DECODE = DecodeFit(a=0.01, b=0.002, c=0.0)


def profile(tmp_path: Path | None = None) -> Profile:
    p = Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                tp={"prefill": 1, "decode": 1})
    if tmp_path is not None:
        (tmp_path / "profile.json").write_text(json.dumps(p.to_json()))
    return p


def test_prefill_fit_recovers_a_quadratic_and_the_overhead():
    n = np.array([64, 128, 256, 512, 1024, 2048], dtype=float)
    t = 0.003 + 1e-4 * n + 2e-8 * n * n
    fit = fit_prefill([[a, b, b + 0.015] for a, b in zip(n, t)])
    assert fit.c0 == pytest.approx(0.003, abs=1e-6)
    assert fit.c1 == pytest.approx(1e-4, rel=1e-3)
    assert fit.c2 == pytest.approx(2e-8, rel=1e-3)
    assert fit.overhead_s == pytest.approx(0.015)


def test_fits_never_go_negative():
    # noisy points whose unconstrained quadratic bends down
    fit = fit_prefill([[64, 0.010, 0.02], [512, 0.060, 0.07], [2048, 0.200, 0.21]])
    assert min(fit.c0, fit.c1, fit.c2) >= 0
    assert fit.seconds(4096) > fit.seconds(2048)
    d = fit_decode([[1, 64, 0.010], [2, 64, 0.011], [4, 64, 0.013], [8, 64, 0.017], [4, 512, 0.020]])
    assert d.b > 0 and d.c > 0 and d.a > 0


def test_decode_fit_with_one_context_has_no_context_term():
    d = fit_decode([[b, 80, 0.01 + 0.001 * b] for b in (1, 2, 4, 8)])
    assert (d.a, d.b, d.c) == pytest.approx((0.01, 0.001, 0.0))


@pytest.mark.parametrize("points,match", [([[64, 0.01, 0.02], [64, 0.011, 0.02]], "2 or more input lengths"),
                                          ([[64, 0.0, 0.02], [128, 0.01, 0.02]], "> 0")])
def test_prefill_fit_rejects_bad_points(points, match):
    with pytest.raises(PlanError, match=match):
        fit_prefill(points)


def test_prefill_simulation_queues_and_more_instances_drain_it():
    w = synthetic_workload(512, 16, rate=12.0, n=400)  # 12 req/s x 0.11 s: 1.3 instances busy
    one, _ = simulate_prefill(w, PREFILL, 1)
    two, _ = simulate_prefill(w, PREFILL, 2)
    assert np.quantile(one, 0.9) > 1.0  # overloaded: the queue grows
    assert np.quantile(two, 0.9) < 0.5
    assert two.min() == pytest.approx(PREFILL.seconds(512) + PREFILL.overhead_s)


def test_decode_simulation_batches_steps():
    w = synthetic_workload(64, 11, rate=1000.0, n=4)  # all at once: one batch of 4 on one instance
    gaps = simulate_decode(w, DECODE, 1, np.zeros(4))
    assert len(gaps) == 4 * 10
    assert gaps == pytest.approx(DECODE.seconds(4, 0))
    gaps = simulate_decode(w, DECODE, 4, np.zeros(4))  # one each
    assert gaps == pytest.approx(DECODE.seconds(1, 0))


def test_more_load_needs_more_prefill_instances():
    prof = profile()
    low, _ = recommend(prof, synthetic_workload(512, 32, rate=4.0, n=400), ttft_slo_s=0.5, itl_slo_s=0.05)
    high, _ = recommend(prof, synthetic_workload(512, 32, rate=30.0, n=400), ttft_slo_s=0.5, itl_slo_s=0.05)
    assert low.meets and high.meets
    assert high.prefill > low.prefill
    assert high.ttft_p90_s <= 0.5 and high.itl_p90_s <= 0.05


def test_a_tighter_itl_slo_needs_more_decode_instances():
    prof = profile()
    w = synthetic_workload(256, 128, rate=8.0, n=300)
    loose, _ = recommend(prof, w, ttft_slo_s=1.0, itl_slo_s=0.06)
    tight, tried = recommend(prof, w, ttft_slo_s=1.0, itl_slo_s=0.02)
    assert loose.meets and tight.meets
    assert tight.decode > loose.decode
    assert tight.itl_p90_s <= 0.02
    # every smaller decode pool that was tried missed the SLO
    assert all(c.itl_p90_s > 0.02 for c in tried if 0 < c.decode < tight.decode)


def test_an_slo_out_of_reach_is_reported_not_met():
    best, _ = recommend(profile(), synthetic_workload(512, 32, rate=30.0, n=200), ttft_slo_s=0.01, itl_slo_s=0.05,
                        max_devices=4)
    assert not best.meets
    assert best.prefill + best.decode <= 4


def test_trace_workload_reads_and_scales_a_shared_trace():
    w = trace_workload(TRACES / "azure_llm_2023_conv.csv", limit=50, max_model_len=512)
    assert len(w.arrival_s) == 50 and (np.diff(w.arrival_s) >= 0).all()
    assert (w.input_len + w.output_len <= 512).all()
    fast = trace_workload(TRACES / "azure_llm_2023_conv.csv", limit=50, rate=20.0)
    assert fast.arrival_s[-1] < w.arrival_s[-1]


def test_kubectl_commands_use_the_scale_subresource_of_the_pool_deployments():
    cmds = kubectl_commands({"encode": 0, "prefill": 2, "decode": 3}, "epd")
    assert cmds == [["kubectl", "scale", "deployment/epd-encode", "--replicas=0", "-n", "epd"],
                    ["kubectl", "scale", "deployment/epd-prefill", "--replicas=2", "-n", "epd"],
                    ["kubectl", "scale", "deployment/epd-decode", "--replicas=3", "-n", "epd"]]


def test_local_connector_writes_what_was_recommended(tmp_path, capsys):
    profile(tmp_path)
    state = tmp_path / "replicas.json"
    rc = main(["plan", "recommend", "--profile", str(tmp_path / "profile.json"), "--isl-mean", "512",
               "--osl-mean", "32", "--rate", "30", "--num-requests", "300", "--ttft-slo", "0.5", "--itl-slo", "0.05",
               "--json", "--apply", "--connector", "local", "--state", str(state)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(state.read_text()) == out["replicas"]
    assert out["pools"] == f"e:0,p:{out['replicas']['prefill']},d:{out['replicas']['decode']}"
    assert out["replicas"]["prefill"] >= 2
    assert out["predicted"]["ttft_p90_s"] <= 0.5


def test_kubernetes_connector_dry_run_prints_the_kubectl_commands(tmp_path, capsys):
    profile(tmp_path)
    rc = main(["plan", "recommend", "--profile", str(tmp_path / "profile.json"), "--isl-mean", "128",
               "--osl-mean", "16", "--rate", "2", "--num-requests", "100", "--ttft-slo", "1", "--itl-slo", "0.05",
               "--apply", "--connector", "kubernetes", "--namespace", "prod", "--dry-run"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("e:0,p:1,d:1")
    assert "kubectl scale deployment/epd-prefill --replicas=1 -n prod" in out
    assert "kubectl scale deployment/epd-decode --replicas=1 -n prod" in out


def test_apply_reports_a_failing_kubectl(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises((PlanError, FileNotFoundError)):
        apply({"prefill": 1}, "kubernetes")


def test_load_profile_errors(tmp_path):
    with pytest.raises(PlanError, match="no such profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"model": "x"}')
    with pytest.raises(PlanError, match="not an epd plan profile"):
        load_profile(tmp_path / "bad.json")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd.cli", "plan", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("extra,message", [
    (["--isl-mean", "10"], "a workload is needed"),
    (["--trace", "/nonexistent.csv"], "no such trace"),
    (["--trace", "x.txt"], "unknown trace format"),
    (["--trace", "x.csv", "--isl-mean", "5", "--osl-mean", "5"], "not both"),
])
def test_bad_workloads_exit_2_with_a_message(tmp_path, extra, message):
    profile(tmp_path)
    r = _cli("recommend", "--profile", str(tmp_path / "profile.json"), "--ttft-slo", "1", "--itl-slo", "0.1", *extra)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_bad_arguments_exit_2():
    r = _cli("recommend", "--profile", "p.json", "--ttft-slo", "-1", "--itl-slo", "0.1", "--rate", "1")
    assert r.returncode == 2 and "must be a number > 0" in r.stderr
    r = _cli("recommend", "--profile", "/nonexistent.json", "--ttft-slo", "1", "--itl-slo", "0.1", "--rate", "1",
             "--isl-mean", "10", "--osl-mean", "10")
    assert r.returncode == 2 and "no such profile" in r.stderr
    r = _cli("profile", "--url", "http://127.0.0.1:9", "--lengths", "0")
    assert r.returncode == 2 and "must be >= 1" in r.stderr
    r = _cli("profile", "--url", "http://127.0.0.1:9", "--decode-under-prefill", "0,1.5")
    assert r.returncode == 2 and "within 0..1" in r.stderr


def test_profile_of_an_unreachable_server_exits_2(tmp_path):
    r = _cli("profile", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "p.json"), "--timeout", "2")
    assert r.returncode == 2, r.stderr
    assert "cannot" in r.stderr and not (tmp_path / "p.json").exists()


def test_prefill_queue_is_fifo_with_exact_waits():
    # three 512-token prompts at t=0: one instance serves them back to back, two serve two at once
    w = trace_like([0.0, 0.0, 0.0], [512, 512, 512], [2, 2, 2])
    s, o = PREFILL.seconds(512), PREFILL.overhead_s
    one, first = simulate_prefill(w, PREFILL, 1)
    assert one == pytest.approx([s + o, 2 * s + o, 3 * s + o])
    assert first == pytest.approx(one)  # arrivals at 0
    two, _ = simulate_prefill(w, PREFILL, 2)
    assert two == pytest.approx([s + o, s + o, 2 * s + o])
    # a later arrival that finds the instance free does not wait
    late, _ = simulate_prefill(trace_like([0.0, 10.0], [512, 512], [2, 2]), PREFILL, 1)
    assert late == pytest.approx([s + o, s + o])


def trace_like(arrivals, isl, osl):
    from epd.ops.plan.workload import Workload

    return Workload(np.asarray(arrivals, dtype=float), np.asarray(isl), np.asarray(osl), "test")


INTERFERENCE = [[0, 1.0, 0.02], [2, 3.0, 0.06]]  # 2 decode streams: prefill x3, overhead 60 ms


def test_interference_table_interpolates_and_holds_past_its_ends():
    from epd.ops.plan.fit import Interference

    inter = Interference(INTERFERENCE, 0.01)
    slow, over = inter.at(np.array([0, 1, 2, 5]))
    assert slow == pytest.approx([1.0, 2.0, 3.0, 3.0])
    assert over == pytest.approx([0.02, 0.04, 0.06, 0.06])
    none = Interference([], 0.01)
    assert not none and none.at(3.0)[0] == 1.0 and none.at(3.0)[1] == 0.01


def test_fit_interference_recovers_the_slowdown_and_overhead():
    from epd.ops.plan.fit import fit_interference

    n = [64, 256, 1024]
    pts = [[x, PREFILL.seconds(x), PREFILL.seconds(x) + 0.02, 0] for x in n]
    pts += [[x, 2.5 * PREFILL.seconds(x), 2.5 * PREFILL.seconds(x) + 0.05, 8] for x in n]
    fit = fit_prefill(pts)  # the 0-stream points only
    assert (fit.c0, fit.c1) == pytest.approx((PREFILL.c0, PREFILL.c1), rel=1e-6)
    rows = fit_interference(pts, fit)
    assert np.asarray(rows) == pytest.approx(np.array([[0, 1.0, 0.02], [8, 2.5, 0.05]]), rel=1e-6)
    assert fit_interference([p[:3] for p in pts[:3]], fit) == []  # one level: no table


def test_simulation_slows_a_prefill_by_the_decode_streams_running_at_its_start():
    from epd.ops.plan.simulate import simulate

    # A (at 0) decodes 2000 tokens at 12 ms+ a token (until ~24 s); B (at 1 s) and C (at 2 s)
    # start their prefill while A and then A+B stream; D at 100 s finds no stream
    w = trace_like([0.0, 1.0, 2.0, 100.0], [512, 512, 512, 512], [2000, 2000, 1, 1])
    prof = Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                   interference=INTERFERENCE)
    ttft, gaps = simulate(prof, w, 1, 1)
    s = PREFILL.seconds(512)
    assert ttft == pytest.approx([s + 0.02, 2 * s + 0.04, 3 * s + 0.06, s + 0.02])
    # without the table the same workload's TTFTs are the bare prefill: the slowdown is the table's
    plain, _ = simulate(Profile(model="tiny", pools={}, prefill=PREFILL, decode=DECODE), w, 1, 1)
    assert plain == pytest.approx([s + 0.02] * 4)
    assert len(gaps) == 2 * 1999


def test_interference_can_need_more_prefill_instances():
    w = synthetic_workload(512, 64, rate=6.0, n=300)  # 6 x 0.11 s: 0.66 busy alone, over 1 when x2
    alone, _ = recommend(profile(), w, ttft_slo_s=0.5, itl_slo_s=0.1)
    shared = Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                     tp={"prefill": 1, "decode": 1}, interference=[[0, 1.0, 0.02], [4, 2.0, 0.02]])
    slowed, tried = recommend(shared, w, ttft_slo_s=0.5, itl_slo_s=0.1)
    assert alone.meets and slowed.meets
    assert alone.prefill == 1 and slowed.prefill >= 2
    assert any(c.prefill == 1 and c.ttft_p90_s > 0.5 for c in tried)


def test_pools_text_is_launch_syntax_without_the_router():
    from epd.ops.plan.recommend import pools_text

    assert pools_text({"router": 0, "prefill": 1, "decode": 2, "api": 1}) == "p:1,d:2"
    assert pools_text({"pd": 2, "encode": 1}) == "e:1,pd:2"


def test_profile_json_round_trips_the_interference_table(tmp_path):
    p = Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                prefill_points=[[64, 0.01, 0.03, 0], [64, 0.02, 0.05, 4]], interference=INTERFERENCE,
                prefill_under_decode=4)
    (tmp_path / "p.json").write_text(json.dumps(p.to_json()))
    back = load_profile(tmp_path / "p.json")
    assert back.interference == INTERFERENCE and back.prefill_under_decode == 4
    assert back.prefill_points == p.prefill_points
    old = p.to_json()
    del old["interference"]  # a version-1 profile: no table, prefill alone
    (tmp_path / "v1.json").write_text(json.dumps(old))
    assert load_profile(tmp_path / "v1.json").interference == []


# ---- decode under prefill (the mirror of the interference table) ---------------------------------
DECODE_INTERFERENCE = [[0.0, 1.0], [1.0, 3.0]]  # prefill pool busy all the time: decode steps x3


def test_decode_interference_table_interpolates_and_holds_past_its_ends():
    from epd.ops.plan.fit import DecodeInterference

    table = DecodeInterference([[1.0, 3.0], [0.0, 1.0]])  # sorted on load
    assert [table.at(u) for u in (-1.0, 0.0, 0.25, 0.5, 1.0, 2.0)] == pytest.approx([1, 1, 1.5, 2, 3, 3])
    none = DecodeInterference([])
    assert not none and none.at(0.7) == 1.0


def test_fit_decode_interference_recovers_the_slowdown_at_the_measured_busy_fraction():
    from epd.ops.plan.fit import fit_decode_interference

    pts = [[0, 0.04, 3.5, 80, DECODE.seconds(3.5, 80)], [0, 0.06, 3.5, 80, DECODE.seconds(3.5, 80)],
           [1, 0.9, 2.5, 80, 2.0 * DECODE.seconds(2.5, 80)], [1, 0.95, 3.0, 80, 2.2 * DECODE.seconds(3.0, 80)]]
    rows = fit_decode_interference(pts, DECODE)
    assert np.asarray(rows) == pytest.approx(np.array([[0.05, 1.0], [0.925, 2.1]]))
    # relative to the duty-0 pass: an offset of the whole pass from the fit cancels
    off = [[d, u, b, c, 0.8 * t] for d, u, b, c, t in pts]
    assert np.asarray(fit_decode_interference(off, DECODE)) == pytest.approx(np.array([[0.05, 1.0], [0.925, 2.1]]))
    # without a duty-0 pass the table starts at the decode fit's own (idle prefill) point
    assert np.asarray(fit_decode_interference(pts[2:], DECODE)) == pytest.approx(np.array([[0.0, 1.0], [0.925, 2.1]]))
    assert fit_decode_interference([], DECODE) == []


def _with_decode_table(table=DECODE_INTERFERENCE, **kw) -> Profile:
    return Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                   tp={"prefill": 1, "decode": 1}, decode_interference=table, **kw)


def test_decode_steps_that_start_during_a_prefill_are_slowed_and_the_others_are_not():
    from epd.ops.plan.simulate import simulate

    # A (at 0) decodes 300 tokens at 12 ms a step (until ~3.7 s); B's prefill (at 1 s, 512 tokens,
    # 107 ms) overlaps A's steps from 1.0 to 1.107 s
    w = trace_like([0.0, 1.0], [512, 512], [300, 1])
    _, plain = simulate(profile(), w, 1, 1)
    _, slowed = simulate(_with_decode_table(), w, 1, 1)
    step = DECODE.seconds(1, 0)
    assert plain == pytest.approx([step] * 299)
    n_slow = int(np.sum(np.isclose(slowed, 3 * step)))
    assert 3 <= n_slow <= 4  # the steps starting in B's 107 ms prefill, at x3 each
    assert np.sum(np.isclose(slowed, step)) == 299 - n_slow
    # one request: its own prefill ends before its first decode step, nothing overlaps
    alone = trace_like([0.0], [512], [300])
    assert simulate(_with_decode_table(), alone, 1, 1)[1] == pytest.approx(simulate(profile(), alone, 1, 1)[1])


def test_decode_under_prefill_raises_p90_itl_where_prefills_overlap_decode():
    from epd.ops.plan.simulate import simulate

    w = synthetic_workload(512, 64, rate=6.0, n=300)  # prefill busy ~65% of the time
    ttft0, gaps0 = simulate(profile(), w, 1, 1)
    ttft1, gaps1 = simulate(_with_decode_table(), w, 1, 1)
    assert np.quantile(gaps1, 0.9) > 1.5 * np.quantile(gaps0, 0.9)
    assert ttft1 == pytest.approx(ttft0)  # prefill is not slowed by this table
    # a table that says "no slowdown" predicts what no table does
    assert simulate(_with_decode_table([[0, 1.0], [1, 1.0]]), w, 1, 1)[1] == pytest.approx(gaps0)
    # and the search answers it with more decode instances for the same ITL SLO
    alone, _ = recommend(profile(), w, ttft_slo_s=0.5, itl_slo_s=0.05)
    slowed, tried = recommend(_with_decode_table(), w, ttft_slo_s=0.5, itl_slo_s=0.05)
    assert alone.meets and alone.decode == 1
    assert slowed.meets and slowed.decode > alone.decode
    assert any(c.decode == 1 and c.itl_p90_s > 0.05 for c in tried)


def test_both_tables_together_converge_and_slow_both():
    from epd.ops.plan.simulate import SIM_ROUNDS, simulate

    w = synthetic_workload(512, 64, rate=6.0, n=300)
    pre = Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                  interference=[[0, 1.0, 0.02], [4, 1.5, 0.02]])
    both = Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                   interference=[[0, 1.0, 0.02], [4, 1.5, 0.02]], decode_interference=DECODE_INTERFERENCE)
    ttft_p, gaps_p = simulate(pre, w, 1, 1)
    ttft_b, gaps_b = simulate(both, w, 1, 1)
    assert np.isfinite(ttft_b).all() and np.isfinite(gaps_b).all() and SIM_ROUNDS <= 20
    # slower decode keeps more streams running, which slows prefill further
    assert np.quantile(gaps_b, 0.9) > np.quantile(gaps_p, 0.9)
    assert np.quantile(ttft_b, 0.9) >= np.quantile(ttft_p, 0.9)


def test_a_profile_without_the_decode_table_loads_and_predicts_as_before(tmp_path):
    from epd.ops.plan.simulate import simulate

    p = _with_decode_table(decode_under_prefill=[0.0, 0.5, 1.0], decode_under_prefill_tokens=512,
                           decode_under_prefill_points=[[0, 0.05, 4, 96, 0.02], [1, 0.9, 3, 96, 0.05]])
    (tmp_path / "p.json").write_text(json.dumps(p.to_json()))
    back = load_profile(tmp_path / "p.json")
    assert back.decode_interference == DECODE_INTERFERENCE and back.decode_under_prefill == [0.0, 0.5, 1.0]
    assert back.decode_under_prefill_tokens == 512 and back.decode_under_prefill_points == p.decode_under_prefill_points
    old = p.to_json()
    for key in ("decode_under_prefill", "decode_under_prefill_tokens", "decode_under_prefill_points",
                "decode_interference"):
        del old[key]  # a profile written before the term
    (tmp_path / "old.json").write_text(json.dumps(old))
    prev = load_profile(tmp_path / "old.json")
    assert prev.decode_interference == [] and prev.decode_under_prefill == []
    w = synthetic_workload(512, 64, rate=6.0, n=200)
    for a, b in zip(simulate(prev, w, 1, 1), simulate(profile(), w, 1, 1)):
        assert a == pytest.approx(b)
    assert recommend(prev, w, 0.5, 0.03)[0] == recommend(profile(), w, 0.5, 0.03)[0]


def test_the_decode_table_is_read_at_the_simulated_prefill_pools_utilization():
    from epd.ops.plan.simulate import prefill_busy_over_time, simulate

    busy = prefill_busy_over_time(np.array([0.0, 0.5]), np.array([1.0, 2.0]), 2)
    assert [busy(t) for t in (-1.0, 0.0, 0.7, 1.0, 1.5, 2.0)] == [0, 0.5, 1.0, 0.5, 0.5, 0]
    # the same arrivals over more prefill instances keep each busy less: fewer steps are slowed
    w = synthetic_workload(512, 64, rate=6.0, n=300)
    itl = [np.quantile(simulate(_with_decode_table(), w, m, 2)[1], 0.9) for m in (1, 2, 3)]
    assert itl[0] > itl[1] > itl[2] > np.quantile(simulate(profile(), w, 3, 2)[1], 0.9)


# ---- live correction (epd plan correct) ----------------------------------------------------------
def _observed(prof: Profile, w, prefill_x: float, decode_x: float):
    """What a server `prof` describes up to the factors would show for the load ``w``."""
    import dataclasses

    from epd.ops.plan.correct import Observation
    from epd.ops.plan.simulate import simulate

    ttft, gaps = simulate(dataclasses.replace(prof, prefill_correction=prefill_x, decode_correction=decode_x), w, 1, 1)
    return Observation(requests=len(ttft), rate=6.0, isl_mean=float(w.input_len.mean()),
                       osl_mean=float(w.output_len.mean()), ttft_s=float(ttft.mean()), itl_s=float(gaps.mean()),
                       prefill=1, decode=1, window_s=60.0)


@pytest.mark.parametrize("tables", [False, True])
def test_fit_corrections_recovers_the_factors_a_server_runs_slower_by(tables):
    """The profile is 1.8x too fast for prefill and 1.4x for decode on the server: the fitted
    factors are those, found through the queueing (at 6 req/s of 300-token prompts one prefill
    instance is 39 % busy at the profile's speed and 70 % at 1.8x, so the queue grows faster
    than the factor), not the ratio of the mean TTFTs. With both interference tables they
    interact and are still recovered."""
    from epd.ops.plan.correct import fit_corrections
    from epd.ops.plan.simulate import simulate

    prof = Profile(model="tiny", pools={"prefill": 1, "decode": 1}, prefill=PREFILL, decode=DECODE,
                   **({"interference": [[0, 1.0, 0.02], [4, 1.5, 0.02]], "decode_interference": DECODE_INTERFERENCE}
                      if tables else {}))
    w = synthetic_workload(300, 40, rate=6.0, n=300)
    obs = _observed(prof, w, 1.8, 1.4)
    cp, cd = fit_corrections(prof, obs)
    assert cp == pytest.approx(1.8, rel=0.03) and cd == pytest.approx(1.4, rel=0.03), (cp, cd)
    ratio = obs.ttft_s / float(simulate(prof, w, 1, 1)[0].mean())
    assert abs(ratio - 1.8) > 0.1  # the plain ratio of means would be another number: queueing


def test_a_corrected_profile_round_trips_and_recommend_predicts_with_it(tmp_path):
    import dataclasses

    from epd.ops.plan.correct import Observation

    obs = Observation(requests=40, rate=4.0, isl_mean=300.0, osl_mean=40.0, ttft_s=0.2, itl_s=0.02, prefill=1,
                      decode=1, window_s=10.0)
    slow = dataclasses.replace(profile(), prefill_correction=3.0, decode_correction=2.0,
                               correction_observed=dataclasses.asdict(obs))
    (tmp_path / "c.json").write_text(json.dumps(slow.to_json()))
    back = load_profile(tmp_path / "c.json")
    assert (back.prefill_correction, back.decode_correction) == (3.0, 2.0)
    assert back.correction_observed == dataclasses.asdict(obs)
    w = synthetic_workload(512, 16, rate=4.0, n=300)
    fast_best, _ = recommend(profile(), w, ttft_slo_s=0.5, itl_slo_s=0.05)
    slow_best, _ = recommend(back, w, ttft_slo_s=0.5, itl_slo_s=0.05)
    assert slow_best.prefill > fast_best.prefill  # 3x slower prefills need more instances
    assert slow_best.itl_p90_s > 1.5 * fast_best.itl_p90_s


def test_correct_without_a_server_exits_2(tmp_path):
    profile(tmp_path)
    r = subprocess.run([sys.executable, "-m", "epd.cli", "plan", "correct", "--profile", str(tmp_path / "profile.json"),
                        "--url", "http://127.0.0.1:9", "--window", "0.1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read" in r.stderr, r.stderr


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd.cli", "plan", *args], capture_output=True, text=True, timeout=120)


def test_an_output_that_cannot_be_written_is_refused_before_any_measuring(tmp_path):
    """`profile --out` / `correct --out` into a missing folder, or onto a folder, exit 2 naming
    it before the server is read (the unreachable URL is never reached); `--apply --state`
    likewise exits 2 (not 1, which means no pool set fits)."""
    profile(tmp_path)
    url = "http://127.0.0.1:9"
    for args in (("profile", "--url", url, "--out", str(tmp_path / "nodir" / "p.json")),
                 ("correct", "--profile", str(tmp_path / "profile.json"), "--url", url, "--window", "1",
                  "--out", str(tmp_path / "nodir" / "p.json"))):
        r = _plan(*args)
        assert r.returncode == 2 and "no such folder" in r.stderr and "cannot read" not in r.stderr, r.stderr
    r = _plan("profile", "--url", url, "--out", str(tmp_path))
    assert r.returncode == 2 and "is a folder" in r.stderr, r.stderr
    r = _plan("profile", "--url", url, "--prefill-under-decode", "4")  # no base: the fit would be under load
    assert r.returncode == 2 and "lacks 0" in r.stderr and "cannot read" not in r.stderr, r.stderr
    r = _plan("recommend", "--profile", str(tmp_path / "profile.json"), "--isl-mean", "64", "--osl-mean", "8",
              "--rate", "1", "--ttft-slo", "5", "--itl-slo", "1", "--apply", "--state", str(tmp_path / "no" / "s.json"))
    assert r.returncode == 2 and "cannot write" in r.stderr, r.stderr


def test_bad_trace_rows_and_windows_exit_2(tmp_path):
    profile(tmp_path)
    base = ("recommend", "--profile", str(tmp_path / "profile.json"), "--ttft-slo", "5", "--itl-slo", "1")
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 100, "output_length": 10}) + "\n"
                             for i in range(3)))
    r = _plan(*base, "--trace", str(trace), "--start", "2", "--rate", "5")  # one row left: no rate to rescale
    assert r.returncode == 2 and "at least two distinct arrival times" in r.stderr, r.stderr
    r = _plan(*base, "--trace", str(trace), "--start", "-1")
    assert r.returncode == 2 and "must be >= 0" in r.stderr, r.stderr
    r = _plan("correct", "--profile", str(tmp_path / "profile.json"), "--window", "1e10")
    assert r.returncode == 2 and "at most 86400" in r.stderr, r.stderr
    # trace-only options without --trace are refused, not ignored
    r = _plan(*base, "--isl-mean", "64", "--osl-mean", "8", "--rate", "1", "--limit", "10", "--scale", "0.5")
    assert r.returncode == 2 and "--limit, --scale apply to --trace only" in r.stderr, r.stderr
    r = _plan("correct", "--profile", str(tmp_path / "profile.json"), "--url", "http://127.0.0.1:9", "--window",
              "1", "--start", "0")
    assert r.returncode == 2 and "--start applies to --trace only" in r.stderr, r.stderr


@pytest.mark.parametrize("value", [True, "2", 1e300, 0, None, [2]])
def test_a_correction_factor_must_be_a_number_in_the_fitted_range(tmp_path, value):
    (tmp_path / "p.json").write_text(json.dumps(profile().to_json() | {"decode_correction": value}))
    with pytest.raises(PlanError, match="decode_correction must be a number within 0.0625..16"):
        load_profile(tmp_path / "p.json")


def test_recommend_warns_where_prompts_pass_the_longest_profiled(tmp_path):
    """Prompts longer than any the profile measured get a warning naming how many and the
    longest (stderr and --json "warnings"); a workload within the profiled lengths, or a
    hand-written profile without points, gets none."""
    import dataclasses

    measured = dataclasses.replace(profile(), prefill_points=[[64, 0.01, 0.02], [512, 0.03, 0.04]])
    (tmp_path / "p.json").write_text(json.dumps(measured.to_json()))
    base = ("recommend", "--profile", str(tmp_path / "p.json"), "--osl-mean", "8", "--rate", "1",
            "--ttft-slo", "5", "--itl-slo", "1", "--json")
    long, short = _plan(*base, "--isl-mean", "900"), _plan(*base, "--isl-mean", "512")
    assert long.returncode == 0 and short.returncode == 0, long.stderr + short.stderr
    assert json.loads(long.stdout)["warnings"] == [
        "1000 of 1000 prompts are longer than the longest profiled (512 tokens; the longest is 900): their "
        "prefill time is extrapolated from the fit; profile with --lengths up to 900 to measure it"]
    assert "warning: 1000 of 1000 prompts are longer" in long.stderr
    assert json.loads(short.stdout)["warnings"] == [] and "warning" not in short.stderr
    w = synthetic_workload(900, 8, rate=1.0, n=10)
    assert extrapolation_warnings(profile(), w) == []  # no points: nothing to compare with


def test_apply_leaves_the_encode_pool_it_does_not_model(tmp_path):
    """A profile of e:2,p:1,d:1: `recommend` sizes prefill and decode only; the pools it
    prints keep e:2, kubectl never scales epd-encode, and the local state file keeps its
    other keys (Dynamo's planner leaves pools it does not plan alone)."""
    import dataclasses

    prof = dataclasses.replace(profile(), pools={"encode": 2, "prefill": 1, "decode": 1})
    (tmp_path / "p.json").write_text(json.dumps(prof.to_json()))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"encode": 2, "prefill": 1, "decode": 1}))
    base = ("recommend", "--profile", str(tmp_path / "p.json"), "--isl-mean", "512", "--osl-mean", "32", "--rate",
            "30", "--num-requests", "300", "--ttft-slo", "0.5", "--itl-slo", "0.05", "--apply")
    r = _plan(*base, "--json", "--connector", "local", "--state", str(state))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["replicas"] == {"prefill": out["replicas"]["prefill"], "decode": out["replicas"]["decode"]}
    assert out["replicas"]["prefill"] >= 2 and out["pools"].startswith("e:2,"), out
    assert json.loads(state.read_text()) == {"encode": 2, **out["replicas"]}
    r = _plan(*base, "--connector", "kubernetes", "--dry-run")
    assert r.returncode == 0 and "deployment/epd-prefill" in r.stdout and "epd-encode" not in r.stdout, r.stdout


def test_options_that_do_not_apply_are_refused(tmp_path):
    """Synthetic-only options with --trace, and apply-only options without --apply, exit 2
    naming them instead of being ignored."""
    profile(tmp_path)
    base = ("recommend", "--profile", str(tmp_path / "profile.json"), "--ttft-slo", "5", "--itl-slo", "1")
    synthetic = ("--isl-mean", "64", "--osl-mean", "8", "--rate", "1")
    r = _plan(*base, "--trace", str(TRACES / "azure_llm_2023_conv.csv"), "--cv", "3", "--num-requests", "10")
    assert r.returncode == 2 and "--num-requests, --cv apply to synthetic workloads" in r.stderr, r.stderr
    r = _plan(*base, "--trace", str(TRACES / "azure_llm_2023_conv.csv"), "--cv", "0")  # 0 is given too
    assert r.returncode == 2 and "--cv applies to synthetic workloads" in r.stderr, r.stderr
    for extra, named in ((("--dry-run",), "--dry-run"), (("--connector", "local"), "--connector"),
                         (("--state", str(tmp_path / "s.json"), "--namespace", "x"), "--state, --namespace")):
        r = _plan(*base, *synthetic, *extra)
        assert r.returncode == 2 and f"{named} appl" in r.stderr and "--apply" in r.stderr, r.stderr
    assert not (tmp_path / "s.json").exists()
    r = _plan(*base, *synthetic, "--apply", "--connector", "kubernetes", "--state", str(tmp_path / "s.json"),
              "--dry-run")
    assert r.returncode == 2 and "--state applies to --connector local only" in r.stderr, r.stderr


def test_the_profiled_context_length_bounds_the_workload(tmp_path):
    """A profile records the server's max_model_len: a synthetic ISL + OSL beyond it is
    refused (exit 2), and a trace is scaled to fit it unless --scale or --max-model-len say
    otherwise (as `epd bench` replays it)."""
    import dataclasses

    (tmp_path / "p.json").write_text(json.dumps(dataclasses.replace(profile(), max_model_len=2048).to_json()))
    assert load_profile(tmp_path / "p.json").max_model_len == 2048
    base = ("recommend", "--profile", str(tmp_path / "p.json"), "--ttft-slo", "5", "--itl-slo", "1", "--json")
    r = _plan(*base, "--isl-mean", "50000", "--osl-mean", "64", "--rate", "1")
    assert r.returncode == 2 and "50064 tokens" in r.stderr and "max_model_len 2048" in r.stderr, r.stderr
    trace = str(TRACES / "mooncake_conversation_trace.jsonl")
    r = _plan(*base, "--trace", trace, "--limit", "50", "--rate", "2")
    assert r.returncode in (0, 1), r.stderr
    fitted = trace_workload(trace, limit=50, max_model_len=2048, rate=2.0)
    assert json.loads(r.stdout)["workload"] == fitted.source and "lengths x" in fitted.source
    r = _plan(*base, "--trace", trace, "--limit", "50", "--rate", "2", "--scale", "0.01")
    assert r.returncode in (0, 1) and "lengths x0.01" in json.loads(r.stdout)["workload"], r.stderr
    # an explicit scale or context beyond the server's is refused, as is giving both
    for extra, said in ((("--scale", "1"), "longer than the profiled server's max_model_len 2048"),
                        (("--max-model-len", "100000"), "beyond the profiled server's max_model_len 2048"),
                        (("--scale", "0.01", "--max-model-len", "1000"), "not both")):
        r = _plan(*base, "--trace", trace, "--limit", "50", "--rate", "2", *extra)
        assert r.returncode == 2 and said in r.stderr, (extra, r.stderr)


def test_an_unreachable_slo_names_the_smallest_closest_pools(tmp_path):
    """No pool set can give a TTFT under one prefill's time: the answer is not the largest
    set tried but the smallest whose prediction is as close as any (more prefill instances
    do not shorten a lone prefill); --json lists only fully simulated candidates. SLOs
    given in what looks like milliseconds get a warning."""
    w = synthetic_workload(512, 16, rate=0.5, n=100)
    best, tried = recommend(profile(), w, ttft_slo_s=1e-4, itl_slo_s=1.0)
    assert not best.meets and (best.prefill, best.decode) == (1, 1), best
    assert max(p.prefill for p in tried) > 1  # larger sets were tried and were no closer
    profile(tmp_path)
    r = _plan("recommend", "--profile", str(tmp_path / "profile.json"), "--isl-mean", "512", "--osl-mean", "16",
              "--rate", "0.5", "--ttft-slo", "500", "--itl-slo", "20", "--json")
    assert r.returncode == 0, r.stderr
    assert "--ttft-slo 500 is seconds" in r.stderr and "--itl-slo 20 is seconds" in r.stderr, r.stderr
    assert all(c["itl_p90_s"] is not None for c in json.loads(r.stdout)["candidates"])
    r = _plan("recommend", "--profile", str(tmp_path / "profile.json"), "--isl-mean", "512", "--osl-mean", "16",
              "--rate", "0.5", "--ttft-slo", "5", "--itl-slo", "1", "--cv", "0", "--json")  # fixed gaps, as epd bench
    assert r.returncode == 0 and "cv 0" in json.loads(r.stdout)["workload"], r.stderr
