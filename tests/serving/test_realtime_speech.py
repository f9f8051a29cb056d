"""Speech out on ``/v1/realtime``: a tts pool (``--pools e:1,pd:1,t:1``) speaks each answer
phrase by phrase, driven by the official openai SDK's realtime client at its defaults
(``output_modalities`` defaults to ``["audio"]`` when the server has a tts pool, as OpenAI's).

The transcript is checked by parity (it equals the offline engine's greedy answer); the
audio against the same synthesizer (``epd.tts``, eSpeak NG) run in this process on the
response's phrases: as long, to 5 %, and not silent.  (Not byte for byte: eSpeak's output
depends on what the process spoke before.)
"""

from __future__ import annotations

import asyncio
import base64
import warnings

import httpx
import numpy as np
import pytest

from tests.serving.conftest import launch
from tests.serving.test_realtime import append_speech, connect, offline, pcm16, until  # noqa: F401

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

pytestmark = pytest.mark.slow
RATE = 24000
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    with launch(None, "e:1,pd:1,t:1", "--kv-cache-memory-gb", "0.5") as s:
        yield s


@pytest.fixture(scope="module")
def synth():
    from epd.tts import load_synthesizer

    s = load_synthesizer("espeak")
    yield s
    s.close()


def spoken(synth, phrases: list[str], voice: str) -> bytes:
    """PCM16 at 24 kHz of ``phrases`` spoken one by one, as the tts pool speaks them."""
    return b"".join(np.ascontiguousarray(c, dtype="<i2").tobytes() for p in phrases if p.strip()
                    for c in synth.synthesize(p, voice))


async def ask(conn, text: str, **response) -> None:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create(response=response or None)


def of(log: list, kind: str, response_id: str) -> list:
    return [e for e in log if e.type == kind and e.response_id == response_id]


def test_an_audio_answer_streams_the_phrases_speech_and_its_transcript(server, offline, synth):
    async def go():
        log: list = []
        async with connect(server) as conn:
            created = await until(conn, lambda e: e.type == "session.created")
            assert created.session.output_modalities == ["audio"]  # OpenAI's default, with a tts pool
            assert created.session.audio.output.format.rate == 24000
            await conn.session.update(session={"type": "realtime", "audio": {
                "input": {"turn_detection": None}, "output": {"voice": "echo"}}})
            await ask(conn, QUESTION, max_output_tokens=24)
            done = await until(conn, lambda e: e.type == "response.done", log)
            return log, done

    log, done = asyncio.run(go())
    rid = done.response.id
    assert done.response.status in ("completed", "incomplete"), done.response.status_details
    assert done.response.output_modalities == ["audio"]
    transcript = "".join(e.delta for e in of(log, "response.output_audio_transcript.delta", rid))
    assert transcript == offline([{"role": "user", "content": QUESTION}], 24)
    assert [e.transcript for e in of(log, "response.output_audio_transcript.done", rid)] == [transcript]
    assert not of(log, "response.output_text.delta", rid)  # audio responses send transcript deltas
    assert done.response.output[0].content[0].type == "output_audio"
    assert done.response.output[0].content[0].transcript == transcript
    audio = b"".join(base64.b64decode(e.delta) for e in of(log, "response.output_audio.delta", rid))
    phrases = [e.text for e in of(log, "response.output_text.segment", rid)]
    assert "".join(phrases) == transcript
    ref = spoken(synth, phrases, "echo")  # PCM16 at 24 kHz, phrase by phrase
    assert len(audio) % 2 == 0 and abs(len(audio) - len(ref)) <= 0.05 * len(ref), (len(audio), len(ref))
    samples = np.frombuffer(audio, dtype="<i2").astype(np.float64)
    assert np.sqrt(np.mean(samples ** 2)) > 300  # speech, not silence
    assert 0.15 * len(transcript.split()) < len(audio) / 2 / RATE < 3.0 * len(transcript.split()) + 1
    kinds = [e.type for e in log]
    last_audio = max(i for i, k in enumerate(kinds) if k == "response.output_audio.delta")
    assert last_audio < kinds.index("response.output_audio.done") < kinds.index("response.done")


def test_g711_out_truncate_and_voice_errors(server, offline, synth):
    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {
                "input": {"turn_detection": None}, "output": {"format": {"type": "audio/pcmu"}, "voice": "nobody"}}})
            bad = await until(conn, lambda e: e.type in ("error", "session.updated"), log)
            await conn.session.update(session={"type": "realtime", "audio": {
                "input": {"turn_detection": None}, "output": {"format": {"type": "audio/pcmu"}}}})
            await until(conn, lambda e: e.type == "session.updated", log)
            await ask(conn, QUESTION, max_output_tokens=24)
            done = await until(conn, lambda e: e.type == "response.done", log)
            item = done.response.output[0]
            await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=10**6)
            too_far = await until(conn, lambda e: e.type in ("error", "conversation.item.truncated"), log)
            await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=-5)
            negative = await until(conn, lambda e: e.type in ("error", "conversation.item.truncated"), log)
            user = next(e.item for e in log if e.type == "conversation.item.added" and e.item.role == "user")
            await conn.conversation.item.truncate(item_id=user.id, content_index=0, audio_end_ms=0)
            not_audio = await until(conn, lambda e: e.type in ("error", "conversation.item.truncated"), log)
            await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=600)
            cut = await until(conn, lambda e: e.type in ("error", "conversation.item.truncated"), log)
            await conn.conversation.item.retrieve(item_id=item.id)
            got = await until(conn, lambda e: e.type == "conversation.item.retrieved", log)
            return log, bad, done, too_far, negative, not_audio, cut, got

    log, bad, done, too_far, negative, not_audio, cut, got = asyncio.run(go())
    assert bad.type == "error" and bad.error.code == "invalid_voice" and "alloy" in bad.error.message
    rid = done.response.id
    ulaw = b"".join(base64.b64decode(e.delta) for e in of(log, "response.output_audio.delta", rid))
    phrases = [e.text for e in of(log, "response.output_text.segment", rid)]
    ref = spoken(synth, phrases, "alloy")
    # one byte per sample at 8 kHz: a third of the 24 kHz samples, to a sample per chunk
    assert abs(len(ulaw) - len(ref) // 2 / 3) <= 0.05 * len(ref) // 2 / 3
    pcm8 = np.frombuffer(audioop.ulaw2lin(ulaw, 2), dtype="<i2")
    assert np.sqrt(np.mean(pcm8.astype(np.float64) ** 2)) > 300  # speech, not silence
    assert too_far.type == "error" and too_far.error.param == "audio_end_ms"
    assert negative.type == "error" and negative.error.param == "audio_end_ms"
    assert "must be >= 0" in negative.error.message, negative.error.message
    # the item is the mistake (a user message), not the content index
    assert not_audio.type == "error" and not_audio.error.param == "item_id", not_audio.error
    assert cut.type == "conversation.item.truncated" and cut.audio_end_ms == 600
    full = done.response.output[0].content[0].transcript
    heard = got.item.content[0].transcript
    assert len(heard) < len(full) and full.startswith(heard), (heard, full)


def test_speech_over_a_spoken_answer_cancels_it_and_frees_decode_and_tts(server):
    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await ask(conn, "Tell me a long story about the sea.", max_output_tokens=300)
            first = await until(conn, lambda e: e.type == "response.output_audio.delta", log)
            silence = bytes(RATE * 2)
            await append_speech(conn, pcm16("capital_of_france.wav", RATE) + silence, RATE)
            cancelled = await until(conn, lambda e: e.type == "response.done", log)
            answered = await until(conn, lambda e: e.type == "response.done", log)
            freed = False
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                for _ in range(100):
                    stats = (await http.get("/epd/workers")).json()
                    pd = {k: v for k, v in stats.items() if k.startswith("pd")}
                    tts = [v for k, v in stats.items() if k.startswith("tts")]
                    if all(v["num_running"] == 0 and v["num_free_blocks"] == v["num_blocks"]
                           for v in pd.values()) and all(v.get("num_running") == 0 and v.get("num_waiting") == 0
                                               for v in tts):
                        freed = True
                        break
                    await asyncio.sleep(0.3)
            return log, first, cancelled, answered, freed

    log, first, cancelled, answered, freed = asyncio.run(go())
    assert cancelled.response.id == first.response_id and cancelled.response.status == "cancelled"
    kinds = [e.type for e in log]
    started = kinds.index("input_audio_buffer.speech_started")
    assert started < log.index(cancelled)
    # no audio of the cancelled response after its response.done
    assert not [e for e in log[log.index(cancelled):] if e.type == "response.output_audio.delta"
                and e.response_id == cancelled.response.id]
    spoken_part = cancelled.response.output[0].content[0]
    assert spoken_part.type == "output_audio"
    assert answered.response.status in ("completed", "incomplete")
    assert "Paris" in answered.response.output[0].content[0].transcript
    assert freed, "the cancelled answer's decode slot or tts work was not freed"


def test_metrics_and_health_cover_the_tts_pool(server):
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'epd_tts_phrases_total{instance="tts-0",pool="tts"}' in text
    assert "epd_tts_time_to_first_audio_seconds_bucket" in text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
