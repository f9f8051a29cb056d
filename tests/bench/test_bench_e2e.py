"""`epd bench` end to end against a real spawned tiny-model server (real worker pools)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import pytest

from epd.bench import BenchConfig, WorkloadOptions, run_bench
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    from epd.models.tiny import create_tiny_model

    model = create_tiny_model("llava", tmp_path_factory.mktemp("bench") / "llava", seed=0)
    with launch(str(model), "e:1,pd:1") as server:
        yield server


def check_records(run: dict, n: int, output_len: int) -> None:
    assert len(run["records"]) == n and run["summary"]["requests"] == n
    assert run["summary"]["completed"] == n, [r["error"] for r in run["records"]]
    for r in run["records"]:
        assert r["ok"] and r["error"] is None
        # ignore_eos + max_tokens: exactly output_len tokens, counted by the server's usage
        assert (r["n_out"], r["n_out_source"], r["finish_reason"]) == (output_len, "usage", "length")
        assert r["prompt_tokens"] > 0 and r["cached_tokens"] is not None
        assert 0 < r["ttft_s"] <= r["chunk_s"][-1] <= r["e2e_s"]
        assert r["tpot_s"] == pytest.approx((r["chunk_s"][-1] - r["chunk_s"][0]) / (output_len - 1))
        assert len(r["itls_s"]) == len(r["chunk_s"]) - 1 and all(x >= 0 for x in r["itls_s"])
    s = run["summary"]
    assert s["output_tokens"] == n * output_len
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] and s["e2e_s"]["p99"] >= s["ttft_s"]["p99"]
    assert all(0.0 <= v <= 1.0 for v in s["attainment"].values())


def test_epd_bench_cli_chat_sweep(llava_server, tmp_path):
    out = tmp_path / "bench_chat.json"
    proc = subprocess.run(
        [sys.executable, "-m", "epd.cli", "bench", "--base-url", llava_server.url, "--workload", "chat",
         "--rate", "4", "inf", "-n", "5", "--input-len", "8-24", "--output-len", "6", "--ttft-slo", "30",
         "--tpot-slo", "5", "--no-progress"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # no --out: the current directory, as vLLM's
    assert proc.returncode == 0, proc.stderr
    assert "goodput" in proc.stdout and "TTFT p99" in proc.stdout
    res = json.loads(out.read_text())
    assert res["bench"]["model"] == llava_server.model and res["bench"]["max_model_len"] == 2048
    assert res["bench"]["num_devices"] == 2 and res["bench"]["devices_from"] == "/epd/workers"
    assert [r["rate"] for r in res["runs"]] == [4.0, "inf"]
    for run in res["runs"]:
        check_records(run, 5, 6)
    g = res["goodput"]  # only the finite rate enters the sweep
    assert g["status"] in ("lower_bound", "never_met") and g["per_device"] == pytest.approx(g["rate"] / 2)
    for name in ("bench_chat_cdf.png", "bench_chat_attainment.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multimodal_and_trace_replay(llava_server, tmp_path):
    mm = asyncio.run(run_bench(BenchConfig(
        llava_server.url, workload="multimodal", rates=[float("inf")], num_requests=3, ttft_slo_s=None,
        tpot_slo_s=None, progress=False, max_concurrency=1, options=WorkloadOptions(images=(1, 2), output_len=4))))
    check_records(mm["runs"][0], 3, 4)
    recs = mm["runs"][0]["records"]  # max_concurrency 1: each request is sent after the previous one ended
    assert all(b["sent_s"] >= a["sent_s"] + a["e2e_s"] for a, b in zip(recs, recs[1:]))
    assert 3 <= mm["runs"][0]["workload"]["images"] <= 6
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 200 * i, "input_length": 3000 + 500 * i, "output_length": 300,
                                         "hash_ids": [0, 1 + i]}) + "\n" for i in range(4)))
    from transformers import AutoTokenizer

    from epd.bench.workloads import calibrate

    # no tokenizer given: the served model's own (a local directory) calibrates the synthetic text,
    # as vLLM's benchmark defaults --tokenizer to --model; this tiny 512-entry BPE: ~3 tokens a word
    res = asyncio.run(run_bench(BenchConfig(
        llava_server.url, workload="trace", rates=[], num_requests=3, trace_speedup=4.0, progress=False,
        options=WorkloadOptions(trace_path=trace))))
    per_word = calibrate(AutoTokenizer.from_pretrained(llava_server.model))
    assert res["bench"]["tokens_per_word"] == pytest.approx(per_word) and per_word > 2
    assert res["bench"]["tokens_per_word_from"] == llava_server.model
    run = res["runs"][0]
    assert run["rate"] is None and len(run["records"]) == 3 and "goodput" not in res
    scale = res["bench"]["trace_scale"]
    assert scale == pytest.approx(0.9 * int(0.9 * 2048) / 4300)  # the longest row fills 90 % of 90 % of 2048
    assert [r["scheduled_s"] for r in run["records"]] == pytest.approx([0.0, 0.05, 0.1])
    assert all(r["ok"] and r["n_out"] == round(300 * scale) for r in run["records"]), \
        [r["error"] for r in run["records"]]
    # prompts came out near their scaled lengths in real tokens (plus the chat template)
    for rec, i in zip(run["records"], range(3)):
        assert rec["prompt_tokens"] == pytest.approx(round((3000 + 500 * i) * scale), rel=0.15)


def test_unreachable_server_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "epd.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
                           "-n", "1", "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "cannot list models" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_voice_over_realtime_socket(tmp_path):
    """The voice workload drives /v1/realtime (the openai SDK's realtime client): the
    default SmolLM2 answers spoken questions transcribed by Whisper tiny.en in the E pool."""
    with launch(None, "e:1,pd:1") as server:
        out = tmp_path / "voice.json"
        proc = subprocess.run(
            [sys.executable, "-m", "epd.cli", "bench", "--base-url", server.url, "--workload", "voice",
             "--rate", "inf", "-n", "2", "--max-concurrency", "1", "--output-len", "8", "--out", str(out),
             "--no-progress", "--no-plots"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert len(run["records"]) == 2
    for r in run["records"]:
        assert r["ok"], r["error"]
        assert r["kind"] == "voice" and r["n_out_source"] == "usage" and 1 <= r["n_out"] <= 8
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["finish_reason"] in ("stop", "length")
