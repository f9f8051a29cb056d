"""RealtimeSession's event handling without a server: limits and the input audio buffer.

The serving tests (tests/serving/test_realtime.py) drive the real server through the
openai SDK; these cover the limits that would take too much audio to reach there.
"""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

from epd.api.realtime import session as realtime
from epd.api.realtime.session import RealtimeSession

NO_TTS = SimpleNamespace(has_pool=lambda role: False)  # a router without a tts pool: sessions answer in text


def session() -> RealtimeSession:
    api = SimpleNamespace(model_name="m", max_model_len=64, default_max_tokens=16, router=NO_TTS, idle_timeout_s=None,
                          processor=SimpleNamespace(modalities={"audio": "embed"}))  # embed: no transcription task
    s = RealtimeSession(ws=None, api=api)
    s.turn_detection = None  # manual commits (server VAD: tests/serving/test_realtime_vad.py)
    return s


def send(s: RealtimeSession, **event) -> list[dict]:
    """Handle one client event; the server events it queued."""
    asyncio.run(s.handle(json.dumps(event)))
    out = []
    while not s.out.empty():
        out.append(json.loads(s.out.get_nowait()))
    return out


def append(s: RealtimeSession, n_bytes: int, event_id: str = "e") -> list[dict]:
    return send(s, type="input_audio_buffer.append", event_id=event_id,
                audio=base64.b64encode(bytes(n_bytes)).decode())


def test_session_byte_limit_and_failed_commit_keeps_the_buffer(monkeypatch):
    monkeypatch.setattr(realtime, "MAX_SESSION_BYTES", 20_000)
    monkeypatch.setattr(realtime, "MAX_ITEMS", 1)
    s = session()
    assert append(s, 9_600) == []  # 200 ms at 24 kHz
    first = send(s, type="input_audio_buffer.commit")
    assert [e["type"] for e in first] == ["input_audio_buffer.committed", "conversation.item.added",
                                          "conversation.item.created", "conversation.item.done"]
    assert first[1]["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    assert len(s.buffer) == 0 and len(s.items) == 1
    assert append(s, 9_600) == []
    (err,) = append(s, 9_600, event_id="over")  # 3 x 9600 > 20000
    assert err["type"] == "error" and err["error"]["code"] == "session_full" and err["error"]["event_id"] == "over"
    assert len(s.buffer) == 9_600
    (err,) = send(s, type="input_audio_buffer.commit", event_id="full")  # MAX_ITEMS reached
    assert err["error"]["code"] == "conversation_full" and err["error"]["event_id"] == "full"
    assert len(s.buffer) == 9_600  # the audio was not lost
    assert [e["type"] for e in send(s, type="input_audio_buffer.clear")] == ["input_audio_buffer.cleared"]
    assert len(s.buffer) == 0


def test_buffer_seconds_limit_and_rate_change(monkeypatch):
    monkeypatch.setattr(realtime, "MAX_BUFFER_SECONDS", 1.0)
    s = session()
    assert append(s, 40_000) == []
    (err,) = append(s, 10_000)  # 50000 bytes = 1.04 s at 24 kHz
    assert err["error"]["code"] == "input_audio_buffer_full"
    (err,) = send(s, type="session.update", session={"audio": {"input": {"format": {"type": "audio/pcm",
                                                                                      "rate": 16000}}}})
    assert "commit or clear" in err["error"]["message"]  # the buffered audio is at 24 kHz
    send(s, type="input_audio_buffer.clear")
    (upd,) = send(s, type="session.update", session={"audio": {"input": {"format": {"type": "audio/pcm",
                                                                                      "rate": 16000}}}})
    assert upd["type"] == "session.updated" and upd["session"]["audio"]["input"]["format"]["rate"] == 16000
    assert append(s, 32_000) == []  # 1.0 s at 16 kHz fits
    assert append(s, 2)[0]["error"]["code"] == "input_audio_buffer_full"


def test_a_container_header_is_only_rejected_at_the_start_of_a_clip():
    s = session()
    wav_like = b"RIFF" + bytes(96)
    (err,) = send(s, type="input_audio_buffer.append", audio=base64.b64encode(wav_like).decode())
    assert err["error"]["code"] == "invalid_audio_format"
    assert append(s, 100) == []
    # Mid-clip the same four bytes are just samples.
    assert send(s, type="input_audio_buffer.append", audio=base64.b64encode(wav_like).decode()) == []
    assert len(s.buffer) == 200


def test_session_update_is_all_or_nothing():
    s = session()
    (err,) = send(s, type="session.update", event_id="u1",
                  session={"instructions": "Be brief.", "max_output_tokens": 8, "output_modalities": ["audio"]})
    assert err["error"]["code"] == "unsupported_modality" and err["error"]["param"] == "session.output_modalities"
    assert s.instructions is None and s.max_output_tokens == 16  # nothing of the failed update was applied
    (err,) = send(s, type="session.update", session={"max_output_tokens": 64})  # max_model_len is 64
    assert err["error"]["param"] == "session.max_output_tokens"
    (upd,) = send(s, type="session.update", session={"instructions": "Be brief.", "max_output_tokens": "inf"})
    assert upd["session"]["instructions"] == "Be brief." and upd["session"]["max_output_tokens"] == "inf"


def test_server_vad_keeps_only_the_padding_between_turns(monkeypatch):
    """With server VAD (the default) silence never fills the buffer: between turns it
    holds the prefix padding only, and no turn starts."""
    monkeypatch.setattr(realtime, "MAX_BUFFER_SECONDS", 1.0)
    api = SimpleNamespace(model_name="m", max_model_len=64, default_max_tokens=16, router=NO_TTS, idle_timeout_s=None,
                          processor=SimpleNamespace(modalities={"audio": "embed"}))
    s = RealtimeSession(ws=None, api=api)
    assert s.session_json()["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    for _ in range(30):  # 3 s of silence at 24 kHz, in 100 ms appends
        assert append(s, 4_800) == []
    assert len(s.buffer) <= 24_000 * 2 * 300 // 1000 + 4_800
    (upd,) = send(s, type="session.update", session={"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300, "create_response": False}}}})
    td = upd["session"]["audio"]["input"]["turn_detection"]
    assert (td["threshold"], td["silence_duration_ms"], td["create_response"], td["prefix_padding_ms"]) == \
        (0.7, 300, False, 300)
    (err,) = send(s, type="session.update", session={"audio": {"input": {"turn_detection": {"threshold": 2}}}})
    assert err["error"]["param"] == "session.audio.input.turn_detection.threshold"
