"""The API process's app: the OpenAI HTTP routes (``epd.api.server``) with the
``/v1/realtime`` WebSocket (``epd.api.realtime``) mounted on them."""

from __future__ import annotations

from fastapi import FastAPI

from epd.api.completions import ApiState
from epd.api.realtime import mount_realtime
from epd.api.server import ApiSettings, build_http_app
from epd.encoders.processor import MultiModalProcessor
from epd.router.router import Router


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
    state = ApiState()  # one count of requests in flight: HTTP requests and realtime responses
    app = build_http_app(router, tokenizer, processor, model_name=model_name, max_model_len=max_model_len,
                         settings=settings, metrics_render=metrics_render, metrics=metrics, vocab_size=vocab_size,
                         state=state)
    rt_kw = {} if settings.default_max_tokens is None else {"default_max_tokens": settings.default_max_tokens}
    mount_realtime(app, router, tokenizer, processor, model_name=model_name, max_model_len=max_model_len,
                   settings=settings, state=state, metrics=metrics, vocab_size=vocab_size, **rt_kw)
    return app
