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
