"""``/v1/realtime`` answering: the response task that streams a response's deltas and
segments (``ResponseStream``) and, for an audio response, speaks its phrases on the tts
pool as they complete (``SpeechOut``). The protocol is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import base64
import itertools

from epd.api.realtime.conversation import Item, Part, ResponseState
from epd.api.realtime.protocol import ClientError, new_id
from epd.api.realtime.segmenter import PhraseSegmenter
from epd.api.realtime.tools import CallStream
from epd.api.streaming import RequestTimer
from epd.detokenizer import IncrementalDetokenizer
from epd.encoders.media_limits import MediaError
from epd.errors import CapacityError, InvalidRequestError
from epd.router.pipeline import TTS_SAMPLE_RATE
from epd.router.router import RequestError, RouterRequest


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
                s.emit("response.output_audio_transcript.done", **self.ids, output_index=self.msg_index,
                       content_index=0, transcript=text)
                s.emit("response.content_part.done", **self.ids, output_index=self.msg_index, content_index=0,
                       part={"type": "audio", "transcript": text})
            else:
                s.emit("response.output_text.done", **self.ids, output_index=self.msg_index, content_index=0, text=text)
                s.emit("response.content_part.done", **self.ids, output_index=self.msg_index, content_index=0,
                       part={"type": "text", "text": text})
            s.emit("response.output_item.done", response_id=resp.id, output_index=self.msg_index,
                   item=resp.item.to_json())
            if resp.in_conversation:
                s.emit("conversation.item.done", item=resp.item.to_json())
        if resp.usage is not None:
            resp.usage["total_tokens"] = resp.usage["input_tokens"] + resp.usage["output_tokens"]
            resp.usage["output_token_details"]["text_tokens"] = resp.usage["output_tokens"]
        s.emit("response.done", response=resp.to_json(s.conversation_id))
