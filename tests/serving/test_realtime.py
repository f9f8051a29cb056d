"""The realtime voice API end to end: real `epd launch`, the openai SDK's realtime client.

Answers are checked by parity with the offline engine (``LLM.chat``, greedy) on the
conversation the server should have rendered: transcript of the spoken turn, the
assistant's earlier answers, the new user turn. Speech: tests/data/speech (README
there says what each WAV says and how it was made).
"""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as F
from openai import AsyncOpenAI

from epd import LLM, SamplingParams
from epd.api.realtime.protocol import MAX_APPEND_BYTES
from epd.models.tiny import AUDIO_TOKEN, create_tiny_model
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow
SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
TIMEOUT_S = 300


def pcm16(name: str, rate: int) -> bytes:
    """A test recording as PCM16 mono at ``rate`` Hz (resampled with torchaudio)."""
    audio, sr = sf.read(SPEECH / name, dtype="float32")
    x = torch.from_numpy(audio)
    if sr != rate:
        x = F.resample(x, sr, rate)
    return (x.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()


def connect(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return client.realtime.connect(model=server.model)


async def until(conn, pred, log: list | None = None):
    """Read events until ``pred(event)``; returns that event (all of them go to ``log``)."""
    async def loop():
        while True:
            ev = await conn.recv()
            if log is not None:
                log.append(ev)
            if pred(ev):
                return ev
    return await asyncio.wait_for(loop(), TIMEOUT_S)


async def append_speech(conn, pcm: bytes, rate: int, chunk_ms: int = 100) -> None:
    step = rate * 2 * chunk_ms // 1000
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())


def texts(log: list, response_id: str) -> tuple[str, list[str], str]:
    """(deltas joined, segment texts, output_text.done text) of one response."""
    deltas = "".join(e.delta for e in log if e.type == "response.output_text.delta" and e.response_id == response_id)
    segs = [e.text for e in log if e.type == "response.output_text.segment" and e.response_id == response_id]
    done = [e.text for e in log if e.type == "response.output_text.done" and e.response_id == response_id]
    assert len(done) == 1
    return deltas, segs, done[0]


def check_segments(deltas: str, segs: list[str]) -> None:
    assert "".join(segs) == deltas
    for s, nxt in zip(segs, segs[1:]):  # never inside a word
        assert s[-1].isspace() and not nxt[0].isspace(), (s, nxt)


@pytest.fixture(scope="module")
def server():
    with launch(None, None) as s:  # the default model on e:1,p:1,d:1
        yield s


@pytest.fixture(scope="module")
def offline():
    llm = LLM(kv_cache_memory_gb=0.25, dtype="float32")

    def answer(messages: list[dict], max_tokens: int) -> str:
        return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text

    answer.tokenizer = llm.get_tokenizer()
    yield answer
    llm.shutdown()


def prompt_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_spoken_question_then_a_turn_that_sees_it(server, offline):
    async def go():
        log: list = []
        async with connect(server) as conn:
            created = await until(conn, lambda e: True)
            assert created.type == "session.created"
            fmt = created.session.audio.input.format
            assert (fmt.type, fmt.rate) == ("audio/pcm", 24000)
            # Turn 1: the spoken question at the default 24 kHz, in 100 ms appends.
            await append_speech(conn, pcm16("capital_of_france.wav", 24000), 24000)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"max_output_tokens": 24})
            d1 = await until(conn, lambda e: e.type == "response.done", log)
            # Turn 2: text, answered with turn 1 in the prompt.
            q2 = "Which country did I ask you about?"
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": q2}]})
            await conn.response.create(response={"max_output_tokens": 16})
            d2 = await until(conn, lambda e: e.type == "response.done", log)
            return log, d1, d2, q2

    log, d1, d2, q2 = asyncio.run(go())
    assert d1.response.status == "completed", d1.response.status_details
    committed = next(e for e in log if e.type == "input_audio_buffer.committed")
    user_item = next(e for e in log if e.type == "conversation.item.created" and e.item.role == "user")
    assert user_item.item.id == committed.item_id and user_item.item.content[0].type == "input_audio"
    heard = next(e for e in log if e.type == "conversation.item.input_audio_transcription.completed")
    assert heard.item_id == committed.item_id
    assert heard.transcript == "What is the capital of France?"
    first_delta = next(i for i, e in enumerate(log) if e.type == "response.output_text.delta")
    assert log.index(heard) < first_delta

    r1 = d1.response
    assert r1.status == "completed" and r1.output[0].role == "assistant"
    a1, segs1, done1 = texts(log, r1.id)
    assert a1 == done1 == r1.output[0].content[0].text
    assert "Paris" in a1
    turn1 = [{"role": "user", "content": heard.transcript}]
    assert a1 == offline(turn1, 24)
    check_segments(a1, segs1)
    assert r1.usage.input_tokens == prompt_len(offline.tokenizer, turn1)
    assert r1.usage.output_tokens > 0

    r2 = d2.response
    assert r2.status in ("completed", "incomplete")
    a2, segs2, _ = texts(log, r2.id)
    turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    assert a2 == offline(turn2, 16)
    check_segments(a2, segs2)
    # The second prompt is the whole conversation, and its first turn came from the prefix cache.
    assert r2.usage.input_tokens == prompt_len(offline.tokenizer, turn2)
    assert r2.usage.input_token_details.cached_tokens >= 16
    print(f"\nturn 1: {a1!r}; turn 2: {a2!r}; turn 2 usage {r2.usage}")


def test_text_only_turn_with_instructions_and_segments(server, offline):
    instructions = "You are a helpful assistant."
    question = "Name three primary colors and describe each one in a sentence."

    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await conn.session.update(session={"type": "realtime", "instructions": instructions,
                                               "max_output_tokens": 48})
            upd = await until(conn, lambda e: e.type in ("session.updated", "error"))
            assert upd.type == "session.updated" and upd.session.instructions == instructions
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": question}]})
            await conn.response.create()
            return log, await until(conn, lambda e: e.type == "response.done", log)

    log, done = asyncio.run(go())
    r = done.response
    assert r.status in ("completed", "incomplete")
    text, segs, _ = texts(log, r.id)
    expected = offline([{"role": "system", "content": instructions}, {"role": "user", "content": question}], 48)
    assert text == expected
    check_segments(text, segs)
    assert len(segs) >= 2  # a TTS engine could start before the answer ended
    seg_events = [e for e in log if e.type == "response.output_text.segment"]
    assert [e.segment_index for e in seg_events] == list(range(len(seg_events)))
    # Each segment goes out as soon as the delta that completes it: before the last delta.
    last_delta = max(i for i, e in enumerate(log) if e.type == "response.output_text.delta")
    assert log.index(seg_events[0]) < last_delta


def test_instructions_alone_are_answered_as_a_greeting(server, offline):
    """pipecat's examples run the LLM on a context holding only the system prompt ("greet the
    user"): response.create on an empty conversation answers the instructions. With no
    instructions either, it is refused as conversation_empty."""
    instructions = "You are a friendly assistant. Greet the user."

    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await conn.session.update(session={"type": "realtime", "instructions": instructions,
                                               "max_output_tokens": 24})
            await until(conn, lambda e: e.type == "session.updated")
            await conn.response.create()
            done = await until(conn, lambda e: e.type == "response.done", log)
            await conn.response.create(response={"conversation": "none", "input": [], "instructions": ""})
            refused = await until(conn, lambda e: e.type in ("error", "response.created"))
            return log, done, refused

    log, done, refused = asyncio.run(go())
    assert done.response.status in ("completed", "incomplete")
    text, _, _ = texts(log, done.response.id)
    assert text and text == offline([{"role": "system", "content": instructions}], 24)
    assert refused.type == "error" and refused.error.code == "conversation_empty"


def _decode_idle(server) -> dict:
    return {k: v for k, v in server.workers().items() if k.startswith("decode")}


def _slots_free(stats: dict) -> bool:
    return all(s["num_running"] == 0 and s["num_reserved"] == 0 and s["num_free_blocks"] == s["num_blocks"]
               for s in stats.values())


def test_cancel_mid_answer_frees_the_decode_slot(server):
    story = "Write a very long story about a dragon who learns to fly, with many chapters."

    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": story}]})
            await conn.response.create(response={"max_output_tokens": 400})
            stamps = []  # delta arrival times: the ITL that bounds the slot-free time
            while len(stamps) < 3:
                ev = await until(conn, lambda e: True, log)
                if ev.type == "response.output_text.delta":
                    stamps.append(time.perf_counter())
            assert not _slots_free(_decode_idle(server))  # the answer holds a decode slot
            t_cancel = time.perf_counter()
            await conn.response.cancel(event_id="evt_cancel")
            done = await until(conn, lambda e: e.type == "response.done", log)
            t_done = time.perf_counter()
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                while not _slots_free({k: v for k, v in (await http.get("/epd/workers")).json().items()
                                       if k.startswith("decode")}):
                    assert time.perf_counter() - t_cancel < 30, "the decode slot was not freed"
            t_free = time.perf_counter()
            # A next turn works; no event of the cancelled response comes after its done.
            at_done = len(log)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Say hi."}]})
            await conn.response.create(response={"max_output_tokens": 4})
            nxt = await until(conn, lambda e: e.type == "response.done" and e.response.id != done.response.id, log)
            return log, done, nxt, at_done, t_done - t_cancel, t_free - t_cancel, (stamps[2] - stamps[0]) / 2

    log, done, nxt, at_done, cancel_s, free_s, itl_s = asyncio.run(go())
    r = done.response
    assert r.status == "cancelled" and r.status_details.reason == "client_cancelled"
    assert 3 <= r.usage.output_tokens < 400
    assert not [e for e in log[at_done:] if getattr(e, "response_id", None) == r.id]
    text, segs, _ = texts(log, r.id)
    check_segments(text, segs)
    assert r.output[0].content[0].text == text and r.output[0].status == "incomplete"
    assert nxt.response.status in ("completed", "incomplete")
    print(f"\nrealtime cancel: response.cancel -> response.done {cancel_s * 1000:.1f} ms, "
          f"-> decode slot free (seen via /epd/workers) {free_s * 1000:.1f} ms; ITL before it {itl_s * 1000:.1f} ms")


def test_speech_committed_while_answering_barges_in(server):
    """Audio at a configured 16 kHz; new speech cancels the answer in flight (turn_detected)."""

    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 16000}}}})
            upd = await until(conn, lambda e: e.type in ("session.updated", "error"))
            assert upd.type == "session.updated" and upd.session.audio.input.format.rate == 16000
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me a long story about the sea."}]})
            await conn.response.create(response={"max_output_tokens": 400})
            first = await until(conn, lambda e: e.type == "response.output_text.delta", log)
            await append_speech(conn, pcm16("primary_colors.wav", 16000), 16000)
            await conn.input_audio_buffer.commit()
            cancelled = await until(conn, lambda e: e.type == "response.done", log)
            await until(conn, lambda e: e.type == "input_audio_buffer.committed", log)
            await conn.response.create(response={"max_output_tokens": 8})
            answered = await until(conn, lambda e: e.type == "response.done", log)
            return log, first, cancelled, answered

    log, first, cancelled, answered = asyncio.run(go())
    assert cancelled.response.id == first.response_id
    assert cancelled.response.status == "cancelled"
    assert cancelled.response.status_details.reason == "turn_detected"
    heard = next(e for e in log if e.type == "conversation.item.input_audio_transcription.completed")
    assert "primary colors" in heard.transcript.lower()
    assert answered.response.status in ("completed", "incomplete") and answered.response.usage.output_tokens > 0


def test_bad_events_get_errors_and_the_session_goes_on(server):
    async def go():
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            errors = {}

            async def expect_error(name: str, send) -> None:
                await send()
                ev = await until(conn, lambda e: True)
                assert ev.type == "error", (name, ev)
                errors[name] = ev.error

            await expect_error("json", lambda: conn.send_raw('{"type": "response.create",'))
            await expect_error("not_object", lambda: conn.send_raw("[1, 2]"))
            await expect_error("unknown", lambda: conn.send_raw('{"type": "no.such.event", "event_id": "evt_u"}'))
            await expect_error("fields", lambda: conn.send_raw(
                '{"type": "input_audio_buffer.append", "event_id": "evt_f", "audio": 5}'))
            await expect_error("pcmu", lambda: conn.session.update(event_id="evt_pcmu", session={
                "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}}}))
            await expect_error("rate", lambda: conn.send_raw(
                '{"type": "session.update", "event_id": "evt_rate", "session": {"type": "realtime", '
                '"audio": {"input": {"format": {"type": "audio/pcm", "rate": 1000}}}}}'))
            wav = (SPEECH / "primary_colors.wav").read_bytes()
            await expect_error("wav", lambda: conn.input_audio_buffer.append(
                event_id="evt_wav", audio=base64.b64encode(wav).decode()))
            await expect_error("odd", lambda: conn.input_audio_buffer.append(
                event_id="evt_odd", audio=base64.b64encode(b"\x00\x01\x02").decode()))
            await expect_error("base64", lambda: conn.input_audio_buffer.append(event_id="evt_b64", audio="@@@"))
            big = base64.b64encode(bytes(MAX_APPEND_BYTES + 2)).decode()
            await expect_error("oversized", lambda: conn.input_audio_buffer.append(event_id="evt_big", audio=big))
            await expect_error("empty_commit", lambda: conn.input_audio_buffer.commit(event_id="evt_commit"))
            await expect_error("no_response", lambda: conn.response.cancel(event_id="evt_cancel"))
            await expect_error("no_conversation", lambda: conn.response.create(event_id="evt_create"))
            await expect_error("temperature", lambda: conn.session.update(event_id="evt_temp", session={
                "type": "realtime", "temperature": 5.0}))
            await expect_error("vad", lambda: conn.session.update(event_id="evt_vad", session={
                "type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                            "idle_timeout_ms": 1000}}}}))
            # Still working: the format is unchanged, audio goes in, a text turn is answered.
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 4, "temperature": 0.5})
            upd = await until(conn, lambda e: True)
            await conn.input_audio_buffer.append(audio=base64.b64encode(bytes(9600)).decode())  # 200 ms
            await conn.input_audio_buffer.clear()
            cleared = await until(conn, lambda e: True)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hello!"}]})
            await conn.response.create()
            log: list = []
            done = await until(conn, lambda e: e.type == "response.done", log)
            return errors, upd, cleared, done, log

    errors, upd, cleared, done, log = asyncio.run(go())
    assert errors["json"].event_id is None and "JSON" in errors["json"].message
    for name, eid in [("unknown", "evt_u"), ("fields", "evt_f"), ("pcmu", "evt_pcmu"), ("rate", "evt_rate"),
                      ("wav", "evt_wav"), ("odd", "evt_odd"), ("base64", "evt_b64"), ("oversized", "evt_big"),
                      ("empty_commit", "evt_commit"), ("no_response", "evt_cancel"),
                      ("no_conversation", "evt_create"), ("temperature", "evt_temp"), ("vad", "evt_vad")]:
        assert errors[name].event_id == eid, name
        assert errors[name].type == "invalid_request_error"
    assert "no.such.event" in errors["unknown"].message
    assert errors["pcmu"].code == errors["rate"].code == errors["wav"].code == "invalid_audio_format"
    assert "WAV" in errors["wav"].message
    assert errors["oversized"].code == "audio_too_large"
    assert errors["empty_commit"].code == "input_audio_buffer_commit_empty"
    assert upd.type == "session.updated" and upd.session.audio.input.format.rate == 24000
    assert upd.session.temperature == 0.5 and upd.session.max_output_tokens == 4
    assert upd.session.audio.input.turn_detection.type == "server_vad"  # the default, unchanged
    assert errors["vad"].param == "session.audio.input.turn_detection.idle_timeout_ms"  # OpenAI's 5000..30000
    assert cleared.type == "input_audio_buffer.cleared"
    assert not [e for e in log if e.type == "error"]
    assert done.response.status in ("completed", "incomplete") and done.response.usage.output_tokens > 0


def test_audio_native_model_hears_embeddings(tmp_path):
    """Qwen2-Audio (tiny, random): committed audio becomes encoder embeddings in the
    prompt (not a transcript); greedy tokens equal the offline engine's."""
    model_dir = str(create_tiny_model("qwen2-audio", tmp_path / "qa"))
    pcm = pcm16("capital_of_france.wav", 24000)
    llm = LLM(model_dir, kv_cache_memory_gb=0.1, dtype="float32")
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": f"{AUDIO_TOKEN} What was said?"}],
                                       add_generation_prompt=True, tokenize=False)
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.int16)
    out = llm.generate({"prompt_token_ids": tok.encode(rendered, add_special_tokens=False),
                        "multi_modal_data": {"audio": [(samples, 24000)]}},
                       SamplingParams(temperature=0, max_tokens=8))[0]
    llm.shutdown()

    with launch(model_dir, "e:1,p:1,d:1") as srv:
        async def go():
            log: list = []
            async with connect(srv) as conn:
                await until(conn, lambda e: e.type == "session.created")
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_audio", "audio": base64.b64encode(pcm).decode()},
                    {"type": "input_text", "text": " What was said?"}]})
                await conn.response.create(response={"max_output_tokens": 8})
                return log, await until(conn, lambda e: e.type == "response.done", log)

        log, done = asyncio.run(go())
    r = done.response
    assert not [e for e in log if e.type.startswith("conversation.item.input_audio_transcription")]
    assert r.usage.input_tokens == len(out.prompt_token_ids)
    assert r.usage.input_token_details.audio_tokens > 0
    assert texts(log, r.id)[0] == out.outputs[0].text


def test_conversation_order_delete_and_out_of_band_response(server, offline):
    """previous_item_id places items, delete removes them, conversation "none" answers
    from its own input without joining the conversation: checked through the exact
    prompt length each response reports."""

    def user(text: str) -> dict:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            def nxt(kind):  # the next event of ``kind`` or an error (items also get .added / .done)
                return until(conn, lambda e: e.type in (kind, "error"), log)

            await conn.conversation.item.create(item=user("The sky is blue."))
            a = await nxt("conversation.item.created")
            await conn.conversation.item.create(item=user("Grass is green."), previous_item_id="root")
            b = await nxt("conversation.item.created")
            await conn.conversation.item.create(previous_item_id=b.item.id, item={
                "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Noted."}]})
            c = await nxt("conversation.item.created")
            await conn.conversation.item.create(item=user("x"), previous_item_id="item_nope", event_id="evt_prev")
            bad_prev = await nxt("conversation.item.created")
            await conn.conversation.item.delete(item_id=c.item.id)
            deleted = await nxt("conversation.item.deleted")
            await conn.conversation.item.delete(item_id=c.item.id, event_id="evt_del")
            bad_del = await nxt("conversation.item.deleted")
            await conn.response.create(response={"conversation": "none", "instructions": "Be brief.",
                                                 "max_output_tokens": 2,
                                                 "input": [{"type": "item_reference", "id": a.item.id}]})
            oob = await until(conn, lambda e: e.type == "response.done", log)
            await conn.response.create(response={"max_output_tokens": 2})
            main = await until(conn, lambda e: e.type == "response.done", log)
            return log, a, b, c, bad_prev, deleted, bad_del, oob, main

    log, a, b, c, bad_prev, deleted, bad_del, oob, main = asyncio.run(go())
    assert a.type == b.type == c.type == "conversation.item.created"
    for it in (a, b, c):  # the GA events carry the same item
        assert [e.item.id for e in log if e.type == "conversation.item.added" and e.item.id == it.item.id]
        assert [e.item.id for e in log if e.type == "conversation.item.done" and e.item.id == it.item.id]
    assert a.previous_item_id is None and b.previous_item_id is None and c.previous_item_id == b.item.id
    assert bad_prev.type == "error" and bad_prev.error.code == "item_not_found"
    assert bad_prev.error.event_id == "evt_prev"
    assert deleted.type == "conversation.item.deleted" and deleted.item_id == c.item.id
    assert bad_del.type == "error" and bad_del.error.event_id == "evt_del"
    tok = offline.tokenizer
    assert oob.response.conversation_id is None
    assert oob.response.usage.input_tokens == prompt_len(tok, [{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "The sky is blue."}])
    assert not [e for e in log if e.type == "conversation.item.created" and e.item.role == "assistant"
                and e.item.id == oob.response.output[0].id]
    # The conversation is B, A (C deleted; the out-of-band answer is not in it).
    assert main.response.usage.input_tokens == prompt_len(tok, [{"role": "user", "content": "Grass is green."},
                                                                {"role": "user", "content": "The sky is blue."}])


def test_two_sessions_naming_their_clips_alike_each_hear_their_own(server):
    """Two sessions at once create an audio item under the same client item id, each
    with a different clip: each transcript is that session's clip (the router request
    ids are the server's own, never the client's item id, so they cannot cross)."""

    async def one(name: str) -> list:
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await conn.conversation.item.create(item={"id": "item_same", "type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": base64.b64encode(pcm16(name, 24000)).decode()}]})
            await until(conn, lambda e: e.type in ("conversation.item.input_audio_transcription.completed",
                                                   "conversation.item.input_audio_transcription.failed"), log)
        return log

    async def go():
        return await asyncio.gather(one("capital_of_france.wav"), one("primary_colors.wav"))

    france, colors = asyncio.run(go())
    for log, expected in ((france, "capital of france"), (colors, "primary colors")):
        created = next(e for e in log if e.type == "conversation.item.created")
        assert created.item.id == "item_same"
        heard = log[-1]
        assert heard.type == "conversation.item.input_audio_transcription.completed", heard
        assert heard.item_id == "item_same" and expected in heard.transcript.lower()
