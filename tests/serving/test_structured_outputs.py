"""Structured outputs and forced tool calls through the real server, on a random tiny model.

Nothing but the constraint can make a random model's output right, so every answer here
parsing and validating is the grammar at work, in every topology: ``p:1,d:1`` (the prefill
worker samples the first token under the grammar, the decode worker's matcher is advanced
past it), ``pd:1``, and across a decode worker killed mid-stream (the matcher is rebuilt
from the tokens already streamed). The clients are the official ``openai`` SDK.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from epd.models.tiny import create_tiny_model
from tests.serving.conftest import launch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                      "city": {"type": "string", "maxLength": 8}},
                    "required": ["zip", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
# A long answer the schema still bounds: 200 digits, to kill a decode worker mid-stream.
LONG_SCHEMA = {"type": "object", "properties": {"digits": {"type": "array", "minItems": 200, "maxItems": 200,
                                                           "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
               "required": ["digits"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit", "days"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "parameters": {
        "type": "object", "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 12},
                                         "when": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
        "required": ["guests", "when"], "additionalProperties": False}}}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SAMPLING = [dict(temperature=0)] + [dict(temperature=1.0, seed=s) for s in (1, 2, 3)]
MESSAGES = [{"role": "user", "content": "tell me about someone"}]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("so") / "llama"))


@pytest.fixture(scope="module", params=["p:1,d:1", "pd:1"])
def server(request, llama_dir):
    with launch(llama_dir, request.param, "--kv-cache-memory-gb", "0.05") as s:
        yield s


def _chat(server, **kw):
    client = server.client()
    return client.chat.completions.create(model=server.model, messages=kw.pop("messages", MESSAGES),
                                          max_tokens=kw.pop("max_tokens", 300), **kw)


@pytest.mark.parametrize("kw", SAMPLING, ids=lambda kw: f"seed{kw.get('seed', 'greedy')}")
def test_json_schema_answers_validate(server, kw):
    out = _chat(server, response_format={"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_answer_equals_the_whole_one(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    whole = _chat(server, response_format=fmt, temperature=0).choices[0].message.content
    parts, reasons = [], []
    for chunk in _chat(server, response_format=fmt, temperature=0, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == whole and reasons[-1] == "stop"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: str = Field(pattern=r"^(cat|dog|fish)$")
    legs: int = Field(ge=0, le=4)


def test_the_sdks_parse_returns_the_pydantic_model(server):
    client = server.client()
    out = client.chat.completions.parse(model=server.model, messages=MESSAGES, response_format=Pet, max_tokens=200,
                                        temperature=0)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "fish") and 0 <= pet.legs <= 4


def test_structured_outputs_extension(server):
    """vLLM's ``structured_outputs`` through ``extra_body``, and ``json_object``; on
    /v1/completions too."""
    for kw in SAMPLING[:2]:
        out = _chat(server, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}}, **kw)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", out.choices[0].message.content)
        out = _chat(server, extra_body={"structured_outputs": {"choice": ["yes", "no", "perhaps not"]}}, **kw)
        assert out.choices[0].message.content in ("yes", "no", "perhaps not")
        out = _chat(server, extra_body={"structured_outputs": {"grammar": 'root ::= "(" [1-9] ("+" [1-9])? ")"'}},
                    **kw)
        assert re.fullmatch(r"\([1-9](\+[1-9])?\)", out.choices[0].message.content)
        out = _chat(server, response_format={"type": "json_object"}, max_tokens=150, **kw)
        assert out.choices[0].message.content.startswith("{")
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].message.content), dict)
    client = server.client()
    out = client.completions.create(model=server.model, prompt="the answer:", max_tokens=300, temperature=0,
                                    extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def _call_args(calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("kw", SAMPLING, ids=lambda kw: f"seed{kw.get('seed', 'greedy')}")
def test_forced_tool_calls_are_valid(server, kw):
    named = _chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "book_table"}}, **kw)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for name, args in _call_args(choice.message.tool_calls):
        assert name == "book_table"
        jsonschema.validate(args, SCHEMAS[name])
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    required = _chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    (name, args), = _call_args(required.message.tool_calls)
    jsonschema.validate(args, SCHEMAS[name])


def test_streamed_tool_call_fragments_concatenate_to_the_arguments(server):
    """Greedy twice, streamed and not: the stream names each call once (index, id, type,
    name) and its argument fragments concatenate to exactly the whole arguments."""
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0)
    whole = _chat(server, **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons, contents = [], []
    for chunk in _chat(server, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        contents.append(delta.content or "")
        for tc in delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert "<tool_call>" not in "".join(contents)
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert len(calls) >= 1


def test_a_tool_round_trip_renders_the_call_and_the_result(server):
    """A follow-up turn with the assistant's call and a ``role: "tool"`` result is accepted;
    the answer is plain content."""
    first = _chat(server, tools=TOOLS, tool_choice="required", temperature=0).choices[0].message
    messages = MESSAGES + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True})} for c in first.tool_calls]
    out = _chat(server, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_body_nested_past_the_parsers_recursion_is_a_400(server):
    deep = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": '
            + "[" * 100_000 + "]" * 100_000 + "}")
    with httpx.Client(timeout=60) as http:  # one keep-alive connection: it must survive
        r = http.post(server.url + "/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        r = http.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "propertyNames": {"maxLength": 3}}}}), "response_format.json_schema.schema"),
    (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs.regex"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: nowhere"}}), "structured_outputs.grammar"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]),
     "tools.0.function.parameters"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    # nested past MAX_NESTING_DEPTH (a recursive walk died with a RecursionError: a 500)
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(300)}}),
     "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": _nested(300)}}]), "tools"),
    (dict(extra_body={"structured_outputs": {"choice": ["a"], "json": _nested(400)}}), "structured_outputs"),
    # compile, but exceed the grammar engine's limits once followed (were 500s after routing)
    (dict(extra_body={"structured_outputs": {"grammar": 'start: "a" start'}}), "structured_outputs.grammar"),
    (dict(extra_body={"structured_outputs": {"regex": "((a{100}){100}){100}"}}), "structured_outputs.regex"),
])
def test_bad_constraints_are_400s_naming_the_param(server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert "\n" not in e.value.body["message"] and len(e.value.body["message"]) < 600, e.value.body  # no state dump
    # the server keeps serving
    assert _chat(server, max_tokens=3).choices[0].finish_reason == "length"


def test_constrained_streams_survive_a_decode_worker_kill(llama_dir):
    """p:1,d:2: SIGKILL the decode worker streaming constrained requests (greedy and
    seeded): each migrated request ends exactly as the undisturbed run, valid and "stop"."""
    fmt = {"type": "json_schema", "json_schema": {"name": "digits", "schema": LONG_SCHEMA}}
    jobs = [dict(temperature=0), dict(temperature=1.0, seed=5), dict(temperature=1.0, seed=6),
            dict(temperature=0.7, seed=9)]

    def stream(server, kw, on_chunk=None):
        parts, reason = [], None
        for chunk in _chat(server, response_format=fmt, stream=True, max_tokens=600, **kw):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
                if on_chunk:
                    on_chunk(len(parts))
        return "".join(parts), reason

    with launch(llama_dir, "p:1,d:2", "--kv-cache-memory-gb", "0.05", "--max-num-seqs", "16") as server:
        with ThreadPoolExecutor(len(jobs)) as pool:
            expected = list(pool.map(lambda kw: stream(server, kw), jobs))
        for text, reason in expected:
            assert reason == "stop"
            jsonschema.validate(json.loads(text), LONG_SCHEMA)
        counts = [0] * len(jobs)
        going = threading.Event()

        def seen(i, n):
            counts[i] = n
            if min(counts) >= 5:
                going.set()

        with ThreadPoolExecutor(len(jobs)) as pool:
            futs = [pool.submit(stream, server, kw, lambda n, i=i: seen(i, n)) for i, kw in enumerate(jobs)]
            assert going.wait(120), counts
            running = {d: server.workers()[d].get("num_running", 0) for d in ("decode-0", "decode-1")}
            victim = max(running, key=running.get)
            assert running[victim] > 0
            server.worker_process(victim).send_signal(signal.SIGKILL)
            at_kill = list(counts)
            got = [f.result(timeout=300) for f in futs]
        assert max(at_kill) < min(counts)  # killed mid-stream
        assert got == expected
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert re.search(rf'epd_migrated_requests_total{{[^}}]*instance="{victim}"[^}}]*}} [1-9]', metrics)
