"""``--served-model-name``: the names the API answers to (vLLM's flag). Clients such as
pipecat and livekit send their own default model name (``gpt-realtime``, ``gpt-4o``);
mapping it to the served model makes their defaults work. The real app, a stub router."""

from __future__ import annotations

import asyncio

import httpx

from tests.api.test_realtime_limits import recv, serving, ws_connect


def test_aliases_are_served_and_listed_and_other_names_are_404():
    async def main():
        async with serving(model_aliases=("gpt-realtime", "gpt-4o")) as s:
            s.router.gate.set()  # the stub router answers at once
            async with httpx.AsyncClient(base_url=s.http, timeout=30) as http:
                models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                alias = await http.post("/v1/chat/completions", json={**body, "model": "gpt-4o"})
                other = await http.post("/v1/chat/completions", json={**body, "model": "gpt-5"})
            async with ws_connect(s.ws + "?model=gpt-realtime") as ws:
                created = await recv(ws)
            async with ws_connect(s.ws + "?model=gpt-5") as ws:
                refused = await recv(ws)
            return models, alias, other, created, refused

    models, alias, other, created, refused = asyncio.run(main())
    assert models == ["m", "gpt-realtime", "gpt-4o"]
    assert alias.status_code == 200 and alias.json()["model"] == "m", alias.text  # reported as the first name
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found", other.text
    assert created["type"] == "session.created"
    assert refused["type"] == "error" and refused["error"]["code"] == "model_not_found"


def test_the_flag_reaches_the_api_settings():
    from epd.cli import build_parser
    from epd.launch.api_process import api_settings
    from epd.launch.config import LaunchConfig

    args = build_parser().parse_args(["launch", "--served-model-name", "smol", "gpt-4o", "gpt-realtime"])
    config = LaunchConfig.from_args(args)
    assert config.served_model_name == ["smol", "gpt-4o", "gpt-realtime"]
    assert api_settings(config).model_aliases == ("gpt-4o", "gpt-realtime")
