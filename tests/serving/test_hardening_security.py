"""Issue 34, items 11 and 12 (security), replayed as an operator or a client would meet them.

- A process holding the *member* key (what every worker and encoder holds) connects to a
  worker's command socket and sends ``Shutdown``, ``PeerInfo`` and ``Registered``: the
  handshake is refused (counted on ``epd_auth_denied_total``), the worker keeps serving,
  and the router's own commands (requests, pings) still reach it.
- The worker's health port: idle connections past its cap hold no thread each, and
  ``/live`` still answers.
- ``--require-api-key`` without a key refuses to start, naming the fix.
"""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest
import zmq

from epd.messages import PeerInfo, Registered, Shutdown, encode
from epd.models.tiny import create_tiny_model
from tests.serving.conftest import launch
from tests.serving.public_bugs_helpers import metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("security") / "llama"))


def _cmd_endpoint(output: str, instance: str) -> str:
    """Worker ``instance``'s command endpoint, from the line it prints when it starts."""
    m = re.search(rf"epd worker {re.escape(instance)} .*?commands on (tcp://\S+?),? ", output)
    assert m, output
    return m.group(1)


def _ask(server, text: str) -> str:
    client = server.client()
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": text}],
                                       max_tokens=6, temperature=0)
    return r.choices[0].message.content


def test_a_member_key_cannot_command_a_worker(llama_dir, tmp_path):
    """Issue 34 item 11: the member key (any worker's or encoder's) opens no worker's
    command socket; only the router's key does."""
    from epd.cluster_auth import MEMBER, generate_keys, load_keys

    keys = tmp_path / "keys"
    generate_keys(keys)
    with launch(llama_dir, "pd:1", "--cluster-keys", str(keys), "--block-size", "16", "--num-kv-blocks", "64") as s:
        before = _ask(s, "hello")
        endpoint = _cmd_endpoint(s.output, "pd-0")
        member = load_keys(keys, MEMBER)
        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            member.client(push)  # a CURVE client with the member key pair, as a worker's process holds it,
            push.curve_serverkey = member.public  # which knows the worker's server key: the member key
            push.connect(endpoint)
            for msg in (Registered("pd-0", 12345), PeerInfo("evil-0", b"\0" * 64, [], None, 1), Shutdown()):
                try:
                    push.send(encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the handshake never completes: nothing can be queued
            deadline = time.monotonic() + 60  # ZeroMQ retries the refused handshake: each is counted
            while metric(s, "epd_auth_denied_total", pool="pd", instance="pd-0") < 1:
                assert time.monotonic() < deadline, "the worker did not refuse the member key"
                time.sleep(0.2)
        finally:
            ctx.destroy(linger=0)
        assert s.proc.poll() is None and "pd-0" in s.workers()
        assert _ask(s, "hello") == before  # the router's commands still reach it; it serves
        assert "refused a CURVE client" in s.output and "ignores" not in s.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_idle_connections_to_the_health_port_hold_no_threads(tmp_path):
    """Issue 34 item 12: a worker's --http-port took unbounded idle connections, a thread
    each, forever. Now at most MAX_CONNECTIONS are served at once (the rest get 503), an
    idle one is closed after REQUEST_TIMEOUT_S, and /live answers again while the idle
    sockets are still open on the client's side. (A tts worker: a real worker that loads
    no model; it heartbeats, so /live is 200, with no router up.)"""
    import os
    import subprocess
    import sys

    import psutil

    from epd.workers.health_server import MAX_CONNECTIONS

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "PROMETHEUS_MULTIPROC_DIR"))}
    log = tmp_path / "tts.log"
    proc = subprocess.Popen([sys.executable, "-m", "epd.cli", "worker", "--role", "tts", "--instance-id", "tts-0",
                             "--router", f"tcp://127.0.0.1:{_free_port()}", "--http-port", str(port), "--threads",
                             "1"], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/live"
    idle: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        threads = psutil.Process(proc.pid).num_threads()
        for _ in range(3 * MAX_CONNECTIONS):  # connect, send nothing
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        time.sleep(0.5)  # let the server accept them all
        most = psutil.Process(proc.pid).num_threads()
        deadline = time.monotonic() + 60
        while True:  # /live answers while the idle sockets are still open here
            most = max(most, psutil.Process(proc.pid).num_threads())
            try:
                r = httpx.get(url, timeout=5)
                if r.status_code == 200:
                    break
                assert r.status_code == 503, r.text  # every thread busy: answered at once, not queued
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "/live never answered while idle connections were open"
            time.sleep(0.2)
        assert most <= threads + MAX_CONNECTIONS, (threads, most)
        for s in idle:  # the server closed every idle connection (after its timeout, or at once with 503)
            data = s.recv(4096)
            assert data in (b"",) or data.startswith(b"HTTP/1.0 503"), data
    finally:
        for s in idle:
            s.close()
        proc.kill()
        proc.wait()


def test_require_api_key_refuses_to_start_without_one():
    """Issue 34 item 12: `epd serve --require-api-key` (what the Kubernetes API pod runs)
    with no key, or an empty $EPD_API_KEY, exits 2 naming the fix, before anything binds."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "EPD_API_KEY"}
    for extra in ({}, {"EPD_API_KEY": ""}):
        r = subprocess.run([sys.executable, "-m", "epd.cli", "serve", "--require-api-key", "--port", str(_free_port()),
                            "--pools", "pd:1"], capture_output=True, text=True, env={**env, **extra}, timeout=300)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "no API key" in r.stderr and "--api-key" in r.stderr and "EPD_API_KEY" in r.stderr, r.stderr
