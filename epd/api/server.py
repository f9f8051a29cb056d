"""OpenAI-compatible HTTP API over the router (first cut: completions, chat, health, metrics).

Tokenization, chat templates, media decoding and detokenization (with stop
strings) happen here; workers see token ids and preprocessed tensors.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from pydantic import BaseModel, Field, ValidationError

from epd.detokenizer import IncrementalDetokenizer
from epd.encoders.media import MediaError
from epd.encoders.processor import AUDIO_PLACEHOLDER, MultiModalProcessor
from epd.errors import InvalidRequestError
from epd.messages import WireSamplingParams
from epd.router.router import RequestError, Router, RouterRequest
from epd.sampling_params import SamplingParams


class ContentPart(BaseModel):
    type: str
    text: str | None = None
    image_url: dict | None = None
    input_audio: dict | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None


class _SamplingFields(BaseModel):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


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


def build_app(router: Router, tokenizer, processor: MultiModalProcessor, *, model_name: str,
              max_model_len: int, default_max_tokens: int = 256, metrics_render=None, metrics=None) -> FastAPI:
    """The FastAPI app. ``metrics_render() -> (bytes, content_type)`` serves /metrics;
    ``metrics`` (``epd.metrics.Metrics``) records per-request latencies."""
    app = FastAPI(title="epd", version="0.1.0")
    ids = itertools.count()
    created = int(time.time())

    def sampling(body: _SamplingFields, prompt_len: int) -> tuple[WireSamplingParams, list[str]]:
        max_tokens = body.max_completion_tokens or body.max_tokens or min(default_max_tokens,
                                                                          max_model_len - prompt_len)
        if prompt_len >= max_model_len:
            raise _BadRequest(f"the prompt has {prompt_len} tokens but max_model_len is {max_model_len}", "messages")
        if prompt_len + max_tokens > max_model_len:
            raise _BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                              f"({max_model_len})", "max_tokens")
        try:
            sp = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                max_tokens=max_tokens, stop=body.stop, ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise _BadRequest(str(e)) from None
        return WireSamplingParams.from_params(sp), list(sp.stop)

    def decode_b64(data: str, param: str) -> bytes:
        if data.startswith("data:"):
            _, _, data = data.partition(",")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise _BadRequest("invalid base64 media data", param) from None

    async def render_chat(body: ChatRequest, rid: str) -> tuple[str, dict]:
        image_tok = None
        if "image" in processor.placeholder_ids:
            image_tok = tokenizer.convert_ids_to_tokens(processor.placeholder_ids["image"])
        audio_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["audio"])
                     if "audio" in processor.placeholder_ids else AUDIO_PLACEHOLDER)
        images, audios, msgs = [], [], []
        for m in body.messages:
            if isinstance(m.content, list):
                parts = []
                for p in m.content:
                    if p.type == "text":
                        parts.append(p.text or "")
                    elif p.type == "image_url":
                        url = (p.image_url or {}).get("url", "")
                        if not url.startswith("data:"):
                            raise _BadRequest("only data: URLs are accepted for images", "messages")
                        if image_tok is None:
                            raise _BadRequest("this model does not accept images", "messages")
                        images.append(decode_b64(url, "messages"))
                        parts.append(image_tok)
                    elif p.type == "input_audio":
                        audio = p.input_audio or {}
                        audios.append(decode_b64(audio.get("data", ""), "messages"))
                        parts.append(audio_tok)
                    else:
                        raise _BadRequest(f"unsupported content part type {p.type!r}", "messages")
                content = "".join(parts)
            else:
                content = m.content or ""
            msgs.append({"role": m.role, "content": content})
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images
        if audios and processor.modalities.get("audio") == "transcribe":
            items = [processor.audio_item(a) for a in audios]
            texts = await router.transcribe(rid + "-asr", items)
            for msg in msgs:
                while AUDIO_PLACEHOLDER in msg["content"] and texts:
                    msg["content"] = msg["content"].replace(AUDIO_PLACEHOLDER, texts.pop(0), 1)
        elif audios:
            mm["audio"] = audios
        prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return prompt, mm

    async def run(body: _SamplingFields, prompt: str | list[int], mm: dict, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:20]}-{next(ids)}"
        ids_ = prompt if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=not chat)
        if not ids_:
            raise _BadRequest("the prompt is empty", "prompt")
        processed = processor.process(ids_, mm)
        params, stop = sampling(body, len(processed.prompt_token_ids))
        req = RouterRequest(rid, processed.prompt_token_ids, params, processed.items, processed.placeholders)
        detok = IncrementalDetokenizer(tokenizer, processed.prompt_token_ids, stop=stop)
        return rid, req, detok

    async def respond(body: _SamplingFields, rid: str, req: RouterRequest, detok, chat: bool, timer: _RequestTimer):
        obj = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": 0,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.stream:
            reason = None
            gen = router.generate(req)
            try:
                async for ev in gen:
                    timer.on_tokens(len(ev.token_ids))
                    usage["completion_tokens"] += len(ev.token_ids)
                    usage["prompt_tokens_details"]["cached_tokens"] = min(ev.num_cached_tokens, usage["prompt_tokens"])
                    if detok.update(ev.token_ids) is not None:
                        reason = "stop"
                        timer.finished = True
                        break
                    if ev.finished:
                        reason = ev.finish_reason
                        timer.finished = True
            finally:
                await gen.aclose()
                timer.close()
            text = detok.get_next_output_text(True, delta=False)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                      if chat else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [choice], "usage": usage})

        async def sse():
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(delta_text: str | None, reason: str | None, role: bool = False) -> str:
                if chat:
                    delta = {"role": "assistant", "content": ""} if role else (
                        {"content": delta_text} if delta_text else {})
                    choice = {"index": 0, "delta": delta, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": delta_text or "", "finish_reason": reason, "logprobs": None}
                return "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": int(time.time()),
                                              "model": model_name, "choices": [choice]}) + "\n\n"

            if chat:
                yield chunk(None, None, role=True)
            gen = router.generate(req)
            reason = None
            try:
                async for ev in gen:
                    timer.on_tokens(len(ev.token_ids))
                    usage["completion_tokens"] += len(ev.token_ids)
                    hit = detok.update(ev.token_ids) is not None
                    done = hit or ev.finished
                    timer.finished = done
                    delta = detok.get_next_output_text(done, delta=True)
                    if delta:
                        yield chunk(delta, None)
                    if done:
                        reason = "stop" if hit else ev.finish_reason
                        break
            except RequestError as e:
                timer.finished = True  # failed, not cancelled by the client
                yield "data: " + json.dumps({"error": {"message": str(e), "type": "server_error",
                                                       "param": None, "code": None}}) + "\n\n"
                return
            finally:
                await gen.aclose()
                timer.close()
            yield chunk(None, reason)
            yield "data: [DONE]\n\n"

        # The background task runs even when the client left before the stream
        # started (then sse() never runs): such a request still counts as cancelled.
        return StreamingResponse(sse(), media_type="text/event-stream", background=BackgroundTask(timer.close))

    async def handle(request: Request, model_cls, chat: bool):
        timer = _RequestTimer(metrics)
        try:
            body = model_cls.model_validate(await request.json())
        except ValidationError as e:
            return error_response(400, f"invalid request: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the request body is not valid JSON")
        if body.model not in (None, model_name):
            return error_response(404, f"model {body.model!r} not found; this server serves {model_name!r}", "model",
                                  "model_not_found")
        try:
            rid_hint = uuid.uuid4().hex[:8]
            if chat:
                prompt, mm = await render_chat(body, rid_hint)
            else:
                prompt, mm = body.prompt, {}
            rid, req, detok = await run(body, prompt, mm, chat)
            return await respond(body, rid, req, detok, chat, timer)
        except _BadRequest as e:
            return error_response(e.status, str(e), e.param)
        except (InvalidRequestError, MediaError) as e:
            return error_response(400, str(e), getattr(e, "param", None))
        except RequestError as e:
            return error_response(e.status if e.status in (400, 503, 504) else 500, str(e))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, ChatRequest, chat=True)

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
        return {"status": "ok", "pools": alive}

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

    return app
