"""Function calling on ``/v1/realtime`` with a real checkpoint (SmolLM2-135M-Instruct, the
embedded default), driven by the official openai SDK's realtime client.

Parity: the realtime session renders its conversation and tools with the chat API's
machinery (``epd.api.tools``), so a forced call's arguments, and the answer to its
result, equal what ``/v1/chat/completions`` gives for the same messages and tools
(greedy, same server).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.serving.conftest import launch
from tests.serving.test_realtime import connect, until

pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "description": "the city name"}},
          "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                              "parameters": PARAMS}}
RT_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": PARAMS}
QUESTION = "What is the weather like in Paris today?"
RESULT = json.dumps({"temperature_c": 21, "sky": "sunny"})


@pytest.fixture(scope="module")
def server(default_model_dir):
    with launch(default_model_dir, "pd:1", "--kv-cache-memory-gb", "0.2") as s:
        yield s


def of(log: list, kind: str) -> list:
    return [e for e in log if e.type == kind]


def test_a_forced_call_streams_like_openai_and_its_result_is_answered_as_the_chat_api_does(server):
    client = server.client()
    first = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": QUESTION}],
                                           tools=[CHAT_TOOL], tool_choice="required", temperature=0, max_tokens=100)
    chat_calls = first.choices[0].message.tool_calls
    messages = [{"role": "user", "content": QUESTION}, first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in chat_calls]
    second = client.chat.completions.create(model=server.model, messages=messages, tools=[CHAT_TOOL],
                                            temperature=0, max_tokens=40).choices[0].message

    async def go():
        log: list = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            await conn.session.update(session={"type": "realtime", "tools": [RT_TOOL], "tool_choice": "required"})
            updated = await until(conn, lambda e: e.type in ("session.updated", "error"), log)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": QUESTION}]})
            await conn.response.create(response={"max_output_tokens": 100})
            called = await until(conn, lambda e: e.type == "response.done", log)
            for item in called.response.output:
                await conn.conversation.item.create(item={"type": "function_call_output", "call_id": item.call_id,
                                                          "output": RESULT})
            await conn.response.create(response={"max_output_tokens": 40, "tool_choice": "auto"})
            answered = await until(conn, lambda e: e.type == "response.done", log)
            return log, updated, called, answered

    log, updated, called, answered = asyncio.run(go())
    assert updated.type == "session.updated", updated
    assert updated.session.tools[0].name == "get_weather" and updated.session.tool_choice == "required"
    out = called.response.output
    assert called.response.status == "completed", called.response.status_details
    assert [it.type for it in out] == ["function_call"] * len(chat_calls)  # a forced call: no message
    assert [(it.name, it.arguments) for it in out] == [(c.function.name, c.function.arguments) for c in chat_calls]
    for it in out:
        jsonschema.validate(json.loads(it.arguments), {**PARAMS, "additionalProperties": False})
    assert "paris" in json.loads(out[0].arguments)["city"].lower()
    rid = called.response.id
    events = [e for e in log if getattr(e, "response_id", None) == rid or e.type.startswith("conversation.item")]
    for idx, it in enumerate(out):
        mine = [e for e in events if getattr(e, "item_id", None) == it.id
                or getattr(getattr(e, "item", None), "id", None) == it.id]
        kinds = [e.type for e in mine]
        assert kinds.index("conversation.item.added") < kinds.index("response.function_call_arguments.done"), kinds
        assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
        assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
        deltas = [e for e in mine if e.type == "response.function_call_arguments.delta"]
        assert "".join(e.delta for e in deltas) == it.arguments
        assert {e.call_id for e in deltas} == {it.call_id} and {e.output_index for e in deltas} == {idx}
        (done,) = [e for e in mine if e.type == "response.function_call_arguments.done"]
        assert (done.name, done.arguments, done.call_id) == (it.name, it.arguments, it.call_id)
    assert not [e for e in events if e.type == "response.output_text.delta"]
    # the answer to the results: as the chat API answers the same conversation
    assert answered.response.status in ("completed", "incomplete"), answered.response.status_details
    texts = [c.text for it in answered.response.output if it.type == "message" for c in it.content]
    calls = [(it.name, it.arguments) for it in answered.response.output if it.type == "function_call"]
    assert calls == [(c.function.name, c.function.arguments) for c in second.tool_calls or []]
    assert "".join(texts) == (second.content or "")


def test_bad_tools_are_error_events_and_the_session_goes_on(server):
    async def go():
        errors = []
        async with connect(server) as conn:
            await until(conn, lambda e: e.type == "session.created")
            for session in ({"tools": [{"type": "mcp", "server_label": "x"}]},
                            {"tools": [{**RT_TOOL, "parameters": {"type": "array"}}]},
                            {"tools": [{**RT_TOOL, "name": "bad name!"}]},
                            {"tools": [RT_TOOL, RT_TOOL]},
                            {"tools": [RT_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
                            {"tool_choice": "required"}):
                await conn.session.update(session={"type": "realtime", **session})
                errors.append(await until(conn, lambda e: e.type in ("error", "session.updated")))
            await conn.session.update(session={"type": "realtime", "tools": [RT_TOOL]})
            ok = await until(conn, lambda e: e.type in ("error", "session.updated"))
            return errors, ok

    errors, ok = asyncio.run(go())
    assert [e.type for e in errors] == ["error"] * 6, errors
    assert [e.error.param for e in errors] == ["session.tools.0", "session.tools.0.parameters", "session.tools.0.name",
                                               "session.tools", "session.tool_choice", "session.tool_choice"]
    assert errors[0].error.code == "unsupported_tool_type"
    assert ok.type == "session.updated" and [t.name for t in ok.session.tools] == ["get_weather"]
    assert ok.session.tool_choice == "auto"
