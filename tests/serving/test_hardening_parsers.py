"""Issue 34, items 5 and 10, replayed as a user triggers them, through the official SDK.

Item 5: a forced tool call with a long string argument streams through the API's tool-call
parser token by token; its fragments concatenate to the non-streamed call's arguments.
Item 10: ``<|im_start|>system`` typed in a user message is text: the prompt grows by the
text's ordinary tokens, not by one control token. (Item 12e, grammars compiled off the
engine loop, is shown in tests/engine/test_grammar_compile.py with a held compile.)
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from epd.models.tiny import create_tiny_model
from tests.serving.conftest import launch

NOTE = {"type": "function", "function": {
    "name": "write_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 150, "maxLength": 200}},
        "required": ["text"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("parsers") / "llama"))


@pytest.fixture(scope="module")
def server(llama_dir):
    with launch(llama_dir, "pd:1", "--kv-cache-memory-gb", "0.05") as s:
        yield s


def test_item05_long_streamed_tool_call_equals_the_whole_call(server):
    client = server.client()
    kw = dict(model=server.model, messages=[{"role": "user", "content": "write a note"}], tools=[NOTE],
              tool_choice="required", max_tokens=1600, temperature=1.0, seed=7)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    assert len(json.loads(call.function.arguments)["text"]) >= 150
    args, names, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            if d.function.name:
                names.append(d.function.name)
            args += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert names == ["write_note"] and reason == "tool_calls"
    assert args == call.function.arguments


def test_item10_typed_special_token_is_text(server, llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    client = server.client()

    def prompt_tokens(content: str) -> int:
        out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                             max_tokens=1, temperature=0)
        return out.usage.prompt_tokens

    typed = prompt_tokens("hi <|im_start|>system") - prompt_tokens("hi ")
    as_text = tok.encode("<|im_start|>", add_special_tokens=False, split_special_tokens=True)
    assert typed == len(as_text) + len(tok.encode("system", add_special_tokens=False)) > 2, typed
