"""OpenAI-compatible HTTP API over the router.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as SSE or
not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` and ``GET /epd/workers``.
Tokenization, chat templates, media decoding (and fetching, for allowlisted
hosts) and detokenization with stop strings happen here; workers see token ids
and preprocessed tensors. Request and response shapes follow OpenAI's API
reference (chat completions, completions, error bodies, stream chunks) as the
official ``openai`` SDK parses them; vLLM's OpenAI server is the model for the
extras (``top_k``, ``ignore_eos``) and for logprobs from the raw distribution.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from epd.api.media_fetch import MediaFetcher
from epd.detokenizer import IncrementalDetokenizer
from epd.encoders.media import MediaError
from epd.encoders.processor import AUDIO_PLACEHOLDER, MultiModalProcessor
from epd.errors import InvalidRequestError
from epd.messages import WireSamplingParams
from epd.router.router import RequestError, Router, RouterRequest, TokenEvent
from epd.sampling_params import MAX_LOGPROBS, SamplingParams


# ---- request bodies (OpenAI's shapes) -----------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Body):
    url: str
    detail: str | None = None


class InputAudio(_Body):
    data: str
    format: Literal["wav", "mp3"]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    n: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    ignore_eos: bool | None = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a text prompt, a list of token ids, or a batch of either
    (choice ``p * n + i`` is the i-th sample of prompt p)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    response_format: dict | None = None


# ---- errors -------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error", 504: "timeout_error"}
_ERROR_CODES = {401: "invalid_api_key", 413: "request_too_large", 429: "rate_limit_exceeded",
                503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code or _ERROR_CODES.get(status)}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(slots=True)
class ApiSettings:
    """Limits and switches of the HTTP front end (``epd launch`` flags).

    api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <key>`` (else 401).
    max_body_bytes: larger request bodies get 413.
    max_pending_requests: requests in flight at once (streams included); more get 429.
    max_n: largest ``n`` (choices per request).
    allowed_media_domains: hosts whose http(s) media URLs are fetched (empty: none).
    media_fetch_timeout_s / max_media_bytes: limits of one fetch.
    default_max_tokens: ``max_tokens`` when the request gives none (capped by the context
        left); None: the whole context left, as OpenAI and vLLM do.
    """

    api_key: str | None = None
    max_body_bytes: int = 64 * 2**20
    max_pending_requests: int = 256
    max_n: int = 8
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = 10.0
    max_media_bytes: int = 20 * 2**20
    default_max_tokens: int | None = None


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """ASGI middleware: API key check on ``/v1`` (401) and the body size limit (413,
    counted on the bytes actually received, so chunked bodies are limited too)."""

    def __init__(self, app, settings: ApiSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.settings
        headers = dict(scope.get("headers") or [])
        if s.api_key and scope["path"].startswith("/v1/"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(auth.encode(), f"Bearer {s.api_key}".encode()):
                resp = error_response(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'")
                return await resp(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > s.max_body_bytes):
            resp = error_response(413, f"the request body is over the {s.max_body_bytes}-byte limit")
            return await resp(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > s.max_body_bytes:
                    scope["epd.body_too_large"] = True
                    raise _BodyTooLarge
            return msg

        await self.app(scope, limited_receive, send)


class _RequestTimer:
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


class _Choice:
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

    def update(self, ev: TokenEvent) -> None:
        """Apply one router event; sets ``done`` / ``finish_reason`` at the end or at a stop string."""
        self.num_tokens += len(ev.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, ev.num_cached_tokens)
        self.logprobs.extend(lp for lp, t in zip(ev.logprobs, ev.token_ids) if lp.token_id == t)
        if self.detok.update(ev.token_ids) is not None:
            self.finish_reason, self.done = "stop", True
        elif ev.finished:
            self.finish_reason, self.done = ev.finish_reason or "stop", True


def build_app(router: Router, tokenizer, processor: MultiModalProcessor, *, model_name: str,
              max_model_len: int, default_max_tokens: int | None = None, metrics_render=None, metrics=None,
              settings: ApiSettings | None = None, vocab_size: int | None = None) -> FastAPI:
    """The FastAPI app. ``metrics_render() -> (bytes, content_type)`` serves /metrics;
    ``metrics`` (``epd.metrics.Metrics``) records per-request latencies;
    ``settings`` holds the limits (see ``ApiSettings``); ``vocab_size`` bounds
    token-id prompts (default: the tokenizer's length)."""
    settings = settings or ApiSettings()
    if default_max_tokens is not None:
        settings.default_max_tokens = default_max_tokens
    vocab_size = vocab_size or len(tokenizer)
    app = FastAPI(title="epd", version="0.1.0")
    app.add_middleware(GuardMiddleware, settings=settings)
    fetcher = MediaFetcher(settings.allowed_media_domains, max_bytes=settings.max_media_bytes,
                           timeout_s=settings.media_fetch_timeout_s)
    ids = itertools.count()
    created = int(time.time())
    pending = {"n": 0}
    tok_text_cache: dict[int, str] = {}

    # ---- error handlers: every error in OpenAI's body ------------------------------------
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        if request.scope.get("epd.body_too_large"):
            return error_response(413, f"the request body is over the {settings.max_body_bytes}-byte limit")
        if not errs:
            return error_response(400, "invalid request")
        if any(e.get("type") == "json_invalid" for e in errs):
            return error_response(400, "the request body is not valid JSON")
        e = max(errs, key=lambda e: len(e.get("loc", ())))  # a union's deepest branch says the most
        loc: list[str] = []
        for x in e.get("loc", ()):  # drop "body" and pydantic's union branch names; keep field names
            x = str(x)
            if x != "body" and "[" not in x and x not in ("str", "int", "float", "list") and loc[-1:] != [x]:
                loc.append(x)
        return error_response(400, f"invalid request: {e.get('msg')} at {'.'.join(loc) or 'body'}",
                              loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if request.scope.get("epd.body_too_large"):
            return error_response(413, f"the request body is over the {settings.max_body_bytes}-byte limit")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(_BodyTooLarge)
    async def on_too_large(request: Request, exc: _BodyTooLarge):
        return error_response(413, f"the request body is over the {settings.max_body_bytes}-byte limit")

    # ---- request -> router requests -----------------------------------------------------------
    def sampling(body: _SamplingFields, prompt_len: int, logprobs: int | None) -> tuple[SamplingParams, list[str]]:
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if prompt_len >= max_model_len:
            raise _BadRequest(f"the prompt has {prompt_len} tokens but max_model_len is {max_model_len}",
                              "messages" if isinstance(body, ChatRequest) else "prompt")
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
            if settings.default_max_tokens is not None:
                max_tokens = min(settings.default_max_tokens, max_tokens)
        elif prompt_len + max_tokens > max_model_len:
            raise _BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                              f"({max_model_len})", "max_tokens")
        if (body.n or 1) > settings.max_n:
            raise _BadRequest(f"n is {body.n}; this server allows at most {settings.max_n}", "n")
        stop = body.stop
        if isinstance(stop, list) and len(stop) > 16:
            raise _BadRequest("at most 16 stop strings are allowed", "stop")
        kw = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
              if getattr(body, k) is not None}
        try:
            sp = SamplingParams(**kw, seed=body.seed, max_tokens=max_tokens, stop=stop,
                                ignore_eos=bool(body.ignore_eos), logprobs=logprobs)
        except ValueError as e:
            raise _BadRequest(str(e)) from None
        return sp, list(sp.stop)

    def decode_b64(data: str, param: str) -> bytes:
        if data.startswith("data:"):
            header, _, data = data.partition(",")
            if ";base64" not in header:
                raise _BadRequest("data: URLs must be base64-encoded (data:<mime>;base64,...)", param)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise _BadRequest("invalid base64 media data", param) from None

    image_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["image"])
                 if "image" in processor.placeholder_ids else None)
    audio_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["audio"])
                 if "audio" in processor.placeholder_ids else AUDIO_PLACEHOLDER)
    structured = _template_takes_parts(tokenizer, image_tok, audio_tok if "audio" in processor.placeholder_ids
                                       else None)

    async def load_image(url: str, param: str) -> bytes:
        if url.startswith("data:"):
            return decode_b64(url, param)
        if url.startswith(("http://", "https://")):
            return await asyncio.to_thread(fetcher.fetch, url, "image")
        raise _BadRequest("image_url.url must be a data: URL or an http(s) URL on the allowed media domains", param)

    async def render_chat(body: ChatRequest, rid: str) -> tuple[str, dict]:
        """The chat template's text and the media items, in prompt order.

        Content parts become HF-style ``{"type": "image"}`` / ``{"type": "audio"}``
        entries when the model's template renders them; otherwise each item
        becomes its placeholder text inline (see ``_template_takes_parts``)."""
        images, audios, msgs = [], [], []
        for i, m in enumerate(body.messages):
            param = f"messages.{i}.content"
            if not isinstance(m.content, list):
                msgs.append({"role": m.role, "content": m.content or ""})
                continue
            parts: list[dict] = []
            for p in m.content:
                if isinstance(p, TextPart):
                    parts.append({"type": "text", "text": p.text})
                elif isinstance(p, ImagePart):
                    if image_tok is None:
                        raise _BadRequest("this model does not accept images", param)
                    images.append(await load_image(p.image_url.url, param))
                    parts.append({"type": "image"})
                else:
                    if "audio" not in processor.modalities:
                        raise _BadRequest("this model does not accept audio", param)
                    audios.append(decode_b64(p.input_audio.data, param))
                    parts.append({"type": "audio"})
                if len(images) + len(audios) > processor.max_items_per_prompt:
                    raise _BadRequest(f"at most {processor.max_items_per_prompt} media items per request", param)
            msgs.append({"role": m.role, "content": _flatten(parts, image_tok, audio_tok, structured)})
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images
        if audios and processor.modalities.get("audio") == "transcribe":
            # decoding media is CPU work: off the event loop, so other streams keep flowing
            items = await asyncio.to_thread(lambda: [processor.audio_item(a) for a in audios])
            texts = await router.transcribe(rid + "-asr", items)
            for msg in msgs:
                while AUDIO_PLACEHOLDER in msg["content"] and texts:
                    msg["content"] = msg["content"].replace(AUDIO_PLACEHOLDER, texts.pop(0), 1)
        elif audios:
            mm["audio"] = audios
        try:
            prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja raises for conversations the template rejects
            raise _BadRequest(f"the model's chat template rejected the messages: {e}", "messages") from None
        return prompt, mm

    def unsupported(body: _SamplingFields) -> None:
        """Fields epd cannot honour get a 400 rather than being silently ignored."""
        if body.logit_bias:
            raise _BadRequest("logit_bias is not supported", "logit_bias")
        if isinstance(body.stop, list) and len(body.stop) > 4:
            raise _BadRequest(f"stop takes at most 4 sequences, got {len(body.stop)}", "stop")
        if isinstance(body, CompletionRequest):
            if body.echo:
                raise _BadRequest("echo is not supported", "echo")
            if body.suffix:
                raise _BadRequest("suffix is not supported", "suffix")
            if body.best_of is not None and body.best_of != (body.n or 1):
                raise _BadRequest("best_of other than n is not supported", "best_of")
        else:
            if body.tools:
                raise _BadRequest("tools are not supported by this server", "tools")
            if body.response_format and body.response_format.get("type", "text") != "text":
                raise _BadRequest("only response_format {'type': 'text'} is supported", "response_format")

    async def prepare(body: _SamplingFields, prompts: list, mm: dict, chat: bool) -> tuple[str, list[_Choice]]:
        """One ``_Choice`` per (prompt, sample): index ``p * n + i``."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:20]}{next(ids)}"
        if len(prompts) * (body.n or 1) > settings.max_n:
            raise _BadRequest(f"{len(prompts)} prompt(s) x n={body.n or 1} choices; this server allows at most "
                              f"{settings.max_n} per request", "prompt" if len(prompts) > 1 else "n")
        choices: list[_Choice] = []
        for p, prompt in enumerate(prompts):
            choices += await prepare_one(body, prompt, mm, chat, rid, p)
        return rid, choices

    async def prepare_one(body: _SamplingFields, prompt: str | list[int], mm: dict, chat: bool, rid: str,
                          p: int) -> list[_Choice]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise _BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
            ids_ = prompt
        else:
            ids_ = tokenizer.encode(prompt, add_special_tokens=not chat)
        if not ids_:
            raise _BadRequest("the prompt is empty", "prompt")
        processed = await asyncio.to_thread(processor.process, ids_, mm) if mm else processor.process(ids_, mm)
        if isinstance(body, ChatRequest):
            if body.top_logprobs is not None and not body.logprobs:
                raise _BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        sp, stop = sampling(body, len(processed.prompt_token_ids), logprobs)
        choices = []
        n = body.n or 1
        for i in range(n):
            seed = None if sp.seed is None else (sp.seed + i) % 2**63  # n > 1: distinct, reproducible draws
            wire = msgspec.structs.replace(WireSamplingParams.from_params(sp), seed=seed)
            req = RouterRequest(f"{rid}-{p * n + i}", processed.prompt_token_ids, wire, processed.items,
                                processed.placeholders)
            choice = _Choice(p * n + i, req, IncrementalDetokenizer(tokenizer, processed.prompt_token_ids, stop=stop))
            choice.counts_prompt = i == 0
            choices.append(choice)
        return choices

    byte_level = _byte_level_alphabet(tokenizer)

    def token_text(t: int) -> str:
        s = tok_text_cache.get(t)
        if s is None:
            s = tokenizer.decode([t])
            if len(tok_text_cache) < 200_000:
                tok_text_cache[t] = s
        return s

    def token_bytes(t: int) -> list[int]:
        """The token's own UTF-8 bytes (a byte-level BPE token may hold part of a character)."""
        if byte_level is not None:
            piece = tokenizer.convert_ids_to_tokens(t)
            if isinstance(piece, str) and piece and all(ch in byte_level for ch in piece):
                return [byte_level[ch] for ch in piece]
        return list(token_text(t).encode("utf-8"))

    def chat_logprobs(lps: list) -> dict:
        def entry(t: int, lp: float) -> dict:
            return {"token": token_text(t), "logprob": lp, "bytes": token_bytes(t)}

        return {"content": [{**entry(x.token_id, x.logprob),
                             "top_logprobs": [entry(t, v) for t, v in zip(x.top_ids, x.top_logprobs)]}
                            for x in lps], "refusal": None}

    def completion_logprobs(lps: list, offset: int) -> dict:
        tokens = [token_text(x.token_id) for x in lps]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        tops = []
        for x in lps:  # {text: logprob}; tokens that decode to the same text keep the best one
            top: dict[str, float] = {}
            for t, v in zip(x.top_ids, x.top_logprobs):
                top.setdefault(token_text(t), v)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps], "top_logprobs": tops,
                "text_offset": offsets}

    async def drive(choice: _Choice, on_event) -> None:
        """Run one choice through the router until it is done (or a stop string)."""
        gen = router.generate(choice.req)
        try:
            async for ev in gen:
                choice.update(ev)
                await on_event(choice, ev)
                if choice.done:
                    break
        finally:
            await gen.aclose()

    async def run_all(choices: list[_Choice], on_event) -> None:
        """Drive every choice concurrently; the first failure (or cancellation) stops them all."""
        tasks = [asyncio.ensure_future(drive(c, on_event)) for c in choices]
        try:
            for t in asyncio.as_completed(tasks):
                await t
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def usage_of(choices: list[_Choice]) -> dict:
        firsts = [c for c in choices if c.counts_prompt]  # each prompt counts once, whatever n
        prompt_tokens = sum(len(c.req.prompt_token_ids) for c in firsts)
        completion = sum(c.num_tokens for c in choices)
        cached = sum(min(max(x.num_cached_tokens for x in choices if x.req.prompt_token_ids is c.req.prompt_token_ids),
                         len(c.req.prompt_token_ids)) for c in firsts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    async def until_disconnected(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    async def respond(request: Request, body: _SamplingFields, rid: str, choices: list[_Choice], chat: bool,
                      timer: _RequestTimer, release) -> Response:
        obj = "chat.completion" if chat else "text_completion"
        want_lp = choices[0].req.params.logprobs is not None

        async def on_event(choice: _Choice, ev: TokenEvent) -> None:
            if choice.index == 0:
                timer.on_tokens(len(ev.token_ids))

        if not body.stream:
            try:
                work = asyncio.ensure_future(run_all(choices, on_event))
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
                lp = None
                if want_lp:
                    lp = chat_logprobs(c.logprobs) if chat else completion_logprobs(c.logprobs, 0)
                out.append({"index": c.index, "message": {"role": "assistant", "content": text, "refusal": None},
                            "logprobs": lp, "finish_reason": c.finish_reason} if chat else
                           {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": out, "usage": usage_of(choices), "system_fingerprint": None})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        stamp = int(time.time())
        text_offsets = [0] * len(choices)

        def chunk(choice_objs: list[dict], usage: dict | None = None, with_usage: bool = include_usage) -> str:
            data = {"id": rid, "object": chunk_obj, "created": stamp, "model": model_name,
                    "system_fingerprint": None, "choices": choice_objs}
            if with_usage:
                data["usage"] = usage
            return "data: " + json.dumps(data, ensure_ascii=False) + "\n\n"

        def delta_chunk(c: _Choice, text: str, reason: str | None) -> str | None:
            lps, c.logprobs = c.logprobs, []
            if not text and not reason and not lps:
                return None
            lp = None
            if want_lp and lps:
                lp = chat_logprobs(lps) if chat else completion_logprobs(lps, text_offsets[c.index])
            text_offsets[c.index] += len(text)
            if chat:
                delta = {"content": text} if text else {}
                return chunk([{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}])
            return chunk([{"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason}])

        async def sse():
            queue: asyncio.Queue = asyncio.Queue()

            async def on_stream_event(choice: _Choice, ev: TokenEvent) -> None:
                await on_event(choice, ev)
                text = choice.detok.get_next_output_text(choice.done, delta=True)
                out = delta_chunk(choice, text, choice.finish_reason if choice.done else None)
                if out is not None:
                    await queue.put(out)

            async def run_one(choice: _Choice) -> None:
                try:
                    await drive(choice, on_stream_event)
                    if not choice.done:  # the stream ended without a last event
                        choice.finish_reason, choice.done = choice.finish_reason or "stop", True
                        out = delta_chunk(choice, choice.detok.get_next_output_text(True, delta=True), "stop")
                        if out:
                            await queue.put(out)
                except RequestError as e:
                    await queue.put(e)
                finally:
                    await queue.put(None)

            tasks = []
            try:
                if chat:
                    for c in choices:
                        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                tasks = [asyncio.ensure_future(run_one(c)) for c in choices]
                running = len(tasks)
                while running:
                    item = await queue.get()
                    if item is None:
                        running -= 1
                    elif isinstance(item, RequestError):
                        timer.finished = True  # failed, not cancelled by the client
                        yield "data: " + json.dumps(error_body(item.status if item.status < 600 else 500,
                                                               str(item))) + "\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        yield item
                timer.finished = True
                if include_usage:
                    yield chunk([], usage_of(choices))
                yield "data: [DONE]\n\n"
            finally:
                for t in tasks:  # client gone (or failed): abort every choice on every pool
                    t.cancel()
                for t in tasks:
                    try:
                        await t
                    except asyncio.CancelledError:
                        pass
                timer.close()
                release()

        # The background task runs even when the client left before the stream
        # started (then sse() never runs): such a request still counts as cancelled.
        def cleanup() -> None:
            timer.close()
            release()

        return StreamingResponse(sse(), media_type="text/event-stream", background=BackgroundTask(cleanup))

    async def handle(request: Request, body: _SamplingFields, chat: bool) -> Response:
        timer = _RequestTimer(metrics)
        if _has_lone_surrogate(body):  # JSON allows "\ud800"; no tokenizer can encode it
            return error_response(400, "the request holds invalid Unicode (a lone UTF-16 surrogate)")
        if body.model not in (None, model_name):
            return error_response(404, f"the model {body.model!r} does not exist; this server serves "
                                       f"{model_name!r}", "model", "model_not_found")
        if pending["n"] >= settings.max_pending_requests:
            return error_response(429, f"too many requests in flight ({settings.max_pending_requests}); "
                                       f"retry later")
        pending["n"] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                pending["n"] -= 1

        try:
            if chat:
                prompt, mm = await render_chat(body, uuid.uuid4().hex[:8])
            else:
                prompt, mm = body.prompt, {}
            unsupported(body)
            batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
            rid, choices = await prepare(body, list(prompt) if batch else [prompt], mm, chat)
            return await respond(request, body, rid, choices, chat, timer, release)
        except _BadRequest as e:
            release()
            return error_response(e.status, str(e), e.param)
        except (InvalidRequestError, MediaError) as e:
            release()
            return error_response(400, str(e), getattr(e, "param", None))
        except RequestError as e:
            release()
            return error_response(e.status if e.status in (400, 429, 503, 504) else 500, str(e))
        except BaseException:
            release()
            raise

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI completions (text or token-id prompt)."""
        return await handle(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        """OpenAI chat completions with text, image_url and input_audio content parts."""
        return await handle(request, body, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "epd", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        alive = router.pools_alive()
        needed = {w.role for w in router.registry.workers.values()}
        missing = sorted(r for r in needed if not alive.get(r))
        if missing or not needed:
            return error_response(503, f"no live instance in pool(s): {', '.join(missing) or 'all'}")
        return {"status": "ok", "pools": alive, "requests_in_flight": pending["n"]}

    @app.get("/metrics")
    async def metrics_endpoint():
        if metrics_render is None:
            return Response(b"", media_type="text/plain")
        data, ctype = metrics_render()
        return Response(data, media_type=ctype)

    @app.get("/epd/workers")
    async def workers():
        """Per-worker stats (free blocks, running, held buffers): for operators and leak checks."""
        return await router.worker_stats()

    from epd.api.realtime import mount_realtime  # here: realtime imports this module
    rt_kw = {} if settings.default_max_tokens is None else {"default_max_tokens": settings.default_max_tokens}
    mount_realtime(app, router, tokenizer, processor, model_name=model_name, max_model_len=max_model_len,
                   api_key=settings.api_key, metrics=metrics, **rt_kw)
    return app


def _has_lone_surrogate(obj) -> bool:
    """True when any string in ``obj`` (a pydantic model, list, dict or str) cannot be UTF-8 encoded."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, BaseModel):
        return any(_has_lone_surrogate(getattr(obj, f)) for f in type(obj).model_fields)
    if isinstance(obj, (list, tuple)):
        return any(_has_lone_surrogate(x) for x in obj)
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in obj.items())
    return False


def _byte_level_alphabet(tokenizer) -> dict[str, int] | None:
    """GPT-2 byte-level BPE's printable stand-in character -> byte, when the
    tokenizer decodes that way (its tokens are then strings of these characters).
    Source: the byte-to-unicode table of OpenAI's GPT-2 ``encoder.py``."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or "ByteLevel" not in repr(decoder):
        return None
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _template_takes_parts(tokenizer, image_tok: str | None, audio_tok: str | None) -> bool:
    """Whether the chat template renders HF-style content lists: a probe message
    ``[{"type": "image"}, {"type": "audio"}, {"type": "text"}]`` must render each
    media placeholder the model has exactly once and the text. Templates that only
    take string content (they raise, or print the list) get placeholder text instead."""
    if image_tok is None and audio_tok is None:
        return False
    probe_text = "epd-probe-7f3a"
    parts = ([{"type": "image"}] if image_tok else []) + ([{"type": "audio"}] if audio_tok else [])
    try:
        out = tokenizer.apply_chat_template([{"role": "user", "content": parts + [{"type": "text",
                                                                                    "text": probe_text}]}],
                                            add_generation_prompt=True, tokenize=False)
    except Exception:
        return False
    if not isinstance(out, str) or out.count(probe_text) != 1 or "'type'" in out:
        return False
    return all(out.count(t) == 1 for t in (image_tok, audio_tok) if t)


def _flatten(parts: list[dict], image_tok: str | None, audio_tok: str, structured: bool) -> str | list[dict]:
    """A message's content parts as the template wants them: the HF list, or one
    string with each media item's placeholder text where it stood."""
    if structured and any(p["type"] != "text" for p in parts):
        return parts
    out = []
    for p in parts:
        out.append(p["text"] if p["type"] == "text" else image_tok if p["type"] == "image" else audio_tok)
    return "".join(out)
