"""Membership as users and operators meet it (issue 34, items 7, 8 and 9), with real
processes: `epd serve` and `epd worker`s that join it, as on separate hosts.

- a killed worker is forgotten: its command port gets nothing more from the router, its
  pool is gone, and workers of other pools (new instance ids) take the traffic;
- a worker whose main loop is wedged (its heartbeat thread still beating) gets no more
  traffic, its request is retried elsewhere, and its ``/live`` answers 503;
- `epd serve` refuses, with the API's usual 400, a request over the smallest
  ``--max-model-len`` of the live workers it would go through.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import zmq

from epd.messages import decode
from epd.models.tiny import create_tiny_model
from tests.serving.conftest import _free_port
from tests.serving.public_bugs_helpers import assert_error, metric

pytestmark = pytest.mark.slow

WORKER_ARGS = ("--num-kv-blocks", "64", "--block-size", "16", "--max-num-seqs", "8", "--threads", "1",
               "--dtype", "float32")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("membership") / "llama"))


class _Proc:
    """A child process whose output is collected; ``wait_for(pattern)`` returns the first match."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_for(self, pattern: str, timeout_s: float = 300.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {pattern!r} (rc={self.proc.poll()}):\n" + "".join(self.lines))
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """`epd serve` on loopback and the `epd worker`s a test starts."""

    def __init__(self, model: str, pools: str, *serve_args: str) -> None:
        self.model, self.port, self.router_port = model, _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve = _Proc([sys.executable, "-m", "epd.cli", "serve", "--model", model, "--port", str(self.port),
                            "--router-port", str(self.router_port), "--pools", pools, *serve_args])
        self.workers: dict[str, tuple[_Proc, int]] = {}
        self.serve.wait_for("serving")

    def start_worker(self, role: str, inst: str, *extra: str, env: dict | None = None) -> None:
        http_port = _free_port()
        proc = _Proc([sys.executable, "-m", "epd.cli", "worker", "--role", role, "--instance-id", inst,
                      "--router", f"tcp://127.0.0.1:{self.router_port}", "--model", self.model,
                      "--http-port", str(http_port), *WORKER_ARGS, *extra], env=env)
        self.workers[inst] = (proc, http_port)

    def wait_registered(self, *insts: str, timeout_s: float = 600.0) -> None:
        """Until each worker's own ``/health`` says the router has it."""
        deadline = time.monotonic() + timeout_s
        for inst in insts:
            proc, http_port = self.workers[inst]
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).status_code == 200:
                        break
                if proc.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"worker {inst} did not join (rc={proc.proc.poll()}):\n" + "".join(proc.lines))
                time.sleep(0.3)

    def cmd_port(self, inst: str) -> int:
        return int(self.workers[inst][0].wait_for(r"commands on tcp://127\.0\.0\.1:(\d+)").group(1))

    def live(self, inst: str) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.workers[inst][1]}/live", timeout=10)

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 300) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", timeout=timeout,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})

    def stop(self) -> None:
        for proc, _ in self.workers.values():
            proc.stop()
        self.serve.stop()


@contextlib.contextmanager
def cluster(model: str, pools: str, *serve_args: str):
    c = Cluster(model, pools, *serve_args)
    try:
        yield c
    finally:
        c.stop()


def _prompt(i: int, n: int = 12) -> list[int]:
    return [100 + 7 * i + k for k in range(n)]


# ---- item 7: the router forgets dead workers ----------------------------------------------
def test_a_killed_worker_is_forgotten_its_port_goes_quiet_and_another_pool_takes_over(llama_dir):
    """Kubernetes style: the aggregated pd worker is killed, and the replacements come with
    new instance ids, as a prefill and a decode worker. The router stops pinging the dead
    one (its command port, bound again by the test, goes quiet) and forgets its pool, so
    requests take the prefill -> decode path instead of failing with 503 on a pd pool
    that no longer exists."""
    with cluster(llama_dir, "pd:1", "--forget-dead-after", "1") as c:
        c.start_worker("pd", "pd-old")
        c.wait_registered("pd-old")
        assert c.complete(_prompt(0), 4).status_code == 200
        port = c.cmd_port("pd-old")
        c.workers["pd-old"][0].proc.kill()
        c.workers["pd-old"][0].proc.wait()
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)  # where the router's socket to it reconnects
        pull.bind(f"tcp://127.0.0.1:{port}")
        try:
            got, quiet_since = [], time.monotonic()
            deadline = time.monotonic() + 60.0
            while time.monotonic() - quiet_since < 4.0:  # 4 s of silence: at least 8 pings missed
                assert time.monotonic() < deadline, f"the router still sends to the dead worker: {got[-3:]}"
                if pull.poll(200):
                    got.append(type(decode(pull.recv())).__name__)
                    quiet_since = time.monotonic()
        finally:
            pull.close(0)
            ctx.term()
        assert metric(c, "epd_pool_instances", pool="pd", state="dead") == 0
        assert metric(c, "epd_pool_instances", pool="pd", state="live") == 0
        c.start_worker("prefill", "prefill-new")
        c.start_worker("decode", "decode-new")
        c.wait_registered("prefill-new", "decode-new")
        r = c.complete(_prompt(1), 4)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        workers = httpx.get(c.url + "/epd/workers", timeout=30).json()
        assert sorted(workers) == ["decode-new", "prefill-new"]


# ---- item 8: a wedged worker is not alive ------------------------------------------------
def test_a_worker_with_a_wedged_main_loop_gets_no_traffic_and_its_live_probe_fails(llama_dir):
    """Two pd workers, round robin; ``pd-wedge``'s main loop blocks handling its first
    GenerateRequest (the fault-injection seam) while its heartbeat thread goes on. The
    router sees its loop count stop, retries the request on ``pd-ok`` and routes nothing
    more to it; its ``/live`` answers 503 (a Kubernetes liveness probe restarts it)."""
    wedge = {"EPD_INJECT_HANDLER_ERROR": "GenerateRequest:stall:1"}
    with cluster(llama_dir, "pd:2", "--prefill-routing", "round-robin", "--stage-timeout", "60",
                 "--token-timeout", "60") as c:
        c.start_worker("pd", "pd-ok", "--stall-timeout", "3")
        c.start_worker("pd", "pd-wedge", "--stall-timeout", "3", env=wedge)
        c.wait_registered("pd-ok", "pd-wedge")
        assert c.live("pd-wedge").status_code == 200
        for i in range(4):  # the 2nd goes to pd-wedge (round robin) and wedges it
            r = c.complete(_prompt(i), 8, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
        assert metric(c, "epd_routing_decisions_total", instance="pd-wedge") == 1
        assert metric(c, "epd_routing_decisions_total", instance="pd-ok") == 4
        assert metric(c, "epd_worker_failures_total", instance="pd-wedge") == 1
        live = c.live("pd-wedge")
        assert live.status_code == 503 and live.json()["loop_stalled"] is True
        assert c.live("pd-ok").status_code == 200


# ---- item 9: `epd serve` validates against the workers' max_model_len ----------------------
def test_serve_refuses_a_request_over_the_smallest_live_max_model_len(llama_dir):
    """The decode worker serves 128 tokens, the prefill worker 256, the model 2048: the API
    of `epd serve` (started before any worker joined) answers 400 for a prompt or a
    prompt + max_tokens over 128, naming the field, instead of letting the decode worker
    refuse it or cut it short; one that fits is served."""
    with cluster(llama_dir, "p:1,d:1") as c:
        c.start_worker("prefill", "prefill-256", "--max-model-len", "256")
        c.start_worker("decode", "decode-128", "--max-model-len", "128")
        c.wait_registered("prefill-256", "decode-128")
        assert httpx.get(c.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 128
        assert_error(c.complete(_prompt(0, 150), 4), 400, "max_model_len is 128", "prompt")
        assert_error(c.complete(_prompt(1, 100), 40), 400, r"exceeds max_model_len \(128\)", "max_tokens")
        r = c.complete(_prompt(2, 100), 20)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 20
