"""Spawn the real server (`epd launch`, real worker processes) for serving tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, lines: list[str]) -> None:
        self.proc, self.port, self.lines = proc, port, lines
        self.url = f"http://127.0.0.1:{port}"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    @property
    def model(self) -> str:
        import httpx

        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def worker_process(self, instance_id: str, rank: int = 0) -> psutil.Process:
        """The live process of worker ``instance_id`` (TP rank ``rank``)."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "--instance-id" in cmd and cmd[cmd.index("--instance-id") + 1] == instance_id and (
                    "--rank" not in cmd or cmd[cmd.index("--rank") + 1] == str(rank)):
                return p
        raise LookupError(f"no live worker process {instance_id} rank {rank}")

    def workers(self) -> dict:
        import httpx

        return httpx.get(self.url + "/epd/workers", timeout=30).json()


@contextlib.contextmanager
def launch(model: str | None, pools: str | None, *extra: str, timeout_s: float = 400.0, env: dict | None = None):
    """Run `epd launch` until it prints that it serves; stop it (SIGINT) afterwards
    and check that no worker process outlives it. ``env``: extra environment variables."""
    port = _free_port()
    # fp32: servers are checked against fp32 references (greedy parity); a test's own
    # --dtype in ``extra`` comes later and wins.
    cmd = [sys.executable, "-m", "epd.cli", "launch", "--port", str(port), "--dtype", "float32", *extra]
    if pools is not None:
        cmd += ["--pools", pools]
    if model is not None:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.is_set():
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(psutil.Error):  # its workers too: none may outlive a failed start
                for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                    p.kill()
            proc.wait()
            pytest.fail(f"epd launch did not start (rc={proc.poll()}):\n" + "".join(lines))
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    server = Server(proc, port, lines)
    try:
        yield server
    finally:
        with contextlib.suppress(psutil.Error):  # restarted workers too
            children += [c for c in psutil.Process(proc.pid).children(recursive=True) if c not in children]
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        gone, alive = psutil.wait_procs(children, timeout=30)
        for p in alive:
            p.kill()
        assert not alive, f"orphaned worker processes: {[p.pid for p in alive]}"
