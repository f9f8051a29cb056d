"""Issue 34 items 6 and 12d replayed as a client would trigger them: real ``epd launch``
(the default text model, the Whisper speech front end on the E pool), the openai SDK's
realtime client.

- Transcriptions are admitted encode jobs: with ``--max-pending-requests 2`` a third
  clip transcribing at once is refused (``rate_limit_exceeded``), not added; a loop that
  creates and deletes ~4 MB clips stops each transcription with its item, so the
  router's open requests return to 0 and no transcript of a deleted item follows it.
- Idle sessions are closed (``--realtime-idle-timeout``): two idle sockets holding
  both of ``--max-realtime-sessions 2`` lock a third client out only until they are
  reaped (an ``error`` event ``session_idle_timeout``, close code 1000); then it connects.
"""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as F
from websockets.exceptions import ConnectionClosed

from epd.api.realtime.protocol import MAX_APPEND_BYTES
from tests.serving.conftest import launch
from tests.serving.public_bugs_helpers import metric
from tests.serving.test_realtime import connect, until

pytestmark = pytest.mark.slow
SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
TIMEOUT_S = 300  # a generous bound for things that must happen, never a latency check
IDLE_S = 8  # the server's --realtime-idle-timeout
TRANSCRIPTION = "conversation.item.input_audio_transcription."


@pytest.fixture(scope="module")
def server():
    with launch(None, "e:1,pd:1", "--kv-cache-memory-gb", "0.2", "--max-pending-requests", "2",
                "--max-realtime-sessions", "2", "--realtime-idle-timeout", str(IDLE_S), timeout_s=900) as s:
        yield s


@pytest.fixture(scope="module")
def clip() -> str:
    """80 s of speech (the 40 s recording twice) as base64 PCM16 at 24 kHz: just under 4 MiB."""
    audio, sr = sf.read(SPEECH / "long_40s.wav", dtype="float32")
    pcm = (F.resample(torch.from_numpy(audio), sr, 24000).clamp(-1, 1) * 32767).round().to(torch.int16).numpy()
    data = np.tile(pcm, 2).tobytes()
    assert 3 * 2**20 < len(data) <= MAX_APPEND_BYTES
    return base64.b64encode(data).decode()


def audio_item(item_id: str, clip: str) -> dict:
    return {"id": item_id, "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": clip}]}


def wait_no_router_requests(server) -> None:
    """Bounded wait until the router holds no request (transcriptions included)."""
    deadline = time.monotonic() + TIMEOUT_S
    while metric(server, "epd_router_requests") != 0:
        assert time.monotonic() < deadline, "the router still holds requests"
        time.sleep(0.2)


def test_idle_sessions_are_closed_and_free_their_slots(server):
    async def go():
        async with connect(server) as a, connect(server) as b:  # both slots, then nothing is sent
            for conn in (a, b):
                assert (await until(conn, lambda e: True)).type == "session.created"
            async with connect(server) as c:
                err = await until(c, lambda e: True)
                assert err.type == "error" and err.error.code == "session_limit_reached"
            for conn in (a, b):
                err = await until(conn, lambda e: True)
                assert err.type == "error" and err.error.code == "session_idle_timeout"
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(conn.recv(), TIMEOUT_S)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
        async with connect(server) as d:  # the slots are free again
            assert (await until(d, lambda e: True)).type == "session.created"

    asyncio.run(go())


def test_the_third_concurrent_transcription_is_refused_and_not_added(server, clip):
    async def go():
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            for i in range(3):  # at once: two fill --max-pending-requests 2, the third is over it
                await conn.conversation.item.create(item=audio_item(f"clip{i}", clip), event_id=f"create{i}")
            outcomes = []
            while len(outcomes) < 3:
                ev = await until(conn, lambda e: e.type in ("conversation.item.added", "error"))
                outcomes.append(ev.item.id if ev.type == "conversation.item.added" else ev.error)
            assert outcomes[:2] == ["clip0", "clip1"]
            assert outcomes[2].code == "rate_limit_exceeded" and outcomes[2].event_id == "create2"
            await conn.conversation.item.retrieve(item_id="clip2")
            err = await until(conn, lambda e: e.type in ("conversation.item.retrieved", "error"))
            assert err.type == "error" and err.error.code == "item_not_found"  # refused work is not kept
            for i in range(2):
                await conn.conversation.item.delete(item_id=f"clip{i}")
                await until(conn, lambda e: e.type == "conversation.item.deleted")
            await conn.conversation.item.create(item=audio_item("clip2", clip))  # the slots came back
            ev = await until(conn, lambda e: e.type in ("conversation.item.added", "error"))
            assert ev.type == "conversation.item.added", ev
            await conn.conversation.item.delete(item_id="clip2")
            await until(conn, lambda e: e.type == "conversation.item.deleted")
            await asyncio.to_thread(wait_no_router_requests, server)

    asyncio.run(go())


def test_a_create_delete_loop_of_4mb_clips_leaves_no_encode_work(server, clip):
    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            for i in range(8):  # four times the limit in all, never over it at once
                await conn.conversation.item.create(item=audio_item(f"loop{i}", clip))
                await conn.conversation.item.delete(item_id=f"loop{i}")
                await until(conn, lambda e: e.type == "conversation.item.deleted" and e.item_id == f"loop{i}", log)
            await asyncio.to_thread(wait_no_router_requests, server)  # every ASR request was ended
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "hi"}]})
            await until(conn, lambda e: e.type == "conversation.item.done", log)
        assert not [e for e in log if e.type == "error"]
        deleted: set[str] = set()
        for e in log:
            if e.type == "conversation.item.deleted":
                deleted.add(e.item_id)
            elif e.type.startswith(TRANSCRIPTION):
                assert e.item_id not in deleted, f"{e.type} of {e.item_id} after its deletion"

    asyncio.run(go())
