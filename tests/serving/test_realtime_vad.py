"""Server VAD on ``/v1/realtime`` (OpenAI's default ``turn_detection``), driven by the
official openai SDK's realtime client at its defaults: no commit, no response.create.

Speech is tests/data/speech/capital_of_france.wav (2.58 s, "What is the capital of
France?") between stretches of silence; noise is seeded white noise. Answers are
checked by parity with the offline engine on the transcript.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from tests.serving.test_realtime import _slots_free, append_speech, connect, offline, pcm16, server, until  # noqa: F401

pytestmark = pytest.mark.slow
RATE = 24000
CLIP_MS = 2577  # capital_of_france.wav


def silence(ms: int) -> bytes:
    return bytes(RATE * 2 * ms // 1000)


def noise(ms: int, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).standard_normal(RATE * ms // 1000) * 0.05 * 32767
    return x.clip(-32768, 32767).astype("<i2").tobytes()


async def configure(conn, **session) -> None:
    await conn.session.update(session={"type": "realtime", **session})
    upd = await until(conn, lambda e: e.type in ("session.updated", "error"))
    assert upd.type == "session.updated", upd


def test_a_spoken_turn_is_detected_committed_and_answered(server, offline):
    async def go():
        log: list = []
        async with connect(server) as conn:
            created = await until(conn, lambda e: e.type == "session.created")
            assert created.session.audio.input.turn_detection.type == "server_vad"  # OpenAI's default
            await configure(conn, max_output_tokens=16)
            audio = silence(1000) + pcm16("capital_of_france.wav", RATE) + silence(1000)
            await append_speech(conn, audio, RATE)
            done = await until(conn, lambda e: e.type == "response.done", log)
            return log, done

    log, done = asyncio.run(go())
    kinds = [e.type for e in log]
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.added", "response.created", "response.done"]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds
    started, stopped, committed = (next(e for e in log if e.type == k) for k in order[:3])
    assert started.item_id == stopped.item_id == committed.item_id
    assert 1000 - 300 - 100 <= started.audio_start_ms <= 1000 + 300  # the onset, less the prefix padding
    assert started.audio_start_ms + 1500 <= stopped.audio_end_ms <= 1000 + CLIP_MS + 100
    added = next(e for e in log if e.type == "conversation.item.added")
    assert added.item.id == committed.item_id and added.item.role == "user"
    heard = next(e for e in log if e.type == "conversation.item.input_audio_transcription.completed")
    assert heard.transcript == "What is the capital of France?"  # transcribed from the turn's pause, or whole
    deltas = [e for e in log if e.type == "conversation.item.input_audio_transcription.delta"]
    assert [(e.item_id, e.delta) for e in deltas] == [(committed.item_id, heard.transcript)]
    assert log.index(deltas[0]) < log.index(heard)
    r = done.response
    assert r.status in ("completed", "incomplete") and r.output[0].role == "assistant"
    assert r.output[0].content[0].text == offline([{"role": "user", "content": heard.transcript}], 16)
    # the assistant item is added and done (pipecat keeps its context from these)
    assert any(e.type == "conversation.item.added" and e.item.role == "assistant" for e in log)
    assert any(e.type == "conversation.item.done" and e.item.id == r.output[0].id for e in log)


def test_noise_and_silence_alone_start_no_turn(server):
    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await configure(conn, max_output_tokens=2)
            await append_speech(conn, silence(1000) + noise(3000) + silence(1000), RATE)
            # a text turn after it: every event of the audio has arrived by its response.done
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create()
            await until(conn, lambda e: e.type == "response.done", log)
            return log

    log = asyncio.run(go())
    assert not [e.type for e in log if e.type.startswith("input_audio_buffer.")], [e.type for e in log]


def test_speech_over_an_answer_cancels_it_and_is_answered(server):
    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await configure(conn, max_output_tokens=400)
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me a long story about the sea."}]})
            await conn.response.create()
            first = await until(conn, lambda e: e.type == "response.output_text.delta", log)
            await append_speech(conn, pcm16("capital_of_france.wav", RATE) + silence(1000), RATE)
            cancelled = await until(conn, lambda e: e.type == "response.done", log)
            answered = await until(conn, lambda e: e.type == "response.done", log)
            freed = False  # the cancelled answer's decode slot and blocks are back
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                for _ in range(100):
                    stats = {k: v for k, v in (await http.get("/epd/workers")).json().items()
                             if k.startswith("decode")}
                    if _slots_free(stats):
                        freed = True
                        break
                    await asyncio.sleep(0.3)
            return log, first, cancelled, answered, freed

    log, first, cancelled, answered, freed = asyncio.run(go())
    assert cancelled.response.id == first.response_id and cancelled.response.status == "cancelled"
    assert cancelled.response.status_details.reason == "turn_detected"
    kinds = [e.type for e in log]
    assert kinds.index("input_audio_buffer.speech_started") < log.index(cancelled)  # cancelled on speech onset
    heard = next(e for e in log if e.type == "conversation.item.input_audio_transcription.completed")
    assert heard.transcript == "What is the capital of France?"
    assert answered.response.status in ("completed", "incomplete") and answered.response.usage.output_tokens > 0
    assert "Paris" in answered.response.output[0].content[0].text
    assert freed, "the cancelled answer's decode slot was not freed"


def test_manual_commits_with_turn_detection_null(server):
    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await configure(conn, audio={"input": {"turn_detection": None}}, max_output_tokens=4)
            await append_speech(conn, pcm16("capital_of_france.wav", RATE) + silence(1000), RATE)
            await conn.conversation.item.retrieve(item_id="item_missing", event_id="evt_missing")
            err = await until(conn, lambda e: e.type == "error", log)
            await conn.input_audio_buffer.commit()
            committed = await until(conn, lambda e: e.type == "input_audio_buffer.committed", log)
            await conn.conversation.item.retrieve(item_id=committed.item_id)
            got = await until(conn, lambda e: e.type == "conversation.item.retrieved", log)
            return log, err, committed, got

    log, err, committed, got = asyncio.run(go())
    assert not [e for e in log if e.type.startswith("input_audio_buffer.speech")]
    assert err.error.code == "item_not_found" and err.error.event_id == "evt_missing"
    assert got.item.id == committed.item_id and got.item.role == "user"


def test_silence_past_idle_timeout_after_an_answer_triggers_a_prompt(server):
    """OpenAI's ``idle_timeout_ms``: silence that long after a response sends
    ``input_audio_buffer.timeout_triggered``, commits the silence and answers it; the
    clock is the input audio's, so the test streams 6 s of silence as fast as it can."""
    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await configure(conn, max_output_tokens=4, audio={"input": {"turn_detection": {
                "type": "server_vad", "idle_timeout_ms": 5000}}})
            await append_speech(conn, silence(6000), RATE)  # before any response: no timeout
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create()
            first = await until(conn, lambda e: e.type == "response.done", log)
            await append_speech(conn, silence(4000), RATE)
            await append_speech(conn, silence(2000), RATE)
            timeout = await until(conn, lambda e: e.type == "input_audio_buffer.timeout_triggered", log)
            prompted = await until(conn, lambda e: e.type == "response.done", log)
            return log, first, timeout, prompted

    log, first, timeout, prompted = asyncio.run(go())
    kinds = [e.type for e in log]
    assert kinds.count("input_audio_buffer.timeout_triggered") == 1
    assert log.index(first) < log.index(timeout)
    assert timeout.audio_start_ms >= 6000 and timeout.audio_end_ms - timeout.audio_start_ms >= 5000
    assert timeout.audio_end_ms <= 12000
    committed = [e for e in log if e.type == "input_audio_buffer.committed"]
    assert [e.item_id for e in committed] == [timeout.item_id]
    assert prompted.response.id != first.response.id and prompted.response.status in ("completed", "incomplete")
