"""The ``epd`` command line, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _epd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json_tiny_matches_offline_api(tiny_model_dirs):
    from epd import LLM, SamplingParams

    model = tiny_model_dirs["qwen3"]
    r = _epd("generate", "--model", model, "--prompt", "hello world", "--max-tokens", "8",
             "--temperature", "0", "--no-chat", "--json", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    llm = LLM(model, dtype="float32")
    expected = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    llm.shutdown()
    assert got["token_ids"] == expected.token_ids
    assert got["text"] == expected.text
    assert got["finish_reason"] in ("stop", "length")


def test_generate_unknown_model_is_a_clear_error(tmp_path):
    r = _epd("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2
    assert "not found" in r.stderr and "nope" in r.stderr
    assert "Traceback" not in r.stderr


def test_generate_bad_max_tokens(tiny_model_dirs):
    r = _epd("generate", "--model", tiny_model_dirs["llama"], "--prompt", "hi", "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens" in r.stderr and "Traceback" not in r.stderr


def test_create_tiny(tmp_path):
    r = _epd("model", "create-tiny", "qwen2", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m" / "config.json").exists()
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.slow
def test_default_model_answers_france(default_model_dir):
    r = _epd("generate", "--prompt", "What is the capital of France?", "--max-tokens", "32",
             "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout)["text"]


def test_create_tiny_refuses_a_non_empty_dir(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "precious.bin").write_bytes(b"keep me")
    r = _epd("model", "create-tiny", "llama", str(target))
    assert r.returncode == 2 and "--force" in r.stderr
    assert (target / "precious.bin").read_bytes() == b"keep me" and not (target / "config.json").exists()


def test_unexpected_errors_are_one_line(tiny_model_dirs):
    r = _epd("generate", "--model", tiny_model_dirs["llama"], "--prompt", "hi", "--seed", str(2**70))
    assert r.returncode in (1, 2) and "seed" in r.stderr and "Traceback" not in r.stderr


def _catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (15 - 1)))
    return False


def _torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_worker_sigterm_while_starting_exits_0(tiny_model_dirs):
    """A worker SIGTERM'd before it has imported torch or loaded its model (a pod deleted
    while it starts, the churn of an autoscaler) exits 0 at once, having joined nothing;
    before, the signal's default action killed it (-15) until its loop was set up."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "epd.cli", "worker", "--role", "decode", "--instance-id", "w0",
                             "--router", "tcp://127.0.0.1:1", "--model", str(tiny_model_dirs["llama"])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not _catches_sigterm(proc.pid):
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.001)
        assert not _torch_loaded(proc.pid), "SIGTERM is caught only once torch is imported"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM while starting" in out and "drained in" in out, out
    assert "joining" not in out, out  # it never announced itself


def test_generate_quantization_int8_reaches_the_engine(tiny_model_dirs):
    """`epd generate --quantization int8` runs on int8 weights: the tokens of
    ``LLM(quantization="int8")``, whose linear layers hold int8 weights and their scales."""
    import torch

    from epd import LLM, SamplingParams

    model = tiny_model_dirs["llama"]
    r = _epd("generate", "--model", model, "--prompt", "hello world", "--max-tokens", "8", "--temperature", "0",
             "--no-chat", "--json", "--dtype", "float32", "--quantization", "int8")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["completion_tokens"] > 0
    llm = LLM(model, dtype="float32", quantization="int8")
    try:
        assert llm.engine.config.quantization == "int8"
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.int8 and qkv.weight_scale is not None
        expected = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    finally:
        llm.shutdown()
    assert got["token_ids"] == expected.token_ids


@pytest.mark.parametrize("command", ["generate", "worker", "launch"])
def test_quantization_other_than_int8_is_refused_naming_the_flag(command):
    r = _epd(command, "--quantization", "int4", timeout=60)
    assert r.returncode == 2
    assert "--quantization" in r.stderr and "invalid choice: 'int4'" in r.stderr and "'int8'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
