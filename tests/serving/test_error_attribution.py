"""Errors name who failed (issue 13 defect 7), with faults injected in a real prefill worker.

A fault of epd's own is a 500 ``server_error``, never a 400; a capacity failure is a
503 with ``Retry-After``; a stream that fails sends an error event before ``[DONE]``
(never a silent end); every other request carries on.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from epd.models.tiny import create_tiny_model
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("errors") / "llama"))


def _body(model: str, stream: bool) -> dict:
    return {"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0, "stream": stream}


def _stream_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("fault,count,status,etype", [
    ("internal", 2, 500, "server_error"),  # not retried: one failure per request
    ("capacity", 6, 503, "service_unavailable_error"),  # retried twice on the only instance: 3 per request
])
def test_worker_faults_are_reported_by_who_failed(llama_dir, fault, count, status, etype):
    env = {"EPD_INJECT_HANDLER_ERROR": f"PrefillRequest:{fault}:{count}"}
    with launch(llama_dir, "p:1,d:1", env=env) as server:
        r = httpx.post(server.url + "/v1/completions", json=_body(server.model, False), timeout=120)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["type"] == etype and "injected" in err["message"], err
        assert ("Retry-After" in r.headers) == (status == 503)

        events = _stream_events(server.url, _body(server.model, True))
        assert events[-1] == "[DONE]"
        failed = json.loads(events[-2])
        assert failed["error"]["type"] == etype and "injected" in failed["error"]["message"], events

        r = httpx.post(server.url + "/v1/completions", json=_body(server.model, False), timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text  # the faults are spent: served


def test_pending_limit_is_decided_before_the_body_is_read(llama_dir):
    """Defect 5 (one part): over ``--max-pending-requests`` the 429 (with Retry-After) comes
    before the API reads the body, so a client cannot make it parse 64 MB first. The
    request in flight is held in its prefill by a KV write delay."""
    env = {"EPD_INJECT_KV_WRITE_DELAY_S": "8", "EPD_INJECT_KV_WRITE_DELAY_MIN_BLOCKS": "1"}
    with launch(llama_dir, "p:1,d:1", "--max-pending-requests", "1", env=env) as server:
        first = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                 kwargs={"json": _body(server.model, False), "timeout": 120})
        first.start()
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health", timeout=30).json()["requests_in_flight"] != 1:
            assert time.monotonic() < deadline, "the first request never got in flight"
            time.sleep(0.05)
        # Headers promise 48 MB that never come: only a refusal before reading the body answers.
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 50000000\r\n\r\n{\"prompt\": \"")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, reply
                reply += chunk
        first.join()
        head, _, payload = reply.decode("latin-1").partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 429"), reply[:300]
        assert "retry-after: 1" in head.lower(), head
        assert json.loads(payload)["error"]["type"] == "rate_limit_error"
