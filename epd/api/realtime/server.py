"""The ``/v1/realtime`` endpoint: the handshake (API key, ``Origin``, session limit) and
what every session shares (``RealtimeAPI``). The protocol is described in
``epd.api.realtime``; each session is ``epd.api.realtime.session``."""

from __future__ import annotations

import json

from fastapi import FastAPI, WebSocket

from epd.api.auth import api_key_ok
from epd.api.completions import ApiState
from epd.api.realtime.prompt import ConversationPrompt
from epd.api.realtime.protocol import new_id
from epd.api.realtime.session import DEFAULT_MAX_OUTPUT_TOKENS, RealtimeSession
from epd.api.server import ApiSettings
from epd.encoders.processor import MultiModalProcessor
from epd.router.router import Router

__all__ = ["RealtimeAPI", "mount_realtime", "origin_allowed"]


def origin_allowed(origin: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a WebSocket handshake with ``Origin`` header ``origin`` may proceed: no
    header (a non-browser client) always may; a browser page's origin must be in
    ``allowed`` (``scheme://host[:port]``, case-insensitive, a trailing "/" ignored; ``*``:
    any), so that no other web page can drive a local server from a browser."""
    if origin is None:
        return True
    wanted = {a.strip().rstrip("/").lower() for a in allowed}
    return "*" in wanted or origin.strip().rstrip("/").lower() in wanted


class RealtimeAPI:
    """What every realtime session shares: the router, tokenizer, processor, limits.

    Args:
        max_model_len: context length; conversations past it drop their oldest items.
        default_max_tokens: ``max_output_tokens`` of a new session.
        settings: ``api_key`` (the handshake needs ``Authorization: Bearer <key>``),
            ``max_realtime_sessions``, ``allowed_origins``, ``max_pending_requests``,
            ``realtime_idle_timeout_s`` (default: ``ApiSettings()``).
        state: the requests in flight, shared with the HTTP routes (default: a new one).
        metrics: ``epd.metrics.Metrics`` for TTFT / ITL / cancelled counts (or None).
        vocab_size: the model's logits width, for the grammar engine that checks tools
            and forces calls (default: the tokenizer's length); the tool-call format is
            ``settings.tool_call_parser`` (None: detected from the chat template).
    """

    def __init__(self, router: Router, tokenizer, processor: MultiModalProcessor, *, model_name: str,
                 max_model_len: int, default_max_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
                 settings: ApiSettings | None = None, state: ApiState | None = None, metrics=None,
                 vocab_size: int | None = None) -> None:
        settings = settings or ApiSettings()
        self.router, self.tokenizer, self.processor = router, tokenizer, processor
        self.model_name, self.max_model_len = model_name, max_model_len
        self.model_names = (model_name, *settings.model_aliases)
        self.default_max_tokens = min(default_max_tokens, max_model_len - 1)
        self.api_key, self.metrics = settings.api_key, metrics
        self.max_sessions, self.allowed_origins = settings.max_realtime_sessions, settings.allowed_origins
        self.max_pending_requests, self.state = settings.max_pending_requests, state or ApiState()
        self.idle_timeout_s = settings.realtime_idle_timeout_s
        self.prompt = ConversationPrompt(tokenizer, processor, max_model_len, tool_parser=settings.tool_call_parser,
                                         vocab_size=vocab_size)
        self.sessions: set[RealtimeSession] = set()

    @staticmethod
    async def _refuse(ws: WebSocket, close_code: int, code: str, message: str, param: str | None = None) -> None:
        """Tell an accepted socket why it is refused (an ``error`` event), then close it with ``close_code``."""
        await ws.send_text(json.dumps({"type": "error", "event_id": new_id("event"), "error": {
            "type": "invalid_request_error", "code": code, "param": param, "event_id": None, "message": message}}))
        await ws.close(code=close_code)

    async def serve(self, ws: WebSocket) -> None:
        """Run one session until the client closes the socket (or stops reading: code 1008).

        Refused: a missing or wrong API key (close code 1008, before accepting), an
        ``Origin`` header not in ``allowed_origins`` (HTTP 403), ``max_realtime_sessions``
        already open (an ``error`` event, then code 1013: try again later), an unknown
        ``model`` query parameter (an ``error`` event, then code 1008).
        """
        if not api_key_ok(ws.headers.get("authorization", ""), self.api_key):
            await ws.close(code=1008, reason="missing or incorrect API key")
            return
        if not origin_allowed(ws.headers.get("origin"), self.allowed_origins):
            await ws.close(code=1008, reason="origin not allowed")  # before accept: uvicorn answers 403
            return
        if len(self.sessions) >= self.max_sessions:
            await ws.accept()
            await self._refuse(ws, 1013, "session_limit_reached", f"this server has {self.max_sessions} realtime "
                                                                  f"sessions open, its limit; try again later")
            return
        session = RealtimeSession(ws, self)
        self.sessions.add(session)  # before any await: the limit holds however many handshakes race
        try:
            await ws.accept()
            model = ws.query_params.get("model")
            if model not in (None, "", *self.model_names):
                await self._refuse(ws, 1008, "model_not_found", f"the model {model!r} does not exist; this server "
                                                                f"serves {self.model_name!r}", "model")
                return
            await session.run()
        finally:
            self.sessions.discard(session)


def mount_realtime(app: FastAPI, router: Router, tokenizer, processor: MultiModalProcessor, *, model_name: str,
                   max_model_len: int, default_max_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
                   settings: ApiSettings | None = None, state: ApiState | None = None,
                   metrics=None, vocab_size: int | None = None) -> RealtimeAPI:
    """Add the ``/v1/realtime`` WebSocket to ``app`` (arguments: see ``RealtimeAPI``)."""
    api = RealtimeAPI(router, tokenizer, processor, model_name=model_name, max_model_len=max_model_len,
                      default_max_tokens=default_max_tokens, settings=settings, state=state, metrics=metrics,
                      vocab_size=vocab_size)
    app.add_api_websocket_route("/v1/realtime", api.serve)
    return api
