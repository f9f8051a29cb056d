"""``epd plan profile`` on a real server (`epd launch`, ``p:1,d:1``, real workers, CPU), then
``epd plan recommend`` from the saved profile (prefill timed alone and under two streamed
decode requests, decode timed with the prefill pool idle and kept busy): the profile grows
with the input length, has positive fits, a two-row interference table and a
decode-under-prefill table of sane factors; a heavier workload gets more prefill instances
than a light one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serving.conftest import launch
from tests.serving.test_diagnose_server import THREADS, small_llama  # noqa: F401 - the widened tiny llama fixture
from tests.test_plan import TRACES

pytestmark = pytest.mark.slow


def plan(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd.cli", "plan", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_profile_a_server_then_recommend(small_llama, tmp_path):
    out = tmp_path / "profile.json"
    with launch(small_llama, "p:1,d:1", "--kv-cache-memory-gb", "0.3", *THREADS) as server:
        r = plan("profile", "--url", server.url, "--out", str(out), "--lengths", "64,512,1536", "--repeats", "2",
                 "--batches", "1,8,32", "--contexts", "64", "--decode-tokens", "48",
                 "--prefill-under-decode", "0,2", "--decode-under-prefill", "0,1", "--prefill-load-tokens", "512")
    assert r.returncode == 0, r.stderr + r.stdout
    prof = json.loads(out.read_text())
    assert prof["pools"] == {"prefill": 1, "decode": 1}
    assert prof["model"] and prof["prefill_under_decode"] == 2
    assert "router" not in prof["pools"] and "api" not in prof["pools"]
    assert "profiled" in r.stdout and " on p:1,d:1 -> " in r.stdout, r.stdout
    by_len: dict[int, list[float]] = {}
    for n, prefill_s, ttft_s, streams in prof["prefill_points"]:
        assert 0 < prefill_s <= ttft_s and streams in (0, 2)
        if streams == 0:
            by_len.setdefault(int(n), []).append(prefill_s)
    assert {int(p[3]) for p in prof["prefill_points"]} == {0, 2}
    table = prof["interference"]  # [streams, slowdown, overhead_s] per stream count
    assert [row[0] for row in table] == [0, 2] and all(row[1] > 0 and row[2] >= 0 for row in table), table
    # decode under prefill: [prefill_busy, slowdown] per duty; the back-to-back load keeps the pool busy
    assert prof["decode_under_prefill"] == [0.0, 1.0] and prof["decode_under_prefill_tokens"] == 512
    dtable = prof["decode_interference"]
    assert len(dtable) == 2 and len(prof["decode_under_prefill_points"]) == 2 * 3, prof["decode_under_prefill_points"]
    assert all(0 <= u <= 1 and 0.5 <= x < 50 for u, x in dtable), dtable
    assert dtable[0][0] == 0 and dtable[-1][0] > 0.5, dtable  # duty 0: idle; duty 1: busy
    assert "under the prefill pool" in r.stdout and "decode step x" in r.stdout, r.stdout
    means = [sum(v) / len(v) for _, v in sorted(by_len.items())]
    assert means == sorted(means), prof["prefill_points"]  # monotone in the input length
    f, d = prof["prefill"], prof["decode"]
    assert f["c1"] + f["c2"] > 0 and f["overhead_s"] >= 0
    assert d["a"] > 0 and d["b"] > 0  # ITL grows with the batch
    assert all(itl > 0 for _, _, itl in prof["decode_points"])

    # one 1536-token prefill at 2.5x the rate this one instance can serve needs more prefill instances
    one_s = f["c0"] + f["c1"] * 1536 + f["c2"] * 1536 ** 2
    slo = dict(ttft=f"{4 * one_s + f['overhead_s'] + 0.05:.4g}", itl=f"{3 * d['a'] + 24 * d['b'] + 0.01:.4g}")
    # this part sizes prefill: the profile without its decode-under-prefill table (that term is
    # tests/test_plan.py's; a loaded machine measures it large, and slower decode keeps more
    # streams running, so the prefill table's factor, not the arrival rate, would set the answer)
    prof["decode_interference"] = []
    out.write_text(json.dumps(prof))
    light = plan("recommend", "--profile", str(out), "--isl-mean", "1536", "--osl-mean", "16",
                 "--rate", f"{0.3 / one_s:.4g}", "--num-requests", "200", "--ttft-slo", slo["ttft"],
                 "--itl-slo", slo["itl"], "--json")
    heavy = plan("recommend", "--profile", str(out), "--isl-mean", "1536", "--osl-mean", "16",
                 "--rate", f"{2.5 / one_s:.4g}", "--num-requests", "200", "--ttft-slo", slo["ttft"],
                 "--itl-slo", slo["itl"], "--json")
    assert light.returncode == 0 and heavy.returncode == 0, light.stderr + heavy.stderr
    lo, hi = json.loads(light.stdout), json.loads(heavy.stdout)
    assert lo["replicas"]["prefill"] == 1, lo
    assert hi["replicas"]["prefill"] >= 3, hi
    assert hi["predicted"]["ttft_p90_s"] <= hi["slo"]["ttft_s"]


def test_correct_fits_a_profile_to_live_traffic(small_llama, tmp_path):
    """`epd plan correct` on a real server while streams run: the observation is what was sent
    (100-token prompts, 16 tokens out), and a profile that claims both phases take a fraction
    of what they do gets factors above 1 with which the simulation of the observed load gives
    the observed mean TTFT and ITL; the factors are written into the profile, `recommend`
    reports them, and a server without traffic in the window, or serving another model than the
    profile's, is a clear error (exit 2)."""
    import dataclasses
    import time

    import httpx

    from epd.ops.plan.correct import Observation
    from epd.ops.plan.fit import DecodeFit, PrefillFit, Profile, load_profile
    from epd.ops.plan.simulate import simulate
    from epd.ops.plan.workload import synthetic_workload
    from tests.serving.test_diagnose_server import Load, stream_model, tokens
    from tests.serving.test_kv_routing import _counter

    claimed = Profile(model="", pools={"prefill": 1, "decode": 1}, prefill=PrefillFit(2e-3, 2e-5, 0.0, 2e-3),
                      decode=DecodeFit(1e-3, 0.0, 0.0), tp={"prefill": 1, "decode": 1})
    path, other = tmp_path / "profile.json", tmp_path / "other.json"
    with launch(small_llama, "p:1,d:1", "--kv-cache-memory-gb", "0.05", *THREADS) as server:
        claimed = dataclasses.replace(claimed, model=server.model)
        path.write_text(json.dumps(claimed.to_json()))
        other.write_text(json.dumps(dataclasses.replace(claimed, model="another/model").to_json()))
        mismatch = plan("correct", "--profile", str(other), "--url", server.url, "--window", "0.5")
        idle = plan("correct", "--profile", str(path), "--url", server.url, "--window", "0.5")
        # one length (two, capped at the model's context to one) or one batch size cannot be fitted:
        # refused before anything is measured (no prefill logged)
        few = [plan("profile", "--url", server.url, "--out", str(tmp_path / "x.json"), *a)
               for a in (("--lengths", "64"), ("--lengths", "100000,200000"), ("--batches", "4"))]
        # profiling twice sends fresh prompts each time: a rerun timing prefix-cache hits would fit flat
        quick = ("profile", "--url", server.url, "--lengths", "64,128", "--repeats", "1", "--batches", "1,4",
                 "--contexts", "64", "--decode-tokens", "16", "--prefill-under-decode", "0",
                 "--decode-under-prefill", "0")
        reruns = [plan(*quick, "--out", str(tmp_path / f"q{i}.json")) for i in range(2)]
        time.sleep(1.0)  # counters reach /metrics with the workers' heartbeats
        hits = _counter(httpx.get(server.url + "/metrics").text, "epd_prefix_cache_hits_tokens_total", pool="prefill")
        load = Load(lambda rng: stream_model(server, server.model, tokens(rng, 100), 16), threads=3)
        try:
            time.sleep(1.0)
            r = plan("correct", "--profile", str(path), "--url", server.url, "--window", "4", "--json")
            # a trace of multi-thousand-token prompts is not this traffic: refused, nothing written
            mooncake = plan("correct", "--profile", str(path), "--url", server.url, "--window", "2", "--trace",
                            str(TRACES / "mooncake_conversation_trace.jsonl"), "--scale", "1", "--out",
                            str(tmp_path / "mooncake.json"))
        finally:
            assert load.stop() > 0
    assert mismatch.returncode == 2 and "the profile is of 'another/model'" in mismatch.stderr, mismatch.stderr
    assert idle.returncode == 2 and "streamed requests are needed" in idle.stderr, idle.stderr
    assert all(q.returncode == 0 for q in reruns), [q.stderr for q in reruns]
    assert hits == 0, hits
    for f in few:
        assert f.returncode == 2 and "2 or more distinct --lengths and --batches" in f.stderr, f.stderr
        assert " ms" not in f.stderr and not (tmp_path / "x.json").exists(), f.stderr  # no timing logged
    assert "capped at the model's max_model_len" in few[1].stderr, few[1].stderr
    assert r.returncode == 0, r.stderr + r.stdout
    assert mooncake.returncode == 2 and "the traffic does not follow --trace" in mooncake.stderr, mooncake.stderr
    assert not (tmp_path / "mooncake.json").exists()
    out = json.loads(r.stdout)
    obs = Observation(**out["observed"])
    assert obs.requests >= 10 and (obs.prefill, obs.decode) == (1, 1), obs
    # 100 fresh token ids each, counted with each prefill's time (a counter kept by heartbeats
    # lags it by a heartbeat's requests: 93 in CI); only a scrape between the two can differ,
    # by a prompt at each edge of the window (once seen: 101.25 over 81 requests)
    assert obs.isl_mean == pytest.approx(100, abs=2 * 101 / obs.requests), obs
    assert obs.osl_mean == pytest.approx(16, rel=0.25), obs  # the window's edges cut a few streams
    cp, cd = out["prefill_correction"], out["decode_correction"]
    assert 1 < cp < 15 and 1 < cd < 15, out  # the claims were too fast; neither at the search's end (16)
    prof = load_profile(path)
    assert (prof.prefill_correction, prof.decode_correction) == (cp, cd)
    assert prof.correction_observed == out["observed"]
    w = synthetic_workload(round(obs.isl_mean), round(obs.osl_mean), obs.rate, 300)
    ttft, gaps = simulate(prof, w, 1, 1)
    assert float(ttft.mean()) == pytest.approx(obs.ttft_s, rel=0.05)
    assert float(gaps.mean()) == pytest.approx(obs.itl_s, rel=0.05)
    assert dataclasses.replace(prof, prefill_correction=1.0).prefill == claimed.prefill  # the fit itself is kept
    rec = plan("recommend", "--profile", str(path), "--isl-mean", "100", "--osl-mean", "16", "--rate", "2",
               "--ttft-slo", "1", "--itl-slo", "0.5", "--json")
    assert rec.returncode == 0 and json.loads(rec.stdout)["correction"] == {"prefill": cp, "decode": cd}, rec.stderr
