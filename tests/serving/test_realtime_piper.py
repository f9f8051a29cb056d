"""A Piper voice from a local directory in the tts pool (``--tts-engine DIR``): the
realtime answer's speech is the voice's (tests/tts/fake_piper_voice.py: a tone whose
pitch names the speaker and whose length counts Piper's phoneme ids), phrase by phrase,
with the session's ``voice`` choosing the speaker (OpenAI's names, in order)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from tests.serving.conftest import launch
from tests.serving.test_realtime import connect, until
from tests.serving.test_realtime_speech import ask, of
from tests.tts import fake_piper_voice as fake
from tests.tts.test_piper import dominant_hz

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return fake.build(tmp_path_factory.mktemp("piper") / "voice", speakers=2)


@pytest.fixture(scope="module")
def server(voice_dir):
    with launch(None, "e:0,pd:1,t:1", "--kv-cache-memory-gb", "0.3", "--tts-engine", str(voice_dir)) as s:
        yield s


def test_the_tts_pool_speaks_with_the_piper_voice_and_its_speakers(server, voice_dir):
    from piper import PiperVoice

    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            done = []
            for voice in ("alloy", "ash"):  # speakers 0 and 1
                await conn.session.update(session={"type": "realtime", "audio": {
                    "input": {"turn_detection": None}, "output": {"voice": voice}}})
                await until(conn, lambda e: e.type in ("session.updated", "error"), log)
                await ask(conn, "What is the capital of France?", max_output_tokens=24)
                done.append(await until(conn, lambda e: e.type == "response.done", log))
            return log, done

    log, done = asyncio.run(go())
    ref = PiperVoice.load(next(voice_dir.glob("*.onnx")))
    for resp, hz in zip(done, (fake.BASE_HZ, fake.BASE_HZ + 100)):
        assert resp.response.status in ("completed", "incomplete"), resp
        rid = resp.response.id
        pcm = np.frombuffer(b"".join(base64.b64decode(e.delta) for e in of(log, "response.output_audio.delta", rid)),
                            dtype="<i2")
        assert abs(dominant_hz(pcm) - hz) < 3, resp.response.audio
        # every phrase spoken, each as long as Piper's phoneme ids for it (resampled to 24 kHz)
        phrases = [e.text for e in of(log, "response.output_text.segment", rid) if e.text.strip()]
        ids = [sum(len(ref.phonemes_to_ids(p)) for p in ref.phonemize(t) if p) for t in phrases]
        expect = sum(round(n * fake.HOP * 24000 / fake.SAMPLE_RATE) for n in ids)
        assert phrases and abs(len(pcm) - expect) <= 4 * len(phrases), (len(pcm), expect, phrases)
