"""The API's event loop does not stall on CPU work (issue 13, defect 5).

Every stream, ``/health`` and the router's receive loop share the API process's one
asyncio loop. Chat templates, tokenization, audio decoding and the realtime history
render run in a bounded thread pool (``epd.api.cpu_pool``): a job past the bound is a
503 (a failed realtime response), not an unbounded queue. A realtime conversation past
the context drops its oldest items with O(log n) renders, not one per dropped item.

"Off the loop" is shown by ordering, never by timing: the CPU call waits until a
coroutine on the loop has run while the call is in progress; a call on the loop itself
cannot see that happen (it gives up after ``GUARD_S``). Render counts come from the
real tokenizer's ``apply_chat_template`` wrapped with a counter.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient
from transformers import AutoConfig, AutoTokenizer

from epd.api import cpu_pool
from epd.api.chat_prompt import ChatPromptRenderer, flatten
from epd.api.completions import ApiState, CompletionService
from epd.api.cpu_pool import CpuPool
from epd.api.media_fetch import MediaFetcher
from epd.api.protocol import ChatRequest, CompletionRequest
from epd.api.realtime.conversation import Item, Part, ResponseState
from epd.api.realtime.prompt import ConversationPrompt
from epd.api.realtime.protocol import ClientError
from epd.api.realtime.session import RealtimeSession
from epd.api.realtime.transcribe import Transcriber
from epd.api.server import ApiSettings, build_http_app
from epd.encoders.processor import MultiModalProcessor, ProcessedPrompt
from epd.errors import CapacityError
from epd.models.tiny import build_tiny_tokenizer, create_tiny_model
from epd.multimodal import MediaItem

#: how long a probed call waits for the loop; only a call made on the loop itself waits this long
GUARD_S = 10.0
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills".split()


def text_processor() -> SimpleNamespace:
    """A text-only model's processor (no placeholders: ``process`` keeps the ids)."""
    return SimpleNamespace(modalities={"audio": "transcribe"}, placeholder_ids={}, max_items_per_prompt=16,
                           process=lambda ids, mm: ProcessedPrompt(list(ids), [], []))


class LoopProbe:
    """Wraps ``fn``: each call first waits (at most ``GUARD_S``) until the event loop has
    run a coroutine while the call is in progress; ``saw_loop``: whether it had, per call."""

    def __init__(self, fn) -> None:
        self.fn, self.entered, self.loop_ran, self.saw_loop = fn, threading.Event(), threading.Event(), []

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.saw_loop.append(self.loop_ran.wait(GUARD_S))
        return self.fn(*args, **kwargs)

    async def run(self, job):
        """Await ``job``; meanwhile, once the probed call has started, mark that the loop runs."""
        async def mark() -> None:
            while not self.entered.is_set():
                await asyncio.sleep(0.001)
            self.loop_ran.set()

        marker = asyncio.create_task(mark())
        try:
            return await job
        finally:
            marker.cancel()


class RenderCounter:
    """Counts the calls of a tokenizer's ``apply_chat_template`` (and makes them)."""

    def __init__(self, tok) -> None:
        self.fn, self.calls = tok.apply_chat_template, 0
        tok.apply_chat_template = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def history(n: int, chars: int = 90, cancelled_every: int = 0) -> list[Item]:
    """``n`` items, user and assistant in turn; every ``cancelled_every``-th answer is empty."""
    items = []
    for i in range(n):
        words, k = [], i
        while sum(len(w) + 1 for w in words) < chars:
            words.append(WORDS[k % len(WORDS)])
            k = k * 7 + 3
        if i % 2 == 0:
            items.append(Item(f"item_{i}", "user", [Part("input_text", text=f"{i}: " + " ".join(words))]))
        else:
            empty = cancelled_every and (i // 2) % cancelled_every == 0
            items.append(Item(f"item_{i}", "assistant", [Part("output_text", text="" if empty else " ".join(words))]))
    return items


def response(items: list[Item], max_output_tokens: int | str = 16, instructions: str | None = None):
    return ResponseState("resp_1", items, instructions, max_output_tokens, 0.0, None, True)


def old_render(prompt: ConversationPrompt, items: list[Item], instructions: str | None) -> list[int]:
    """The prompt of ``items`` as epd rendered it before this change."""
    escape = prompt.literal.escape
    msgs = [{"role": "system", "content": escape(instructions)}] if instructions else []
    audios = []
    for it in items:
        parts = []
        for p in it.parts:
            if p.type == "input_audio":
                audios.append((p.pcm, p.rate))
                parts.append({"type": "audio"})
            else:
                parts.append({"type": "text", "text": escape(p.text or "")})
        if it.role == "assistant" and not any(p.get("text") for p in parts):
            continue
        msgs.append({"role": it.role, "content": flatten(parts, None, prompt.audio_tok, prompt.structured)})
    text = prompt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return prompt.processor.process(prompt.literal.encode(text), {"audio": audios} if audios else None).prompt_token_ids


def old_build_request(prompt: ConversationPrompt, resp: ResponseState) -> tuple[list[int], int] | str:
    """The prompt ids and max_tokens epd chose before this change (the reference): render
    all items, and while the prompt does not fit, drop the oldest and render again. Its
    error message when the newest item alone is too long."""
    items = list(resp.items)
    want = 1 if resp.max_output_tokens == "inf" else resp.max_output_tokens
    while True:
        ids = old_render(prompt, items, resp.instructions)
        if len(ids) + want <= prompt.max_model_len:
            mt = prompt.max_model_len - len(ids) if resp.max_output_tokens == "inf" else resp.max_output_tokens
            return ids, mt
        if len(items) == 1:
            return (f"the newest item alone makes a {len(ids)}-token prompt; with max_output_tokens "
                    f"{resp.max_output_tokens} it does not fit max_model_len {prompt.max_model_len}")
        items.pop(0)


def new_build_request(prompt: ConversationPrompt, resp: ResponseState) -> tuple[list[int], int] | str:
    try:
        req, _ = asyncio.run(prompt.build_request(resp))
    except ClientError as e:
        assert e.code == "context_length_exceeded"
        return str(e)
    return req.prompt_token_ids, req.params.max_tokens


def log_bound(n_items: int) -> int:
    """Renders allowed for one response over ``n_items`` items: O(log n)."""
    return 2 + math.ceil(math.log2(n_items))


# ---- the bounded pool ---------------------------------------------------------------------------
def test_cpu_pool_refuses_jobs_past_its_bound_until_they_finish():
    async def main():
        pool, gate = CpuPool(workers=1, max_jobs=2), threading.Event()
        running = asyncio.create_task(pool.run(gate.wait))
        queued = asyncio.create_task(pool.run(lambda: "queued"))
        await asyncio.sleep(0)
        with pytest.raises(CapacityError, match="2 CPU jobs"):
            await pool.run(lambda: "refused")
        gate.set()
        assert await running is True and await queued == "queued"
        assert [await pool.run(lambda: k) for k in range(3)] == [0, 1, 2]  # the slots came back
        # a queued job whose caller gave up is dropped and frees its slot
        gate.clear()
        running = asyncio.create_task(pool.run(gate.wait))
        queued = asyncio.create_task(pool.run(lambda: pytest.fail("a cancelled job ran")))
        await asyncio.sleep(0)
        queued.cancel()
        gate.set()
        await running
        assert await pool.run(lambda: "again") == "again"

    asyncio.run(main())


def test_a_full_cpu_pool_is_a_503_for_chat_and_a_failed_realtime_response(monkeypatch):
    pool, gate, started = CpuPool(workers=1, max_jobs=1), threading.Event(), threading.Event()
    monkeypatch.setattr(cpu_pool, "_shared", pool)

    def hold() -> None:
        started.set()
        gate.wait(GUARD_S)

    holder = threading.Thread(target=asyncio.run, args=(pool.run(hold),))
    holder.start()
    try:
        assert started.wait(GUARD_S)
        state = ApiState()
        app = build_http_app(SimpleNamespace(), build_tiny_tokenizer(), text_processor(), model_name="m",
                             max_model_len=64, settings=ApiSettings(), vocab_size=512, state=state)
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable_error"
        assert "CPU jobs" in r.json()["error"]["message"] and state.pending == 0

        tok = build_tiny_tokenizer()
        api = SimpleNamespace(model_name="m", max_model_len=64, default_max_tokens=8, tokenizer=tok, metrics=None,
                              router=SimpleNamespace(has_pool=lambda role: False), processor=text_processor(),
                              state=ApiState(), max_pending_requests=4, idle_timeout_s=None,
                              prompt=ConversationPrompt(tok, text_processor(), 64))
        session = RealtimeSession(ws=None, api=api)

        async def respond() -> list[dict]:
            await session.handle(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}))
            await session.handle(json.dumps({"type": "response.create"}))
            await session.active.task
            return [json.loads(session.out.get_nowait()) for _ in range(session.out.qsize())]

        done = asyncio.run(respond())[-1]
        assert done["type"] == "response.done" and done["response"]["status"] == "failed"
        assert done["response"]["status_details"]["error"]["code"] == "service_unavailable"
        assert api.state.pending == 0
    finally:
        gate.set()
        holder.join()


# ---- CPU work runs off the loop ------------------------------------------------------------------
def test_chat_template_renders_off_the_event_loop():
    tok = build_tiny_tokenizer()
    renderer = ChatPromptRenderer(SimpleNamespace(), tok, text_processor(), MediaFetcher(()), CpuPool())
    probe = tok.apply_chat_template = LoopProbe(tok.apply_chat_template)
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hello there"}]})
    ids, mm = asyncio.run(probe.run(renderer.render(body, "asr-1")))
    assert probe.saw_loop == [True]
    assert ids == tok.encode(probe.fn([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                      tokenize=False), add_special_tokens=False) and mm == {}


def test_completion_prompt_tokenizes_off_the_event_loop():
    tok = build_tiny_tokenizer()
    renderer = ChatPromptRenderer(SimpleNamespace(), tok, text_processor(), MediaFetcher(()), CpuPool())
    service = CompletionService(tok, text_processor(), renderer, None, ApiState(), settings=ApiSettings(),
                                model_name="m", max_model_len=64, vocab_size=512)
    probe = tok.encode = LoopProbe(tok.encode)
    body = CompletionRequest(prompt="hello there", max_tokens=4)
    (choice,) = asyncio.run(probe.run(service.prepare_one(body, "hello there", {}, False, "cmpl-1", 0)))
    assert probe.saw_loop and all(probe.saw_loop)
    assert choice.req.prompt_token_ids == probe.fn("hello there", add_special_tokens=True)


def test_realtime_history_renders_off_the_event_loop():
    tok = build_tiny_tokenizer()
    prompt = ConversationPrompt(tok, text_processor(), 4096, CpuPool())
    probe = tok.apply_chat_template = LoopProbe(tok.apply_chat_template)
    req, _ = asyncio.run(probe.run(prompt.build_request(response(history(4)))))
    assert probe.saw_loop == [True] and req.prompt_token_ids


def test_realtime_transcription_decodes_audio_off_the_event_loop():
    probe = LoopProbe(lambda a: MediaItem("audio", "h" * 64, {"audio": a[0] / 32768.0}, 0))

    class Router:
        def has_pool(self, role):  # no tts pool: sessions answer in text
            return False

        async def transcribe(self, rid, items):
            return ["heard"]

    api = SimpleNamespace(router=Router(), processor=SimpleNamespace(modalities={"audio": "transcribe"},
                                                                     audio_item=probe),
                          state=ApiState(), max_pending_requests=8)
    events = []
    asr = Transcriber(api, lambda kind, **fields: events.append(kind), CpuPool())
    item = Item("item_1", "user", [Part("input_audio", pcm=np.zeros(4800, np.int16), rate=24000)])

    async def main() -> str:
        asr.start(item)
        return await probe.run(item.parts[0].asr)

    assert asyncio.run(main()) == "heard"
    assert probe.saw_loop == [True]
    assert events == ["conversation.item.input_audio_transcription.delta",
                      "conversation.item.input_audio_transcription.completed"]


def test_a_turn_that_ends_at_its_pause_keeps_the_early_transcript():
    """Server VAD's early transcription: a turn committed at the pause it was transcribed
    from is not transcribed again; one where speech went on past the pause is, whole."""
    clips: list[int] = []  # samples of each clip the E pool transcribed

    class Router:
        async def transcribe(self, rid, items):
            clips.append(len(items[0].data["audio"]))
            await asyncio.sleep(0)
            return [f"heard {len(clips)}"]

    api = SimpleNamespace(router=Router(), processor=SimpleNamespace(
        modalities={"audio": "transcribe"}, audio_item=lambda a: MediaItem("audio", "h" * 64, {"audio": a[0]}, 0)),
        state=ApiState(), max_pending_requests=8)
    events = []
    asr = Transcriber(api, lambda kind, **fields: events.append((kind, fields)), CpuPool())

    def turn(samples: int) -> Item:
        return Item(f"item_{samples}", "user", [Part("input_audio", pcm=np.zeros(samples, np.int16), rate=24000)])

    async def main() -> tuple[str, str]:
        asr.start_early(bytes(2 * 4800), 24000, 200)  # the turn up to its pause at 200 ms
        await asyncio.sleep(0.2)
        first = turn(7200)
        asr.start(first, early_ms=200)  # the turn ended at that pause
        t1 = await first.parts[0].asr
        asr.start_early(bytes(2 * 2400), 24000, 600)
        second = turn(9600)
        asr.start(second, early_ms=900)  # speech went on after the pause: stale
        t2 = await second.parts[0].asr
        return t1, t2

    t1, t2 = asyncio.run(main())
    assert clips[0] == 4800 and t1 == "heard 1"  # the early clip; the commit did not transcribe again
    assert clips[-1] == 9600 and t2 == f"heard {len(clips)}"  # the whole clip
    assert [(k.rsplit(".", 1)[1], f["item_id"], f.get("delta", f.get("transcript"))) for k, f in events] == [
        ("delta", "item_7200", t1), ("completed", "item_7200", t1),
        ("delta", "item_9600", t2), ("completed", "item_9600", t2)]
    assert asr.early is None and not asr.jobs and api.state.pending == 0


# ---- history truncation: O(log n) renders, the same prompt ----------------------------------------
def test_truncating_a_1000_item_history_renders_the_template_o_log_n_times():
    tok = build_tiny_tokenizer()
    prompt = ConversationPrompt(tok, text_processor(), 512, CpuPool())
    renders = RenderCounter(tok)
    items = history(1000)
    req, _ = asyncio.run(prompt.build_request(response(items, 16)))
    assert renders.calls <= log_bound(len(items)), renders.calls  # before: one render per dropped item (~990)
    # the old algorithm's answer: the first item kept is the oldest from which the prompt fits (found
    # from the newest down: the old loop itself would take ~990 renders of up to 1,000 items)
    ref = ConversationPrompt(build_tiny_tokenizer(), text_processor(), 512, CpuPool())
    first = len(items) - 1
    while first > 0 and len(old_render(ref, items[first - 1:], None)) + 16 <= 512:
        first -= 1
    assert first > 900
    assert (req.prompt_token_ids, 16) == old_build_request(ref, response(items[first:], 16))


def test_truncation_keeps_the_old_algorithms_prompt_with_o_log_n_renders():
    long_newest = history(2) + [Item("item_long", "user", [Part("input_text", text="word " * 200)])]
    cases = [  # items, max_model_len, max_output_tokens, instructions, renders at most
        (history(60, cancelled_every=3), 256, 8, "Answer briefly.", log_bound(60)),
        (history(60, cancelled_every=3), 256, "inf", None, log_bound(60)),
        (history(61, chars=30), 300, 1, "Be kind.", log_bound(61)),
        (history(5), 2048, 16, None, 1),  # everything fits: one render, as before
        (long_newest, 64, 8, None, 2),  # the newest alone is too long: the same error
    ]
    for items, max_model_len, max_output_tokens, instructions, most in cases:
        ref = ConversationPrompt(build_tiny_tokenizer(), text_processor(), max_model_len, CpuPool())
        tok = build_tiny_tokenizer()
        prompt = ConversationPrompt(tok, text_processor(), max_model_len, CpuPool())
        renders = RenderCounter(tok)
        resp = response(items, max_output_tokens, instructions)
        assert new_build_request(prompt, resp) == old_build_request(ref, resp)
        assert renders.calls <= most, (len(items), renders.calls)  # before: one render per dropped item


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory) -> str:
    return str(create_tiny_model("qwen2-audio", tmp_path_factory.mktemp("loop") / "qwen2-audio"))


def test_truncation_with_audio_clips_keeps_the_old_algorithms_prompt(audio_model):
    """An audio-native model: a clip's tokens (its placeholder expanded) count, once per clip."""
    def setup():
        tok = AutoTokenizer.from_pretrained(audio_model)
        return tok, ConversationPrompt(tok, MultiModalProcessor(audio_model, AutoConfig.from_pretrained(audio_model)),
                                       400, CpuPool())

    items = history(24, chars=40)
    for i in range(0, 24, 4):  # every other user turn also speaks: 0.2 to 1.2 s (5 to 30 tokens)
        pcm = (np.sin(np.arange(4800 * (1 + i // 4)) / (3 + i)) * 8000).astype(np.int16)
        items[i].parts.append(Part("input_audio", pcm=pcm, rate=24000))
    _, ref = setup()
    tok, prompt = setup()
    renders = RenderCounter(tok)
    req, audio_tokens = asyncio.run(prompt.build_request(response(items, 8, "Listen.")))
    ids, max_tokens = old_build_request(ref, response(items, 8, "Listen."))
    assert renders.calls <= log_bound(len(items)), renders.calls
    assert (req.prompt_token_ids, req.params.max_tokens) == (ids, max_tokens)
    clips = sum(any(p.type == "input_audio" for p in it.parts) for it in items)
    assert 0 < len(req.placeholders) < clips  # some clips were dropped, some kept
    assert audio_tokens == sum(p.length for p in req.placeholders)
