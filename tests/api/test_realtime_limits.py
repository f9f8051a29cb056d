"""``/v1/realtime`` limits and the handshake's Origin check (review defect 6).

The real app (``build_app``) served by uvicorn in the test's own event loop, with a
router stub and the tiny tokenizer (no worker processes), driven by a raw
``websockets`` client: a browser page's Origin is refused unless allowed, sessions
past ``max_realtime_sessions`` are refused with close code 1013, realtime responses
count toward ``max_pending_requests`` (HTTP gets 429, a response gets an error event
and the session goes on), a client that stops reading is closed with 1008 while the
server's outbound queue stays bounded, and ``/epd/workers`` needs the API key.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from epd.api.app import build_app
from epd.api.realtime import session as realtime
from epd.api.realtime import transcribe
from epd.api.server import ApiSettings
from epd.encoders.processor import ProcessedPrompt
from epd.models.tiny import build_tiny_tokenizer
from epd.router.request import TokenEvent

WAIT_S = 60  # a generous bound for things that must happen, never a latency check


class StubRouter:
    """Every response holds its request in flight until ``gate`` opens, then ends with one token;
    every transcription (``transcribing``: how many are in flight) until ``asr_gate`` opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.asr_gate = asyncio.Event()
        self.transcribing = 0

    async def transcribe(self, request_id, items):
        self.transcribing += 1
        try:
            await self.asr_gate.wait()
            return ["heard"]
        finally:
            self.transcribing -= 1

    def has_pool(self, role):  # no tts pool: sessions answer in text
        return False

    def max_model_len(self, limit: int) -> int:  # no worker serves less than the API's own
        return limit

    async def generate(self, req):
        await self.gate.wait()
        yield TokenEvent([69], finished=True, finish_reason="stop")

    async def worker_stats(self, timeout_s: float = 5.0) -> dict:
        return {"pd-0": {"num_free_blocks": 1.0}}


@contextlib.asynccontextmanager
async def serving(**settings):
    processor = SimpleNamespace(modalities={"audio": "transcribe"}, placeholder_ids={}, max_items_per_prompt=16,
                                process=lambda ids, mm: ProcessedPrompt(list(ids), [], []),
                                audio_item=lambda pcm_rate: pcm_rate)
    router = StubRouter()
    app = build_app(router, build_tiny_tokenizer(), processor, model_name="m", max_model_len=1024,
                    settings=ApiSettings(**settings), vocab_size=512)
    api = next(r.endpoint.__self__ for r in app.routes if getattr(r, "path", "") == "/v1/realtime")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    port = sock.getsockname()[1]
    try:
        yield SimpleNamespace(api=api, router=router, ws=f"ws://127.0.0.1:{port}/v1/realtime",
                              http=f"http://127.0.0.1:{port}")
    finally:
        router.gate.set()
        router.asr_gate.set()
        server.should_exit = True
        await task


def ws_connect(url: str, **kw):
    return connect(url, proxy=None, compression=None, open_timeout=WAIT_S, **kw)


async def recv(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))


async def until(ws, kind: str) -> dict:
    while (ev := await recv(ws))["type"] != kind:
        pass
    return ev


async def eventually(pred) -> None:
    for _ in range(WAIT_S * 100):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_origin_header_is_checked_against_the_allowlist():
    async def main():
        async with serving() as s:  # default: no browser origin allowed
            async with ws_connect(s.ws) as ws:  # a non-browser client sends no Origin
                assert (await recv(ws))["type"] == "session.created"
            with pytest.raises(InvalidStatus) as e:
                async with ws_connect(s.ws, origin="http://evil.example"):
                    pass
            assert e.value.response.status_code == 403
        async with serving(allowed_origins=("http://app.example",)) as s:
            async with ws_connect(s.ws, origin="http://app.example") as ws:
                assert (await recv(ws))["type"] == "session.created"
            with pytest.raises(InvalidStatus):
                async with ws_connect(s.ws, origin="http://evil.example"):
                    pass
            assert not s.api.sessions

    asyncio.run(main())


def test_sessions_over_the_limit_are_refused_with_1013():
    async def main():
        async with serving(max_realtime_sessions=2) as s:
            async with ws_connect(s.ws) as a, ws_connect(s.ws) as b:
                for ws in (a, b):
                    assert (await recv(ws))["type"] == "session.created"
                async with ws_connect(s.ws) as c:
                    err = await recv(c)
                    assert err["type"] == "error" and err["error"]["code"] == "session_limit_reached"
                    with pytest.raises(ConnectionClosed):
                        await recv(c)
                    assert c.close_code == 1013
                assert len(s.api.sessions) == 2
            await eventually(lambda: not s.api.sessions)
            async with ws_connect(s.ws) as d:  # slots are given back
                assert (await recv(d))["type"] == "session.created"

    asyncio.run(main())


def _text_turn() -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})


def test_realtime_responses_count_toward_max_pending_requests():
    async def main():
        async with serving(max_pending_requests=1) as s, httpx.AsyncClient(timeout=WAIT_S) as http:
            async with ws_connect(s.ws) as a, ws_connect(s.ws) as b:
                for ws in (a, b):
                    await ws.send(_text_turn())
                    await until(ws, "conversation.item.created")
                await a.send(json.dumps({"type": "response.create"}))
                await until(a, "response.created")  # holds the one slot until the gate opens
                r = await http.post(s.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
                await b.send(json.dumps({"type": "response.create", "event_id": "evt_b"}))
                err = await until(b, "error")
                assert err["error"]["code"] == "rate_limit_exceeded" and err["error"]["event_id"] == "evt_b"
                await b.send(json.dumps({"type": "session.update", "session": {"instructions": "x"}}))
                assert (await recv(b))["type"] == "session.updated"  # the session goes on
                s.router.gate.set()
                done = await until(a, "response.done")
                assert done["response"]["status"] == "completed"
                await eventually(lambda: s.api.state.pending == 0)  # released when the response ended
                await b.send(json.dumps({"type": "response.create"}))
                assert (await until(b, "response.done"))["response"]["status"] == "completed"

    asyncio.run(main())


def test_a_client_that_stops_reading_is_closed_with_1008_and_the_queue_stays_bounded(monkeypatch):
    limit = 256 * 1024
    monkeypatch.setattr(realtime, "MAX_OUTBOUND_BYTES", limit)
    peak = {"bytes": 0}
    emit = realtime.RealtimeSession.emit

    def recording_emit(self, *a, **kw):
        emit(self, *a, **kw)
        peak["bytes"] = max(peak["bytes"], self.channel.out_bytes)

    monkeypatch.setattr(realtime.RealtimeSession, "emit", recording_emit)

    async def main():
        async with serving() as s:
            # max_queue=1: the client library stops reading the socket while a message waits unread
            async with ws_connect(s.ws, max_queue=1, max_size=None) as ws:
                await eventually(lambda: len(s.api.sessions) == 1)
                (session,) = s.api.sessions
                sent = 0
                while not session.channel.closing:  # each update is echoed in session.updated; nothing is read
                    text = os.urandom(16 * 1024).hex()
                    try:
                        await asyncio.wait_for(ws.send(json.dumps({"type": "session.update",
                                                                   "session": {"instructions": text}})), 5)
                    except TimeoutError:  # the server stopped reading us: it is closing
                        break
                    sent += 1
                    assert sent < 100_000
                await eventually(lambda: session.channel.closing)
                assert session.channel.out_bytes == 0 and session.out.empty()  # what was queued is dropped
                with pytest.raises(ConnectionClosed):  # reading again: what the kernel held, then the close
                    while True:
                        await asyncio.wait_for(ws.recv(), WAIT_S)
                assert ws.close_code == 1008
            await eventually(lambda: not s.api.sessions)
        assert 0 < peak["bytes"] <= limit

    asyncio.run(main())


def test_worker_stats_need_the_api_key():
    async def main():
        async with serving(api_key="k") as s, httpx.AsyncClient(timeout=WAIT_S) as http:
            r = await http.get(s.http + "/epd/workers")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await http.get(s.http + "/epd/workers", headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json() == {"pd-0": {"num_free_blocks": 1.0}}
        async with serving() as s, httpx.AsyncClient(timeout=WAIT_S) as http:  # no key set: open
            assert (await http.get(s.http + "/epd/workers")).status_code == 200

    asyncio.run(main())


def _audio_item(item_id: str, event_id: str = "e") -> str:
    """A user item with 200 ms of (silent) PCM16 at 24 kHz: one transcription for a text-only model."""
    audio = base64.b64encode(bytes(9_600)).decode()
    return json.dumps({"type": "conversation.item.create", "event_id": event_id, "item": {
        "id": item_id, "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}})


def _jobs(api) -> int:
    """Encode jobs (transcriptions) the realtime sessions hold."""
    return sum(len(s.asr.jobs) for s in api.sessions)


def test_transcriptions_count_toward_max_pending_requests_and_end_with_their_item():
    async def main():
        async with serving(max_pending_requests=2) as s, httpx.AsyncClient(timeout=WAIT_S) as http:
            async with ws_connect(s.ws) as ws:
                for i in (1, 2):
                    await ws.send(_audio_item(f"a{i}"))
                    await until(ws, "conversation.item.added")
                await eventually(lambda: s.router.transcribing == 2)
                assert s.api.state.pending == 2
                await ws.send(_audio_item("a3", event_id="over"))
                err = await until(ws, "error")
                assert err["error"]["code"] == "rate_limit_exceeded" and err["error"]["event_id"] == "over"
                await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "a3"}))
                assert (await until(ws, "error"))["error"]["code"] == "item_not_found"  # refused: not added
                r = await http.post(s.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert r.status_code == 429  # the server's limit is one, shared with HTTP
                await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "a1"}))
                await until(ws, "conversation.item.deleted")
                await eventually(lambda: s.router.transcribing == 1)  # its ASR request was cancelled
                await eventually(lambda: s.api.state.pending == 1)
                await ws.send(_audio_item("a3"))
                await until(ws, "conversation.item.added")
                await eventually(lambda: s.router.transcribing == 2)
            # session closed: every transcription it started ends, and every slot comes back
            await eventually(lambda: s.router.transcribing == 0 and s.api.state.pending == 0 and not s.api.sessions)

    asyncio.run(main())


def test_a_session_holds_at_most_its_own_number_of_transcriptions(monkeypatch):
    monkeypatch.setattr(transcribe, "MAX_SESSION_TRANSCRIPTIONS", 2)

    async def main():
        async with serving() as s:
            async with ws_connect(s.ws) as a, ws_connect(s.ws) as b:
                for i in (1, 2):
                    await a.send(_audio_item(f"a{i}"))
                    await until(a, "conversation.item.added")
                await a.send(_audio_item("a3", event_id="over"))
                err = await until(a, "error")
                assert err["error"]["code"] == "rate_limit_exceeded" and err["error"]["event_id"] == "over"
                await b.send(_audio_item("b1"))  # another session's transcriptions are its own
                await until(b, "conversation.item.added")
                await eventually(lambda: s.router.transcribing == 3)
                s.router.asr_gate.set()
                done = await until(a, "conversation.item.input_audio_transcription.completed")
                assert done["transcript"] == "heard"
                await eventually(lambda: _jobs(s.api) == 0)
                await a.send(_audio_item("a3"))  # the slots came back
                completed = "conversation.item.input_audio_transcription.completed"
                while (ev := await until(a, completed))["item_id"] != "a3":
                    assert ev["item_id"] == "a2"
            await eventually(lambda: s.api.state.pending == 0)

    asyncio.run(main())


def test_a_create_delete_loop_of_audio_items_leaves_no_transcription_running():
    async def main():
        async with serving(max_pending_requests=2) as s:
            async with ws_connect(s.ws) as ws:
                for i in range(20):  # over the limit in all, never over it at once
                    await ws.send(_audio_item(f"a{i}"))
                    await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": f"a{i}"}))
                    assert (await until(ws, "conversation.item.deleted"))["item_id"] == f"a{i}"
                await eventually(lambda: s.router.transcribing == 0 and _jobs(s.api) == 0)
                assert s.api.state.pending == 0
                s.router.asr_gate.set()
                await ws.send(_text_turn())  # nothing of the deleted items is reported after their deletion
                log = []
                while (ev := await recv(ws))["type"] != "conversation.item.done":
                    log.append(ev)
                assert not [e for e in log if e["type"].startswith("conversation.item.input_audio_transcription")
                            or e["type"] == "error"]

    asyncio.run(main())


def test_an_idle_session_is_closed_and_frees_its_slot():
    async def main():
        async with serving(max_realtime_sessions=1, realtime_idle_timeout_s=0.5) as s:
            async with ws_connect(s.ws) as ws:  # connects, then sends nothing
                assert (await recv(ws))["type"] == "session.created"
                err = await recv(ws)
                assert err["type"] == "error" and err["error"]["code"] == "session_idle_timeout"
                with pytest.raises(ConnectionClosed):
                    await recv(ws)
                assert ws.close_code == 1000
            await eventually(lambda: not s.api.sessions)
            # a client that never reads its events is reaped too
            async with ws_connect(s.ws, max_queue=1):
                await eventually(lambda: len(s.api.sessions) == 1)
                await eventually(lambda: not s.api.sessions)
            async with ws_connect(s.ws) as ws:  # the slot is free again
                assert (await recv(ws))["type"] == "session.created"

    asyncio.run(main())


def test_a_session_waiting_for_its_response_is_not_idle():
    async def main():
        async with serving(realtime_idle_timeout_s=0.3) as s:
            async with ws_connect(s.ws) as ws:
                await ws.send(_text_turn())
                await ws.send(json.dumps({"type": "response.create"}))
                await until(ws, "response.created")
                await asyncio.sleep(1.5)  # well past the idle timeout while the response is held
                assert len(s.api.sessions) == 1
                s.router.gate.set()
                assert (await until(ws, "response.done"))["response"]["status"] == "completed"
                assert (await until(ws, "error"))["error"]["code"] == "session_idle_timeout"  # idle from now
                with pytest.raises(ConnectionClosed):
                    await recv(ws)
            await eventually(lambda: not s.api.sessions)

    asyncio.run(main())


def test_the_idle_timeout_flag_reaches_the_api_settings_on_launch_and_serve():
    from epd.cli import build_parser
    from epd.launch.api_process import api_settings
    from epd.launch.config import LaunchConfig

    def settings(*argv: str) -> ApiSettings:
        return api_settings(LaunchConfig.from_args(build_parser().parse_args(list(argv))))

    assert settings("launch").realtime_idle_timeout_s == 600.0  # on by default
    assert settings("launch", "--realtime-idle-timeout", "2.5").realtime_idle_timeout_s == 2.5
    assert settings("serve", "--realtime-idle-timeout", "0").realtime_idle_timeout_s is None  # 0: never
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--realtime-idle-timeout", "-1"])
