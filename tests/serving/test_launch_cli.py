"""`epd launch` fails fast, with a clear message and no traceback, on bad set-ups."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd.cli", "launch", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("pools, message", [
    ("e:1,x:2", "unknown"),
    ("e:1,p:1", "d"),
    ("e:1,pd:1,p:1", "pd"),
    ("p:one,d:1", "whole number"),
])
def test_bad_pool_spec(pools, message, tiny_model_dirs):
    r = _launch("--model", tiny_model_dirs["llama"], "--pools", pools)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_tp_must_divide_pool_and_heads(tiny_model_dirs):
    r = _launch("--model", tiny_model_dirs["llama"], "--pools", "p:3,d:1", "--tp", "p:2")
    assert r.returncode == 2 and "divide" in r.stderr and "Traceback" not in r.stderr
    # tiny llama: 4 attention heads, 2 KV heads -> TP 4 does not split the KV heads.
    r = _launch("--model", tiny_model_dirs["llama"], "--pools", "p:4,d:1", "--tp", "p:4")
    assert r.returncode == 2 and "2 KV heads" in r.stderr


def test_busy_port(tiny_model_dirs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _launch("--model", tiny_model_dirs["llama"], "--port", str(port))
    assert r.returncode == 2 and "already in use" in r.stderr and "Traceback" not in r.stderr


def test_missing_model(tmp_path):
    r = _launch("--model", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
