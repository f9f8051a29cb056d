"""``/v1/realtime`` answering: the conversation as a prompt (``ConversationPrompt``),
the response task that streams deltas and segments (``ResponseStream``), and the
transcription of committed audio in the E pool for text-only models (``Transcriber``).
The protocol is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import base64
import itertools
import uuid

from epd.api.chat_prompt import LiteralText, flatten, template_takes_parts
from epd.api.cpu_pool import CpuPool, shared_pool
from epd.api.constraints import ConstraintChecker
from epd.api.protocol import BadRequest
from epd.api.realtime_events import ClientError, Item, Part, ResponseState, new_id
from epd.api.realtime_tools import CallStream
from epd.api.segmenter import PhraseSegmenter
from epd.api.streaming import RequestTimer
from epd.api.tool_parsers import PARSERS, detect_parser
from epd.api.tools import ToolPlan, apply_template, parse_arguments, template_renders_tools
from epd.detokenizer import IncrementalDetokenizer
from epd.encoders.media import MediaError
from epd.encoders.processor import AUDIO_PLACEHOLDER, MultiModalProcessor, ProcessedPrompt
from epd.errors import CapacityError, InvalidRequestError
from epd.router.pipeline import TTS_SAMPLE_RATE
from epd.router.router import RequestError, RouterRequest
from epd.sampling_params import SamplingParams

#: how long a transcription waits for an encode pool that is down (503) to come back
ASR_RETRY_S = 10.0

#: one conversation item as a prompt: its chat message (None: left out) and its audio clips
_Turn = tuple[dict | None, list]


class ConversationPrompt:
    """Renders conversation items through the model's chat template into a router request.

    ``cpu``: the pool the render, tokenization and audio features run in, off the event
    loop (default: the process's, ``shared_pool``); ``tool_parser``: the format the model
    writes tool calls in (``epd.api.tool_parsers.PARSERS``; None: detected from the chat
    template); ``vocab_size``: the model's logits width, for the grammar engine that
    checks tools (default: the tokenizer's length).
    """

    def __init__(self, tokenizer, processor: MultiModalProcessor, max_model_len: int,
                 cpu: CpuPool | None = None, tool_parser: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.tokenizer, self.processor, self.max_model_len = tokenizer, processor, max_model_len
        self.cpu = cpu or shared_pool()
        self.tool_parser = PARSERS[tool_parser or detect_parser(getattr(tokenizer, "chat_template", None))]
        self.native_tools = template_renders_tools(tokenizer)
        self.vocab_size = vocab_size
        self._constraints: ConstraintChecker | None = None
        self.embed_audio = processor.modalities.get("audio") == "embed"
        self.audio_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["audio"])
                          if self.embed_audio else AUDIO_PLACEHOLDER)
        self.structured = template_takes_parts(tokenizer, None, self.audio_tok if self.embed_audio else None)
        self.literal = LiteralText(tokenizer, processor.placeholder_ids)  # typed placeholders stay text

    @property
    def constraints(self) -> ConstraintChecker:
        """The grammar engine's checker of tools and forced calls (built on first use)."""
        if self._constraints is None:
            self._constraints = ConstraintChecker(self.tokenizer, self.vocab_size or len(self.tokenizer))
        return self._constraints

    async def messages(self, items: list[Item], instructions: str | None) -> tuple[list[dict], list[_Turn]]:
        """The system message of ``instructions`` (none without), and per item its chat
        message (None: an answer cancelled before its first word) and audio clips, in
        order; transcripts awaited. A ``function_call`` joins the assistant message
        before it as a ``tool_calls`` entry (or makes one); a ``function_call_output`` is a
        ``tool`` message."""
        escape = self.literal.escape
        head: list[dict] = [{"role": "system", "content": escape(instructions)}] if instructions else []
        turns: list[_Turn] = []
        for it in items:
            if it.type == "function_call":
                call = {"id": it.call_id, "type": "function",
                        "function": {"name": it.name, "arguments": parse_arguments(it.arguments or "{}")}}
                prev = turns[-1][0] if turns else None
                if prev is not None and prev["role"] == "assistant":
                    prev.setdefault("tool_calls", []).append(call)
                else:
                    turns.append(({"role": "assistant", "content": "", "tool_calls": [call]}, []))
                continue
            if it.type == "function_call_output":
                turns.append(({"role": "tool", "tool_call_id": it.call_id, "content": escape(it.output or "")}, []))
                continue
            parts, audios = [], []
            for p in it.parts:
                if p.type != "input_audio":
                    parts.append({"type": "text", "text": escape(p.text or "")})
                elif self.embed_audio:
                    audios.append((p.pcm, p.rate))
                    parts.append({"type": "audio"})
                else:
                    text = await asyncio.shield(p.asr) if p.asr is not None else (p.transcript or "")
                    parts.append({"type": "text", "text": escape(text)})
            skip = it.role == "assistant" and not any(p.get("text") for p in parts)
            turns.append((None if skip else {"role": it.role, "content": flatten(parts, None, self.audio_tok,
                                                                                 self.structured)}, audios))
        return head, turns

    async def build_request(self, resp: ResponseState) -> tuple[RouterRequest, int]:
        """The router request of a response and its number of audio placeholder tokens.

        Keeps the newest items whose prompt plus ``max_output_tokens`` (at least one
        token) fits ``max_model_len`` (the oldest are dropped); the prompt is rendered in
        the CPU pool, at most ``2 + ceil(log2(len(items)))`` times (``_fit``).

        Raises:
            ClientError: nothing to answer, or the newest item alone is too long.
            InvalidRequestError / MediaError: from the processor.
            CapacityError: the CPU pool is full.
        """
        head, turns = await self.messages(list(resp.items), resp.instructions)
        plan: ToolPlan | None = resp.tools
        processed = await self.cpu.run(self._fit, head, turns, resp.max_output_tokens, plan)
        constraint = None
        if plan is not None:
            try:
                constraint = await self.cpu.run(plan.constraint, self.constraints.checked)
            except BadRequest as e:
                raise ClientError(str(e), e.param) from None
        n = len(processed.prompt_token_ids)
        max_tokens = self.max_model_len - n if resp.max_output_tokens == "inf" else resp.max_output_tokens
        sp = SamplingParams(temperature=resp.temperature, max_tokens=max_tokens, structured_outputs=constraint)
        req = RouterRequest(f"{resp.id}-{uuid.uuid4().hex[:6]}", processed.prompt_token_ids,
                            sp, processed.items, processed.placeholders)
        audio_tokens = sum(p.length for p, it in zip(processed.placeholders, processed.items)
                           if it.modality == "audio")
        return req, audio_tokens

    def _render(self, head: list[dict], turns: list[_Turn], k: int, plan: ToolPlan | None = None) -> list[int]:
        """Token ids of the chat template over ``head``, the messages of ``turns[k:]`` and
        the tools of ``plan``."""
        msgs = head + [m for m, _ in turns[k:] if m is not None]
        try:
            text = apply_template(self.tokenizer, msgs, plan, self.native_tools, self.tool_parser)
        except Exception as e:  # jinja raises for conversations the template rejects
            raise ClientError(f"the model's chat template rejected the conversation: {e}") from None
        return self.literal.encode(text)

    def _process(self, ids: list[int], turns: list[_Turn], k: int) -> ProcessedPrompt:
        """The processor's prompt of ``ids``, the render of ``turns[k:]``, with their clips."""
        audios = [a for _, clips in turns[k:] for a in clips]
        return self.processor.process(ids, {"audio": audios} if audios else None)

    def _fit(self, head: list[dict], turns: list[_Turn], max_output_tokens: int | str,
             plan: ToolPlan | None = None) -> ProcessedPrompt:
        """The prompt of the newest turns, as many as leave ``max_output_tokens`` (at least
        one token) of ``max_model_len``; runs in the CPU pool.

        The same prompt as dropping the oldest turn and re-rendering until it fits, since
        dropping turns only shortens a prompt, but the first turn kept is found by
        bisection: ``2 + ceil(log2(len(turns)))`` renders at most (one when everything
        fits), and each clip's features are computed at most twice.

        Raises:
            ClientError: the template rejects the messages, or the newest turn alone is too long.
        """
        limit = self.max_model_len - (1 if max_output_tokens == "inf" else max_output_tokens)
        full = self._process(self._render(head, turns, 0, plan), turns, 0)
        n = len(full.prompt_token_ids)
        if n <= limit:
            return full
        # extra[k]: the tokens the clips of turns[k:] add past their placeholder token (full.items: the clips, in order)
        extra = [0] * (len(turns) + 1)
        clip_tokens = reversed([it.num_tokens - 1 for it in full.items])
        for k in range(len(turns) - 1, -1, -1):
            extra[k] = extra[k + 1] + sum(next(clip_tokens) for _ in turns[k][1])
        ids: dict[int, list[int]] = {}

        def size(k: int) -> int:
            ids[k] = self._render(head, turns, k, plan)
            return len(ids[k]) + extra[k]

        lo, hi = 0, len(turns) - 1  # turns[lo:] is too long; turns[hi:] is the last candidate
        if hi > 0:
            n = size(hi)
        if n > limit:
            raise ClientError(f"the newest item alone makes a {n}-token prompt; with max_output_tokens "
                              f"{max_output_tokens} it does not fit max_model_len {self.max_model_len}", None,
                              "context_length_exceeded")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if size(mid) <= limit:
                hi = mid
            else:
                lo = mid
        return self._process(ids[hi], turns, hi)


def _failure(e: Exception) -> dict:
    """``status_details`` of a response that failed with ``e``."""
    if isinstance(e, CapacityError):  # the API's CPU pool is full: a later response may get through
        return {"type": "failed", "error": {"type": "server_error", "code": "service_unavailable", "message": str(e)}}
    code = getattr(e, "code", None) or ("invalid_request" if isinstance(e, (InvalidRequestError, MediaError))
                                        else "server_error")
    return {"type": "failed", "error": {"type": "invalid_request_error" if code != "server_error"
                                        else "server_error", "code": code, "message": str(e)}}


class SpeechOut:
    """An audio response's speech: its phrases, in order, through the tts pool
    (``Router.synthesize``), each chunk sent as ``response.output_audio.delta`` in the
    response's format as it comes; ``part.marks`` records (audio ms, transcript chars)
    at each phrase's end. Runs as one task beside the response's token stream, so the
    first phrase is spoken while the rest of the answer decodes."""

    def __init__(self, stream: ResponseStream) -> None:
        self.stream, self.resp = stream, stream.resp
        self.phrases: asyncio.Queue[tuple[str, int] | None] = asyncio.Queue()
        self.audio_ms = 0.0
        self.speaking: int | None = None  # chars_end of the phrase being spoken
        self.first_audio_at: float | None = None  # loop time of the first audio delta
        self.task = asyncio.create_task(self._run())

    def say(self, text: str, chars_end: int) -> None:
        """Speak ``text``, the phrase whose end is at transcript character ``chars_end``."""
        if text.strip():
            self.phrases.put_nowait((text, chars_end))
        else:
            self.phrases.put_nowait(("", chars_end))

    async def finish(self) -> None:
        """Wait until every phrase is spoken. Raises the synthesis failure, if one happened."""
        self.phrases.put_nowait(None)
        await self.task

    async def cancel(self) -> None:
        """Stop speaking (barge-in); the transcript keeps what was spoken, the phrase cut
        off included (its mark is where its audio stopped)."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        part = self.resp.item.parts[0]
        if self.speaking is not None and self.audio_ms > part.audio_ms:
            part.marks.append((self.audio_ms, self.speaking))
        part.text = (part.text or "")[:part.marks[-1][1] if part.marks else 0]

    async def _run(self) -> None:
        resp, part = self.resp, self.resp.item.parts[0]
        fmt, api, ids = resp.audio_format, self.stream.api, self.stream.ids
        for k in itertools.count():
            phrase = await self.phrases.get()
            if phrase is None:
                return
            text, chars_end = phrase
            self.speaking = chars_end
            if text:
                async for pcm in api.router.synthesize(f"{resp.id}-tts{k}", text, resp.voice):
                    data = fmt.encode(pcm, TTS_SAMPLE_RATE)
                    self.audio_ms += fmt.duration_ms(len(data))
                    if self.first_audio_at is None:
                        self.first_audio_at = asyncio.get_running_loop().time()
                    self.stream.session.emit("response.output_audio.delta", **ids, output_index=self.stream.msg_index,
                                             content_index=0,
                                             delta=base64.b64encode(data).decode())
            part.marks.append((self.audio_ms, chars_end))
            self.speaking = None


class ResponseStream:
    """The response task of a ``RealtimeSession``: prompt -> router -> deltas and
    segments (and, for an audio response, speech: ``SpeechOut``) -> done. Cancellation
    (barge-in) lands here and ends as status ``cancelled``.

    ``session`` gives ``api`` (router, tokenizer, prompt, metrics), ``emit``,
    ``insert``, ``conversation_id``, ``input_ms``, ``active`` (cleared when this response
    ends) and ``response_finished`` (told then).
    """

    def __init__(self, session, resp: ResponseState) -> None:
        self.session, self.resp, self.api = session, resp, session.api
        self.segmenter = PhraseSegmenter()
        self.n_segments = 0
        self.chars = 0  # transcript characters segmented so far
        self.ids = {"response_id": resp.id}
        self.audio = "audio" in resp.modalities
        self.speech: SpeechOut | None = None
        plan = resp.tools
        self.calls = CallStream(plan, self) if plan is not None and plan.parses else None
        self.msg_index = 0  # the message's output_index

    def _segment(self, seg) -> None:
        self.session.emit("response.output_text.segment", **self.ids, output_index=self.msg_index, content_index=0,
                          segment_index=self.n_segments, text=seg.text, reason=seg.reason)
        self.n_segments += 1
        self.chars += len(seg.text)
        if self.speech is not None and seg.reason != "cancelled":
            self.speech.say(seg.text, self.chars)

    async def run(self) -> None:
        s, resp = self.session, self.resp
        timer = RequestTimer(self.api.metrics)
        started_ms = s.input_ms
        try:
            try:
                req, audio_tokens = await self.api.prompt.build_request(resp)
                detok = IncrementalDetokenizer(self.api.tokenizer, req.prompt_token_ids)
                self._open(len(req.prompt_token_ids), audio_tokens)
                reason = await self._generate(req, detok, timer)
                if self.speech is not None:
                    last = self.segmenter.flush("end")
                    if last is not None:
                        self._segment(last)
                    await self.speech.finish()
                timer.finished = True
                if reason == "length":
                    resp.status, resp.status_details = "incomplete", {"type": "incomplete",
                                                                      "reason": "max_output_tokens"}
                else:
                    resp.status, resp.status_details = "completed", {"type": "completed"}
            except asyncio.CancelledError:
                if self.speech is not None:
                    await self.speech.cancel()
                if self.calls is not None:
                    self.calls.cancel()
                resp.status = "cancelled"
                resp.status_details = {"type": "cancelled", "reason": resp.cancel_reason or "client_cancelled"}
            except (ClientError, CapacityError, InvalidRequestError, MediaError, RequestError) as e:
                if self.speech is not None:
                    await self.speech.cancel()
                if self.calls is not None:
                    self.calls.cancel()
                timer.finished = True
                resp.status, resp.status_details = "failed", _failure(e)
            finally:
                timer.close()
            self._close()
        finally:
            if s.active is resp:
                s.active = None
                s.response_finished(resp, started_ms, self.speech.audio_ms if self.speech is not None else 0.0)

    def _open(self, prompt_tokens: int, audio_tokens: int) -> None:
        """Usage so far and, unless the output may be a tool call (then the message opens
        at its first word), the assistant message."""
        self.resp.usage = {"total_tokens": prompt_tokens, "input_tokens": prompt_tokens, "output_tokens": 0,
                           "input_token_details": {"cached_tokens": 0, "audio_tokens": audio_tokens,
                                                   "text_tokens": prompt_tokens - audio_tokens, "image_tokens": 0},
                           "output_token_details": {"text_tokens": 0, "audio_tokens": 0}}
        if self.calls is None:
            self._open_message()

    def _open_message(self) -> None:
        """The assistant message item, and the events that open it."""
        s, resp = self.session, self.resp
        resp.item = Item(new_id("item"), "assistant", [Part("output_audio" if self.audio else "output_text",
                                                             text="")], "in_progress")
        self.msg_index = len(resp.outputs)
        resp.outputs.append(resp.item)
        self.ids["item_id"] = resp.item.id
        if resp.in_conversation:
            prev = s.insert(resp.item, None)
            s.emit_item_added(resp.item, prev)
        s.emit("response.output_item.added", response_id=resp.id, output_index=self.msg_index,
               item=resp.item.to_json())
        s.emit("response.content_part.added", **self.ids, output_index=self.msg_index, content_index=0,
               part={"type": "audio", "transcript": ""} if self.audio else {"type": "text", "text": ""})
        if self.audio:
            self.speech = SpeechOut(self)

    async def _generate(self, req: RouterRequest, detok: IncrementalDetokenizer, timer: RequestTimer) -> str | None:
        """Stream the router's tokens as deltas and segments; the finish reason."""
        resp = self.resp
        gen = self.api.router.generate(req)
        try:
            async for ev in gen:
                timer.on_tokens(len(ev.token_ids))
                resp.usage["output_tokens"] += len(ev.token_ids)
                resp.usage["input_token_details"]["cached_tokens"] = min(ev.num_cached_tokens,
                                                                         len(req.prompt_token_ids))
                done = ev.finished
                detok.update(ev.token_ids)
                delta = detok.get_next_output_text(done, delta=True)
                if self.calls is not None and (delta or done):
                    delta = self.calls.feed(delta, done)  # what is not a tool call
                if delta:
                    if resp.item is None:
                        self._open_message()
                    resp.text.append(delta)
                    resp.item.parts[0].text = "".join(resp.text)
                    self.session.emit("response.output_audio_transcript.delta" if self.audio else
                                      "response.output_text.delta", **self.ids, output_index=self.msg_index,
                                      content_index=0, delta=delta)
                    for seg in self.segmenter.feed(delta):
                        self._segment(seg)
                if done:
                    if not resp.outputs:  # no word and no call: an empty message
                        self._open_message()
                    return ev.finish_reason
        finally:
            await gen.aclose()
        return None

    def _close(self) -> None:
        """The last segment, the events that close the output, and ``response.done``."""
        s, resp = self.session, self.resp
        if resp.item is not None:
            last = self.segmenter.flush("cancelled" if resp.status == "cancelled" else "end")
            if last is not None:
                self._segment(last)
            text = resp.item.parts[0].text if self.audio else "".join(resp.text)
            resp.item.status = "completed" if resp.status == "completed" else "incomplete"
            if self.audio:
                s.emit("response.output_audio.done", **self.ids, output_index=self.msg_index, content_index=0)
                s.emit("response.output_audio_transcript.done", **self.ids, output_index=self.msg_index, content_index=0,
                       transcript=text)
                s.emit("response.content_part.done", **self.ids, output_index=self.msg_index, content_index=0,
                       part={"type": "audio", "transcript": text})
            else:
                s.emit("response.output_text.done", **self.ids, output_index=self.msg_index, content_index=0, text=text)
                s.emit("response.content_part.done", **self.ids, output_index=self.msg_index, content_index=0,
                       part={"type": "text", "text": text})
            s.emit("response.output_item.done", response_id=resp.id, output_index=self.msg_index, item=resp.item.to_json())
            if resp.in_conversation:
                s.emit("conversation.item.done", item=resp.item.to_json())
        if resp.usage is not None:
            resp.usage["total_tokens"] = resp.usage["input_tokens"] + resp.usage["output_tokens"]
            resp.usage["output_token_details"]["text_tokens"] = resp.usage["output_tokens"]
        s.emit("response.done", response=resp.to_json(s.conversation_id))


class Transcriber:
    """Text-only models: each committed audio part is transcribed in the E pool as
    soon as it arrives; ``emit`` sends the ``...input_audio_transcription.*`` events;
    ``cpu``: the pool that decodes and resamples the clips (default: ``shared_pool()``).

    Early transcription (server VAD): ``start_early`` transcribes a turn's audio up to a
    pause while the turn may still go on; when the turn then ends at that pause (no
    speech since), its commit takes that transcript instead of starting again, so the
    transcript is ready about when the silence that ends the turn is over.
    """

    def __init__(self, api, emit, cpu: CpuPool | None = None) -> None:
        self.api, self.emit, self.cpu = api, emit, cpu or shared_pool()
        self.tasks: set[asyncio.Task] = set()
        self.early: tuple[int, asyncio.Task] | None = None  # (speech end ms, transcription of the turn so far)

    @property
    def transcribes(self) -> bool:
        return self.api.processor.modalities.get("audio") == "transcribe"

    def start_early(self, data: bytes, rate: int, speech_end_ms: int) -> None:
        """Transcribe ``data`` (PCM16 at ``rate``: a turn up to ``speech_end_ms``) now; an
        earlier early transcription is dropped."""
        self.drop_early()
        if self.transcribes and data:
            from epd.api.realtime_events import pcm_array

            task = asyncio.create_task(self._recognize(pcm_array(data), rate))
            task.add_done_callback(_quiet)
            self.early = (speech_end_ms, task)

    def drop_early(self) -> None:
        if self.early is not None:
            self.early[1].cancel()
            self.early = None

    def start(self, item: Item, early_ms: int | None = None) -> None:
        """Transcribe each audio part of ``item``, starting now, or (a committed turn
        that ended at ``early_ms``) from its early transcription."""
        early, self.early = self.early, None
        if early is not None and (early_ms is None or early[0] != early_ms):
            early[1].cancel()  # speech went on after that pause: stale
            early = None
        if not self.transcribes:
            return
        for idx, part in enumerate(item.parts):
            if part.type == "input_audio":
                self._task(item, idx, part, early[1] if early is not None else None)
                early = None

    def retry_failed(self, items: list[Item]) -> None:
        """A clip whose transcription failed (a pool down, a timeout) is tried again by the next response."""
        for item in items:
            for idx, part in enumerate(item.parts):
                if part.asr is not None and part.asr.done() and (part.asr.cancelled() or part.asr.exception()):
                    self._task(item, idx, part)

    def cancel_all(self) -> None:
        self.drop_early()
        for t in list(self.tasks):
            t.cancel()

    def _task(self, item: Item, idx: int, part: Part, early: asyncio.Task | None = None) -> None:
        part.asr = asyncio.create_task(self._transcribe(item, idx, part, early))
        self.tasks.add(part.asr)
        part.asr.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # reported as a transcription.failed event; a response awaiting it fails

    async def _recognize(self, pcm, rate: int) -> str:
        """The transcript of one clip (int16 ``[samples]`` at ``rate``) from the E pool. A
        pool that is down (503: e.g. its worker missed heartbeats on a busy machine) is
        retried for ``ASR_RETRY_S``."""
        rid = new_id("asr")  # the server's own: a client's item id is the client's, not unique across sessions
        media = await self.cpu.run(self.api.processor.audio_item, (pcm, rate))
        deadline = asyncio.get_running_loop().time() + ASR_RETRY_S
        for attempt in itertools.count():
            try:
                (text,) = await self.api.router.transcribe(f"{rid}.{attempt}", [media])
                return text
            except RequestError as e:
                if e.status != 503 or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.25)
        raise AssertionError("unreachable")

    async def _transcribe(self, item: Item, idx: int, part: Part, early: asyncio.Task | None = None) -> str:
        """The part's transcript (the early one's when given and it succeeded), then the
        ``.delta`` (the whole text, as OpenAI's whisper-1 sends it) and ``.completed``
        events; ``.failed`` when it cannot be had."""
        try:
            text = None
            if early is not None:
                try:
                    text = await early
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise
                except Exception:  # noqa: BLE001 - tried again below, on the whole clip
                    text = None
            if text is None:
                text = await self._recognize(part.pcm, part.rate)
        except asyncio.CancelledError:
            if early is not None:
                early.cancel()
            raise
        except Exception as e:
            self.emit("conversation.item.input_audio_transcription.failed", item_id=item.id, content_index=idx,
                      error={"type": "transcription_error", "code": None, "message": str(e), "param": None})
            raise
        part.transcript = text.strip()
        part.pcm = None  # the transcript is what the model hears from now on
        if part.transcript:
            self.emit("conversation.item.input_audio_transcription.delta", item_id=item.id, content_index=idx,
                      delta=part.transcript)
        self.emit("conversation.item.input_audio_transcription.completed", item_id=item.id, content_index=idx,
                  transcript=part.transcript)
        return part.transcript


def _quiet(task: asyncio.Task) -> None:
    """Retrieve an early transcription's failure (its commit, if any, reports it)."""
    if not task.cancelled():
        task.exception()
