"""OpenAI-compatible HTTP API over the router: routes and middleware.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as SSE or
not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` and ``GET /epd/workers``.
Tokenization, chat templates, media decoding (and fetching, for allowlisted
hosts) and detokenization with stop strings happen in the API process; workers see
token ids and preprocessed tensors. Request and response shapes follow OpenAI's API
reference (chat completions, completions, error bodies, stream chunks) as the
official ``openai`` SDK parses them; vLLM's OpenAI server is the model for the
extras (``top_k``, ``ignore_eos``) and for logprobs from the raw distribution.

The pieces: ``protocol`` (bodies, errors), ``chat_prompt`` (messages -> prompt and
media), ``completions`` (bodies -> router requests), ``streaming`` (answers, SSE),
``logprobs``; ``epd.api.app.build_app`` adds ``/v1/realtime`` to this app.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from epd.api.auth import api_key_ok
from epd.api.body_budget import BodyBudget, BodyBudgetFull, budget_full
from epd.api.chat_prompt import ChatPromptRenderer
from epd.api.completions import ApiState, CompletionService
from epd.api.logprobs import LogprobFormatter
from epd.api.media_fetch import MediaFetcher
from epd.api.protocol import (
    ChatRequest,
    CompletionRequest,
    error_body,
    error_response,
    invalid_field,
    too_many_requests,
)
from epd.api.streaming import CompletionResponder
from epd.encoders.processor import MultiModalProcessor
from epd.launch.config import LaunchConfig
from epd.router.router import Router

__all__ = ["ApiSettings", "GuardMiddleware", "build_http_app", "error_body", "error_response"]

logger = logging.getLogger(__name__)


_LAUNCH = LaunchConfig()  # the launch flags' defaults are the defaults here too


@dataclass(slots=True)
class ApiSettings:
    """Limits and switches of the HTTP and realtime front end (``epd launch`` flags).

    api_key: when set, every ``/v1`` and ``/epd`` request, and the ``/v1/realtime``
        handshake, needs ``Authorization: Bearer <key>`` (else 401 / close code 1008).
    max_body_bytes: larger request bodies get 413.
    max_inflight_body_bytes: request bodies being read at once, all requests together
        (``epd.api.body_budget``); a body that does not fit gets 503 with ``Retry-After``.
    max_pending_requests: requests in flight at once (streams and realtime responses
        included); more get 429 (a realtime response: an ``error`` event).
    max_n: largest ``n`` (choices per request).
    allowed_media_domains: hosts whose http(s) media URLs are fetched (empty: none).
    media_fetch_timeout_s / max_media_bytes: limits of one fetch (seconds, bytes).
    max_realtime_sessions: ``/v1/realtime`` sessions open at once; more are closed with code 1013.
    realtime_idle_timeout_s: a ``/v1/realtime`` session that sends no event for this many
        seconds while none of its work runs gets an ``error`` event (``session_idle_timeout``)
        and is closed with code 1000; None: never.
    allowed_origins: browser origins (``scheme://host[:port]``, or ``*``) that may open
        ``/v1/realtime``; a handshake with any other ``Origin`` header gets 403.
    default_max_tokens: ``max_tokens`` when the request gives none (capped by the context
        left); None: the whole context left, as OpenAI and vLLM do.
    tool_call_parser: the format the model writes tool calls in (``hermes``,
        ``llama3_json``, ``mistral``; ``epd.api.tool_parsers``); None: detected from the chat template.
    model_aliases: names besides the model's own that requests (and ``/v1/realtime``'s
        ``model``) may give; ``/v1/models`` lists them all.
    """

    api_key: str | None = None
    max_body_bytes: int = int(_LAUNCH.max_body_mb * 2**20)
    max_inflight_body_bytes: int = int(_LAUNCH.max_inflight_body_mb * 2**20)
    max_pending_requests: int = _LAUNCH.max_pending_requests
    max_n: int = _LAUNCH.max_n
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = _LAUNCH.media_fetch_timeout
    max_media_bytes: int = int(_LAUNCH.max_media_mb * 2**20)
    max_realtime_sessions: int = _LAUNCH.max_realtime_sessions
    realtime_idle_timeout_s: float | None = _LAUNCH.realtime_idle_timeout or None
    allowed_origins: tuple[str, ...] = ()
    default_max_tokens: int | None = None
    tool_call_parser: str | None = None
    model_aliases: tuple[str, ...] = ()  # more names the model answers to (``--served-model-name``)


class _BodyTooLarge(Exception):
    pass


def _too_large(settings: ApiSettings) -> JSONResponse:
    return error_response(413, f"the request body is over the {settings.max_body_bytes}-byte limit")


#: the paths behind the API key: the OpenAI routes and the operator's ``/epd/workers`` (it asks every worker)
_KEYED_PATHS = ("/v1/", "/epd/")


#: the routes that start a request (counted against ``max_pending_requests``)
_GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")


class GuardMiddleware:
    """ASGI middleware: API key check on ``/v1`` and ``/epd`` (401), the pending-request
    limit decided before the body is read (429 with ``Retry-After``; ``state``: the
    requests in flight), the body size limit (413, counted on the bytes actually
    received, so chunked bodies are limited too), and the bytes of bodies being read at
    once (``BodyBudget``: 503 with ``Retry-After``, before reading past it)."""

    def __init__(self, app, settings: ApiSettings, state: ApiState | None = None) -> None:
        self.app, self.settings, self.state = app, settings, state
        self.budget = BodyBudget(settings.max_inflight_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.settings
        headers = dict(scope.get("headers") or [])
        if s.api_key and scope["path"].startswith(_KEYED_PATHS):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not api_key_ok(auth, s.api_key):
                resp = error_response(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'")
                return await resp(scope, receive, send)
        if (self.state is not None and scope["path"] in _GENERATE_PATHS
                and self.state.pending >= s.max_pending_requests):  # refuse before reading up to 64 MB
            return await too_many_requests(s.max_pending_requests)(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > s.max_body_bytes):
            return await _too_large(s)(scope, receive, send)
        budget = self.budget
        taken = int(length) if length is not None else 0  # bytes of the budget this request holds
        if not budget.take(taken):
            return await budget_full(budget.limit)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received, taken
            msg = await receive()
            if msg["type"] == "http.request":
                chunk = len(msg.get("body", b""))
                received += chunk
                if received > s.max_body_bytes:
                    scope["epd.body_too_large"] = True
                    raise _BodyTooLarge
                if length is None:  # streamed: take each chunk as it comes
                    if not budget.take(chunk):
                        scope["epd.body_budget_full"] = True
                        raise BodyBudgetFull
                    taken += chunk
                if not msg.get("more_body", False):  # read: from here on it counts as a pending request
                    budget.give(taken)
                    taken = 0
            return msg

        try:
            await self.app(scope, limited_receive, send)
        finally:
            budget.give(taken)


def _add_error_handlers(app: FastAPI, settings: ApiSettings) -> None:
    """Every error in OpenAI's body."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        if request.scope.get("epd.body_too_large"):
            return _too_large(settings)
        if request.scope.get("epd.body_budget_full"):
            return budget_full(settings.max_inflight_body_bytes)
        if not errs:
            return error_response(400, "invalid request")
        if any(e.get("type") == "json_invalid" for e in errs):
            return error_response(400, "the request body is not valid JSON")
        msg, loc = invalid_field(errs)
        return error_response(400, f"invalid request: {msg} at {'.'.join(loc) or 'body'}", '.'.join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if request.scope.get("epd.body_too_large"):
            return _too_large(settings)
        if request.scope.get("epd.body_budget_full"):
            return budget_full(settings.max_inflight_body_bytes)
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(_BodyTooLarge)
    async def on_too_large(request: Request, exc: _BodyTooLarge):
        return _too_large(settings)

    @app.exception_handler(BodyBudgetFull)
    async def on_budget_full(request: Request, exc: BodyBudgetFull):
        return budget_full(settings.max_inflight_body_bytes)

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception):
        logger.exception("internal error answering %s", request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__}); the request was not completed")


def _add_routes(app: FastAPI, service: CompletionService, router: Router, state: ApiState, *, model_name: str,
                max_model_len: int, metrics_render) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI completions (text or token-id prompt)."""
        return await service.handle(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        """OpenAI chat completions with text, image_url, input_audio and video_url content parts."""
        return await service.handle(request, body, chat=True)

    @app.get("/v1/models")
    async def models():
        """The model's names; ``max_model_len``: the smallest any live worker serves, at most the API's."""
        live = service.live_max_model_len()
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "epd", "max_model_len": live}
                                           for name in (model_name, *service.settings.model_aliases)]}

    @app.get("/health")
    async def health():
        """200 when every pool has its minimum of live instances (``Router.min_pools``;
        unset: one of each pool that ever registered), else 503 naming what is missing."""
        alive = router.pools_alive()
        need = dict(router.min_pools) or {w.role: 1 for w in router.registry.workers.values()}
        missing = sorted(f"{r} ({alive.get(r, 0)}/{n})" for r, n in need.items() if alive.get(r, 0) < n)
        if missing or not need:
            return error_response(503, f"too few live instances in pool(s): {', '.join(missing) or 'all'}")
        return {"status": "ok", "pools": alive, "draining": router.registry.counts("draining"),
                "requests_in_flight": state.pending}

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


def build_http_app(router: Router, tokenizer, processor: MultiModalProcessor, *, model_name: str,
                   max_model_len: int, settings: ApiSettings, metrics_render=None, metrics=None,
                   vocab_size: int | None = None, state: ApiState | None = None) -> FastAPI:
    """The FastAPI app of the HTTP routes (no ``/v1/realtime``: see ``epd.api.app.build_app``).

    ``metrics_render() -> (bytes, content_type)`` serves /metrics; ``metrics``
    (``epd.metrics.Metrics``) records per-request latencies; ``settings`` holds the
    limits; ``vocab_size`` bounds token-id prompts (default: the tokenizer's length);
    ``state``: the requests in flight, shared with ``/v1/realtime`` (default: a new one).
    """
    vocab_size = vocab_size or len(tokenizer)
    app = FastAPI(title="epd", version="0.1.0")
    state = state or ApiState()
    app.add_middleware(GuardMiddleware, settings=settings, state=state)
    fetcher = MediaFetcher(settings.allowed_media_domains, max_bytes=settings.max_media_bytes,
                           timeout_s=settings.media_fetch_timeout_s)
    service = CompletionService(tokenizer, processor, ChatPromptRenderer(router, tokenizer, processor, fetcher,
                                                                         tool_parser=settings.tool_call_parser),
                                CompletionResponder(router, model_name, LogprobFormatter(tokenizer)), state,
                                settings=settings, model_name=model_name, max_model_len=max_model_len,
                                vocab_size=vocab_size, metrics=metrics,
                                live_max_model_len=lambda: router.max_model_len(max_model_len))
    _add_error_handlers(app, settings)
    _add_routes(app, service, router, state, model_name=model_name, max_model_len=max_model_len,
                metrics_render=metrics_render)
    return app
