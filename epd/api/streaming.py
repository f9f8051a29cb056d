"""Running a request's choices through the router and answering them: one JSON body,
or a stream of server-sent events in OpenAI's chunk shapes (``chat.completion.chunk`` /
``text_completion``, an optional usage chunk, then ``data: [DONE]``). Also the API's
per-request latency metrics (``RequestTimer``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from epd.api.logprobs import LogprobFormatter
from epd.api.protocol import SamplingFields, error_body
from epd.detokenizer import IncrementalDetokenizer
from epd.router.router import RequestError, Router, RouterRequest, TokenEvent

logger = logging.getLogger(__name__)


class RequestTimer:
    """Records TTFT, ITL, TPOT and end-to-end latency of one request (API view),
    and counts it as cancelled when it ends before its last token (client gone)."""

    def __init__(self, metrics) -> None:
        self.m = metrics
        self.labels = {"pool": "api", "instance": "api"}
        self.arrival = time.monotonic()
        self.first = self.last = None
        self.n = 0
        self.finished = False  # reached its end: last token, or a stop string
        self.closed = False

    def on_tokens(self, count: int) -> None:
        if not count or self.m is None:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m.time_to_first_token.labels(**self.labels).observe(now - self.arrival)
        else:
            self.m.inter_token_latency.labels(**self.labels).observe(now - self.last)
        self.last = now
        self.n += count

    def close(self) -> None:
        """Record the request's latencies once (idempotent)."""
        if self.m is None or self.closed:
            return
        self.closed = True
        if self.last is not None:
            self.m.e2e_request_latency.labels(**self.labels).observe(self.last - self.arrival)
            if self.n > 1:
                self.m.time_per_output_token.labels(**self.labels).observe((self.last - self.first) / (self.n - 1))
        if not self.finished:
            self.m.cancelled_requests.labels(**self.labels).inc()


class Choice:
    """One of the ``n`` choices of a request: its router request, detokenizer
    (with stop strings), token count and pending logprobs."""

    def __init__(self, index: int, req: RouterRequest, detok: IncrementalDetokenizer) -> None:
        self.index, self.req, self.detok = index, req, detok
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list = []  # TokenLogprob, not yet sent (streaming) / all (non-streaming)
        self.done = False
        self.counts_prompt = True  # the first choice of its prompt (usage counts each prompt once)
        self.tools = None  # the request's ToolPlan (epd.api.tools) when its output is parsed for tool calls
        self.calls: ToolCallStream | None = None

    def parse_tools(self, plan) -> None:
        """Parse this choice's output for tool calls in ``plan``'s format (``plan.parses``)."""
        self.tools, self.calls = plan, ToolCallStream(plan)

    def update(self, ev: TokenEvent) -> None:
        """Apply one router event; sets ``done`` / ``finish_reason`` at the end or at a stop string."""
        self.num_cached_tokens = max(self.num_cached_tokens, ev.num_cached_tokens)
        self.logprobs.extend(lp for lp, t in zip(ev.logprobs, ev.token_ids) if lp.token_id == t)
        for t in ev.token_ids:  # one at a time: an event may carry several (speculative decoding)
            self.num_tokens += 1
            if self.detok.update([t]) is not None:
                self.finish_reason, self.done = "stop", True
                return
        if ev.finished:
            self.finish_reason, self.done = ev.finish_reason or "stop", True


class ToolCallStream:
    """One choice's tool calls as they stream: OpenAI's ``delta.tool_calls`` entries (index,
    id, type and name first, then argument fragments), and the whole message at the end.
    Without ``parallel_tool_calls`` only the first call is kept."""

    def __init__(self, plan) -> None:
        self.parser = plan.parser()
        self.parallel = plan.parallel
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def delta(self, text: str, done: bool) -> tuple[str, list[dict]]:
        """The content and ``tool_calls`` delta entries of the output's next ``text``."""
        parts = [self.parser.feed(text)] + ([self.parser.finish()] if done else [])
        content, entries = "", []
        for part in parts:
            content += part.content
            for c in part.calls:
                if c.index > 0 and not self.parallel:
                    continue
                entry = {"index": c.index}
                if c.name is not None:
                    self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                    entry.update(id=self.ids[c.index], type="function", function={"name": c.name,
                                                                                    "arguments": c.arguments})
                else:
                    entry["function"] = {"arguments": c.arguments}
                entries.append(entry)
        return content, entries

    @property
    def cut(self) -> bool:
        """A kept call began and never finished (``max_tokens`` or a stop string ended the output in it)."""
        return self.parser.cut_at is not None and (self.parallel or not self.parser.frozen)

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for an output that ended by calling tools (each call whole),
        else ``reason``, the output's own."""
        return "tool_calls" if reason == "stop" and self.num_calls and not self.cut else reason

    def message(self, text: str) -> dict:
        """The non-streamed ``message`` of the whole output ``text``: content (None when
        empty and there are calls) and ``tool_calls``, whole calls only: a call cut short
        (see ``cut``) stays text, in ``content``, as vLLM's parsers leave it."""
        content, entries = self.delta(text, True)
        calls: list[dict] = []
        for e in entries:
            if "id" in e:
                calls.append({"id": e["id"], "type": "function", "function": dict(e["function"])})
            else:
                calls[e["index"]]["function"]["arguments"] += e["function"]["arguments"]
        if self.cut:
            calls = calls[:len(self.parser.frozen)]
            if self.parser.content_sent <= self.parser.cut_at:  # not yet released as content
                content += text[self.parser.cut_at:]
        msg = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
        if calls:
            msg["tool_calls"] = calls
        return msg


def usage_of(choices: list[Choice]) -> dict:
    """OpenAI's ``usage`` of a request's choices (each prompt counted once, whatever ``n``)."""
    firsts = [c for c in choices if c.counts_prompt]  # each prompt counts once, whatever n
    prompt_tokens = sum(len(c.req.prompt_token_ids) for c in firsts)
    completion = sum(c.num_tokens for c in choices)
    cached = sum(min(max(x.num_cached_tokens for x in choices if x.req.prompt_token_ids is c.req.prompt_token_ids),
                     len(c.req.prompt_token_ids)) for c in firsts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(c: Choice) -> str | None:
    """``tool_calls`` for a choice that ended by calling tools, else its own reason."""
    return c.finish_reason if c.calls is None else c.calls.finish_reason(c.finish_reason)


async def until_disconnected(request: Request) -> None:
    """Return once the HTTP client has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def _time_tokens(timer: RequestTimer, choice: Choice, ev: TokenEvent) -> None:
    """The timer follows the first choice."""
    if choice.index == 0:
        timer.on_tokens(len(ev.token_ids))


class CompletionResponder:
    """Answers chat and completions requests whose choices are ready to run."""

    def __init__(self, router: Router, model_name: str, logprobs: LogprobFormatter) -> None:
        self.router, self.model_name, self.logprobs = router, model_name, logprobs

    async def drive(self, choice: Choice, on_event) -> None:
        """Run one choice through the router until it is done (or a stop string)."""
        gen = self.router.generate(choice.req)
        try:
            async for ev in gen:
                choice.update(ev)
                await on_event(choice, ev)
                if choice.done:
                    break
        finally:
            await gen.aclose()

    async def run_all(self, choices: list[Choice], on_event) -> None:
        """Drive every choice concurrently; the first failure (or cancellation) stops them all."""
        tasks = [asyncio.ensure_future(self.drive(c, on_event)) for c in choices]
        try:
            for t in asyncio.as_completed(tasks):
                await t
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def respond(self, request: Request, body: SamplingFields, rid: str, choices: list[Choice], chat: bool,
                      timer: RequestTimer, release) -> Response:
        """The response to a request: ``release()`` (once) and ``timer.close()`` when it ends.

        Non-streamed: the whole body, 499 when the client left first; raises
        ``RequestError`` when a choice failed. Streamed: SSE, a failure becomes an
        error chunk followed by ``[DONE]``.
        """
        if not body.stream:
            return await self._complete(request, rid, choices, chat, timer, release)
        stream = _SseStream(self, body, rid, choices, chat, timer)

        # The background task runs even when the client left before the stream
        # started (then the stream never runs): such a request still counts as cancelled.
        def cleanup() -> None:
            timer.close()
            release()

        return StreamingResponse(stream.events(release), media_type="text/event-stream",
                                 background=BackgroundTask(cleanup))

    async def _complete(self, request: Request, rid: str, choices: list[Choice], chat: bool, timer: RequestTimer,
                        release) -> Response:
        want_lp = choices[0].req.params.logprobs is not None

        async def on_event(choice: Choice, ev: TokenEvent) -> None:
            _time_tokens(timer, choice, ev)

        try:
            work = asyncio.ensure_future(self.run_all(choices, on_event))
            watch = asyncio.ensure_future(until_disconnected(request))
            try:
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                if not work.done():  # client gone: abort every choice on every pool
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
            if work.cancelled():
                return Response(status_code=499)
            work.result()  # raises RequestError
            timer.finished = True
        finally:
            timer.close()
            release()
        out = []
        for c in choices:
            text = c.detok.get_next_output_text(True, delta=False)
            lp = self.logprobs.format(c.logprobs, chat) if want_lp else None
            message = ({"role": "assistant", "content": text, "refusal": None} if c.calls is None
                       else c.calls.message(text))
            out.append({"index": c.index, "message": message, "logprobs": lp,
                        "finish_reason": _finish_reason(c)} if chat else
                       {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name,
                             "choices": out, "usage": usage_of(choices), "system_fingerprint": None})


class _SseStream:
    """One streamed response: a chunk per choice's delta (chat: after a first
    ``role`` chunk per choice), the usage chunk when ``stream_options.include_usage``,
    then ``data: [DONE]``."""

    def __init__(self, responder: CompletionResponder, body: SamplingFields, rid: str, choices: list[Choice],
                 chat: bool, timer: RequestTimer) -> None:
        self.responder, self.rid, self.choices, self.chat, self.timer = responder, rid, choices, chat, timer
        self.want_lp = choices[0].req.params.logprobs is not None
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.stamp = int(time.time())
        self.text_offsets = [0] * len(choices)
        self.queue: asyncio.Queue | None = None

    def chunk(self, choice_objs: list[dict], usage: dict | None = None) -> str:
        """One SSE event; it carries ``usage`` (None but in the last one) when usage is asked for."""
        data = {"id": self.rid, "object": self.obj, "created": self.stamp, "model": self.responder.model_name,
                "system_fingerprint": None, "choices": choice_objs}
        if self.include_usage:
            data["usage"] = usage
        return "data: " + json.dumps(data, ensure_ascii=False) + "\n\n"

    def delta_chunk(self, c: Choice, text: str, reason: str | None) -> str | None:
        """The chunk of a choice's new text (or tool calls), logprobs and finish reason (None: nothing new)."""
        lps, c.logprobs = c.logprobs, []
        calls: list[dict] = []
        if c.calls is not None:
            text, calls = c.calls.delta(text, reason is not None)
            reason = _finish_reason(c) if reason is not None else None
        if not text and not reason and not lps and not calls:
            return None
        lp = None
        if self.want_lp and lps:
            lp = self.responder.logprobs.format(lps, self.chat, self.text_offsets[c.index])
        self.text_offsets[c.index] += len(text)
        if self.chat:
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            return self.chunk([{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}])
        return self.chunk([{"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason}])

    async def on_event(self, choice: Choice, ev: TokenEvent) -> None:
        _time_tokens(self.timer, choice, ev)
        text = choice.detok.get_next_output_text(choice.done, delta=True)
        out = self.delta_chunk(choice, text, choice.finish_reason if choice.done else None)
        if out is not None:
            await self.queue.put(out)

    async def run_one(self, choice: Choice) -> None:
        """Drive one choice, queueing its chunks, a ``RequestError``, then None (its end)."""
        try:
            await self.responder.drive(choice, self.on_event)
            if not choice.done:  # the stream ended without a last event
                choice.finish_reason, choice.done = choice.finish_reason or "stop", True
                out = self.delta_chunk(choice, choice.detok.get_next_output_text(True, delta=True), "stop")
                if out:
                    await self.queue.put(out)
        except RequestError as e:
            await self.queue.put(e)
        except Exception as e:  # our fault: the client gets an error event, not a silent end
            logger.exception("stream %s failed", self.rid)
            await self.queue.put(RequestError(f"internal server error ({type(e).__name__}: {e})", status=500))
        finally:
            await self.queue.put(None)

    async def events(self, release):
        """The SSE body; stops every choice and calls ``release()`` when it ends (or the client leaves)."""
        self.queue = asyncio.Queue()
        tasks = []
        try:
            if self.chat:
                for c in self.choices:
                    yield self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}])
            tasks = [asyncio.ensure_future(self.run_one(c)) for c in self.choices]
            running = len(tasks)
            while running:
                item = await self.queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, RequestError):
                    self.timer.finished = True  # failed, not cancelled by the client
                    yield "data: " + json.dumps(error_body(item.status if item.status < 600 else 500,
                                                           str(item))) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield item
            self.timer.finished = True
            if self.include_usage:
                yield self.chunk([], usage_of(self.choices))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:  # client gone (or failed): abort every choice on every pool
                t.cancel()
            for t in tasks:
                try:
                    await t
                except asyncio.CancelledError:
                    pass
            self.timer.close()
            release()
