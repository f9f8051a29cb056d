"""epd.plan without a server: the fits, the simulation on synthetic profiles, the search,
the connectors and the command line's errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epd.cli import main
from epd.plan import (DecodeFit, PlanError, PrefillFit, Profile, apply, fit_decode, fit_prefill, kubectl_commands,
                      load_profile, recommend, simulate_decode, simulate_prefill, synthetic_workload, trace_workload)

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


def test_profile_of_an_unreachable_server_exits_2(tmp_path):
    r = _cli("profile", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "p.json"), "--timeout", "2")
    assert r.returncode == 2, r.stderr
    assert "cannot" in r.stderr and not (tmp_path / "p.json").exists()
