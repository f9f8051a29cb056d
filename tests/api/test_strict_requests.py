"""Request bodies are validated strictly, as OpenAI does (review defect 8).

``"max_tokens": "16"``, ``"max_tokens": true``, ``"stream": "yes"`` or ``"temperature":
"0.5"`` are 400s whose ``param`` names the field, while every request shape the
serving tests, the README and the examples send still validates (an int where a
number is expected is a valid JSON number). The HTTP app is the real one
(``build_http_app``) with its completion service stubbed, so no worker runs.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from epd.api import completions
from epd.api.realtime.protocol import ResponseCreate, SessionUpdate
from epd.api.server import ApiSettings, build_http_app
from epd.models.tiny import build_tiny_tokenizer

USER = [{"role": "user", "content": "hi"}]
IMG = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module")
def client():
    async def handle(self, request, body, chat):  # what validation let through, echoed back
        return JSONResponse({"chat": chat, "body": body.model_dump()})

    mp = pytest.MonkeyPatch()
    mp.setattr(completions.CompletionService, "handle", handle)
    processor = SimpleNamespace(placeholder_ids={}, modalities={"audio": "transcribe"}, max_items_per_prompt=16)
    app = build_http_app(SimpleNamespace(), build_tiny_tokenizer(), processor, model_name="m", max_model_len=64,
                         settings=ApiSettings(), vocab_size=512)
    with TestClient(app) as c:
        yield c
    mp.undo()


def post(client, body: dict, path: str = "/v1/chat/completions"):
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "16"), ("max_tokens", True), ("max_tokens", 16.5), ("stream", "yes"), ("stream", 1),
    ("temperature", "0.5"), ("temperature", True), ("top_p", "1"), ("n", "2"), ("seed", "7"), ("seed", False),
    ("logprobs", "true"), ("top_logprobs", "2"), ("max_completion_tokens", "8"), ("top_k", "5"),
    ("presence_penalty", "0.1"), ("ignore_eos", "no"), ("stop", 5), ("user", 7),
])
def test_chat_fields_of_the_wrong_json_type_are_400_naming_the_field(client, field, value):
    r = post(client, {"messages": USER, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == field and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": "16"}, "max_tokens"), ({"prompt": "hi", "logprobs": "2"}, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"), ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": ["1", 2]}, "prompt.0"), ({"prompt": [True, 2]}, "prompt.0"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_completion_fields_of_the_wrong_json_type_are_400(client, body, param):
    r = post(client, body, "/v1/completions")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_nested_content_parts_are_strict(client):
    for parts, in [([{"type": "text", "text": 5}],), ([{"type": "image_url", "image_url": {"url": 5}}],),
                   ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, {"type": "text"}],)]:
        r = post(client, {"messages": [{"role": "user", "content": parts}]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content"), r.text


VALID_CHAT = [
    {"messages": USER, "max_tokens": 32, "temperature": 0, "stream": True},  # README
    {"messages": USER, "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2, "user": "u-1", "presence_penalty": 0.5,
     "frequency_penalty": 0.5, "top_k": 20},
    {"messages": USER, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2, "stream": True},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "one"}], "max_tokens": 2,
     "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMG}}, {"type": "text", "text": "What is in this picture?"}]}],
     "max_tokens": 16},
    {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMG, "detail": "auto"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "max_completion_tokens": 4, "stop": "x", "top_p": 1, "temperature": 1},
    {"messages": [{"role": "developer", "content": None}, {"role": "assistant", "content": "a", "name": "n"}],
     "stop": ["a", "b"], "seed": 0, "ignore_eos": True, "logit_bias": {"42": 1}, "model": "m",
     "response_format": {"type": "text"}, "tools": None, "stream": False, "logprobs": False},
]
VALID_COMPLETIONS = [
    {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": [" upon"]},
    {"prompt": [7, 70, 170], "max_tokens": 6, "temperature": 0, "logprobs": 3},
    {"prompt": ["a", "b"], "max_tokens": 8, "temperature": 0, "n": 2, "stream": True, "seed": 7},
    {"prompt": [[1, 2], [3]], "max_tokens": 2, "echo": False, "best_of": 1, "suffix": None},
    {"prompt": list(range(30, 60)), "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True,
     "stream_options": {"include_usage": True}},
]


def test_every_valid_shape_still_validates(client):
    for body in VALID_CHAT:
        r = post(client, body)
        assert r.status_code == 200 and r.json()["chat"], (body, r.text)
    for body in VALID_COMPLETIONS:
        r = post(client, body, "/v1/completions")
        assert r.status_code == 200 and not r.json()["chat"], (body, r.text)
    got = post(client, {"messages": USER, "temperature": 1, "top_p": 1}).json()["body"]
    assert got["temperature"] == 1.0 and isinstance(got["temperature"], float)  # an int is a JSON number


def test_realtime_sampling_fields_are_strict():
    SessionUpdate.model_validate({"type": "session.update", "session": {
        "type": "realtime", "max_output_tokens": 4, "temperature": 0, "instructions": "x",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}}}})
    ResponseCreate.model_validate({"type": "response.create", "response": {
        "max_output_tokens": "inf", "temperature": 0.5, "conversation": "none", "metadata": {"k": "v"},
        "input": [{"type": "item_reference", "id": "item_1"}]}})
    for session in ({"temperature": "0.5"}, {"temperature": True}, {"max_output_tokens": "16"},
                    {"max_output_tokens": True}, {"audio": {"input": {"format": {"rate": "16000"}}}}):
        with pytest.raises(ValueError):
            SessionUpdate.model_validate({"session": session})
    for response in ({"temperature": "0"}, {"max_output_tokens": "8"}, {"max_output_tokens": 8.0}):
        with pytest.raises(ValueError):
            ResponseCreate.model_validate({"response": response})


def test_a_realtime_event_of_the_wrong_type_is_an_error_event_naming_the_field():
    from tests.api.test_realtime_session import send, session

    s = session()
    (err,) = send(s, type="session.update", event_id="e1", session={"max_output_tokens": "16"})
    assert err["type"] == "error" and err["error"]["event_id"] == "e1"
    assert err["error"]["param"] == "session.max_output_tokens"  # not pydantic's union branch ".int"
    (err,) = send(s, type="response.create", response={"temperature": "0"})
    assert err["error"]["param"] == "response.temperature"
    assert s.max_output_tokens == 16 and s.active is None  # the session goes on, unchanged


def test_a_tool_result_names_its_call(client):
    """OpenAI refuses a ``role: tool`` message without ``tool_call_id``: the model could not
    tell which call it answers."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "42"}]
    r = post(client, {"messages": msgs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.2.tool_call_id", r.text
    msgs[2]["tool_call_id"] = "call_1"
    assert post(client, {"messages": msgs}).status_code == 200
