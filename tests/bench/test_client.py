"""The benchmark client's error for a server that refuses ``ignore_eos`` names the flag
that avoids it (``transformers serve`` answers 422 to the vLLM extension)."""

from __future__ import annotations

import asyncio
import json

import httpx
from openai import AsyncOpenAI

from epd.bench.client import send_chat
from epd.bench.metrics import RequestRecord
from epd.bench.workloads import RequestSpec


def _client(seen: list[dict]) -> AsyncOpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if "ignore_eos" in body:
            return httpx.Response(422, json={"detail": [{"loc": ["body", "ignore_eos"], "msg": "extra field"}]})
        sse = ('data: {"id":"1","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
               '"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    return AsyncOpenAI(base_url="http://peer/v1", api_key="x", max_retries=0,
                       http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def test_a_refused_ignore_eos_names_no_ignore_eos():
    spec = RequestSpec("chat", [{"role": "user", "content": "hi"}], 8)
    seen: list[dict] = []
    rec = asyncio.run(send_chat(_client(seen), "m", spec, RequestRecord(0, "chat", 0.0)))
    assert not rec.ok and "422" in rec.error and "--no-ignore-eos" in rec.error
    rec = asyncio.run(send_chat(_client(seen), "m", spec, RequestRecord(1, "chat", 0.0), ignore_eos=False))
    assert rec.ok and rec.error is None and rec.finish_reason == "stop"
    assert "ignore_eos" in seen[0] and "ignore_eos" not in seen[1]


def test_another_refusal_does_not_blame_ignore_eos():
    """A 400 for a too-long prompt is not about ignore_eos: no hint to drop it."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "the prompt has 2689 tokens but max_model_len is 2048",
                                                   "type": "invalid_request_error"}})

    client = AsyncOpenAI(base_url="http://peer/v1", api_key="x", max_retries=0,
                         http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    spec = RequestSpec("chat", [{"role": "user", "content": "hi"}], 8)
    rec = asyncio.run(send_chat(client, "m", spec, RequestRecord(0, "chat", 0.0)))
    assert not rec.ok and "max_model_len is 2048" in rec.error and "--no-ignore-eos" not in rec.error
