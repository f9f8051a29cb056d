"""Tool-call parsers: every chunking of an output streams the same calls as the whole output,
partial markers never leak as content, and each format's forced-call grammar accepts exactly
valid calls (checked with llguidance over the tiny tokenizer)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from epd.api.tool_parsers import PARSERS, detect_parser, parse_tool_calls

ARGS = '{"city": "Paris \\"<tool_call>\\" {x}", "n": [1, {"a": "}"}], "ok": true}'
OUTPUTS = {
    "hermes": [
        ("no calls at all", "no calls at all", []),
        (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
         "Let me check.\n", [("get_weather", ARGS)]),
        ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
         '{"arguments": {"y": "é😀"}, "name": "b"}\n</tool_call>', "", [("a", '{"x": 1}'), ("b", '{"y": "é😀"}')]),
        ("a <tools and more", "a <tools and more", []),
        # the call's own "name" key, not one inside its arguments; a name with escapes; a bare value
        ('<tool_call>\n{"arguments": {"name": "inner", "x": [{}]}, "name": "outer"}\n</tool_call>'
         '  \n\n<tool_call>{"name": "say \\"hi\\"", "arguments": 5 }</tool_call> trailing text',
         "", [("outer", '{"name": "inner", "x": [{}]}'), ('say "hi"', "5")]),
    ],
    "mistral": [
        (f'ok [TOOL_CALLS][{{"name": "f", "arguments": {ARGS}}}, {{"name": "g", "arguments": {{}}}}]', "ok ",
         [("f", ARGS), ("g", "{}")]),
        ("[TOOL inside text", "[TOOL inside text", []),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}] [TOOL_CALLS][{"name": "g", "arguments": null}]', "",
         [("f", '{"a": "]"}'), ("g", "null")]),
    ],
    "llama3_json": [
        (f'{{"name": "f", "parameters": {ARGS}}}; {{"name": "g", "parameters": {{"k": 2}}}}', "",
         [("f", ARGS), ("g", '{"k": 2}')]),
        ('<|python_tag|>{"name": "f", "arguments": {}}', "", [("f", "{}")]),
        ("plain answer {not a call}", "plain answer {not a call}", []),
    ],
}
CASES = [(fmt, *case) for fmt, cases in OUTPUTS.items() for case in cases]


def _stream(parser_cls, chunks):
    parser = parser_cls()
    content, calls, names = "", {}, {}
    for part in [parser.feed(c) for c in chunks] + [parser.finish()]:
        content += part.content
        for d in part.calls:
            if d.name is not None:
                assert d.index not in names, "a call's name is sent once"
                names[d.index] = d.name
                calls[d.index] = ""
            calls[d.index] += d.arguments
    return content, [(names[i], calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_output(fmt, text, content, calls):
    assert parse_tool_calls(PARSERS[fmt], text) == (content, calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_every_chunking_streams_the_whole_outputs_calls(fmt, text, content, calls):
    assert _stream(PARSERS[fmt], list(text)) == (content, calls)
    for k in range(1, len(text)):
        assert _stream(PARSERS[fmt], [text[:k], text[k:]]) == (content, calls), k


@pytest.mark.parametrize("fmt", list(PARSERS))
def test_partial_markers_are_held_back(fmt):
    cls = PARSERS[fmt]
    marker = cls.marker if fmt != "llama3_json" else "<|python_tag|>"
    parser = cls()
    prefix = "" if fmt == "llama3_json" else "hi "
    assert parser.feed(prefix + marker[:-2]).content == prefix
    assert parser.feed(marker[-2:]).content == ""  # the marker completed: never content


def test_detect_parser():
    assert detect_parser("{{ '<tool_call>' }}") == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ x }}") == "mistral"
    assert detect_parser("Environment: ipython <|python_tag|>") == "llama3_json"
    assert detect_parser(None) == "hermes"


WEATHER = ("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "when": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
              "additionalProperties": False}},
    "required": ["city", "unit", "days"], "additionalProperties": False})
NOARGS = ("ping", {"type": "object", "properties": {}})


@pytest.fixture(scope="module")
def tokenizer():
    import llguidance.hf

    from epd.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return tok, llguidance.hf.from_tokenizer(tok, len(tok))


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    import llguidance

    tok, lt = tokenizer
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("fmt", list(PARSERS))
def test_call_grammar_accepts_exactly_valid_calls(tokenizer, fmt):
    cls = PARSERS[fmt]
    good = '{"city":"Oslo","unit":"c","days":3,"when":"09:30","tags":["a"],"where":{"lat":1.5}}'
    ok = cls.format_calls([("get_weather", good)]).replace('", "', '","').replace('": ', '":').replace(
        ", {", ",{").replace("}, ", "},")
    grammar = cls.call_grammar([WEATHER, NOARGS], parallel=False)
    assert _accepts(tokenizer, grammar, ok), ok
    content, calls = parse_tool_calls(cls, ok)
    (name, args), = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER[1])
    for bad in (ok.replace("get_weather", "get_wether"), ok.replace('"days":3', '"days":9'),
                ok.replace("09:30", "9:30"), ok.replace('"c"', '"k"'), ok.replace('"city"', ' "city"'),
                ok.replace(',"where":{"lat":1.5}', ',"where":{"lat":1.5,"x":1}')):
        assert not _accepts(tokenizer, grammar, bad), bad
    ping = cls.format_calls([("ping", "{}")]).replace('", "', '","').replace('": ', '":')
    assert _accepts(tokenizer, grammar, ping), ping
    two = cls.format_calls([("ping", "{}"), ("ping", "{}")]).replace('", "', '","').replace('": ', '":').replace(
        "}, {", "},{").replace("; ", ";")
    assert not _accepts(tokenizer, grammar, two)
    assert _accepts(tokenizer, cls.call_grammar([WEATHER, NOARGS], parallel=True), two), two


CUT = [  # (output, finish reason it ended with) -> (content, complete calls, finish_reason)
    # cut by max_tokens inside the first call: nothing is a call, the text is content
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "length"),
    ('<tool_call>\n{"name": "get_wea', "length"),
    # a stop string cut a forced call's arguments: not a call either, and not "tool_calls"
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "stop"),
]


@pytest.mark.parametrize("text, reason", CUT)
def test_a_cut_call_is_content_and_never_finishes_with_tool_calls(text, reason):
    from epd.api.protocol import Tool
    from epd.api.streaming import ToolCallStream
    from epd.api.tools import ToolPlan

    tool = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER[1]}})
    plan = ToolPlan([tool], "get_weather" if reason == "stop" else "auto", True, PARSERS["hermes"])
    stream = ToolCallStream(plan)
    msg = stream.message(text)
    assert "tool_calls" not in msg and msg["content"] == text, msg
    assert stream.finish_reason(reason) == reason
    # a complete call before the cut one is kept; the cut one's text is content
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    stream = ToolCallStream(ToolPlan([tool], "auto", True, PARSERS["hermes"]))
    msg = stream.message(whole + '<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"city": "Paris"}'], msg
    assert msg["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"ci', msg
    assert stream.finish_reason("length") == "length"
    stream = ToolCallStream(ToolPlan([tool], "auto", True, PARSERS["hermes"]))
    assert "tool_calls" in stream.message(whole) and stream.finish_reason("stop") == "tool_calls"


LONG_ARGS = json.dumps({"code": 'x = {"a": [1, 2]}\\n\\\\ é ' * 1500,
                        "nested": [{"k": [i, {"v": "}"}]} for i in range(300)]})


@pytest.mark.parametrize("fmt", list(PARSERS))
def test_per_token_work_does_not_grow_with_the_arguments(fmt):
    """A token costs the same at the end of 50k characters of arguments as at their start:
    the parser reads each character once (``scanned``) and keeps only what it may still send."""
    cls = PARSERS[fmt]
    prose = "" if fmt == "llama3_json" else "Some words before the call. " * 500
    text = prose + cls.format_calls([("run_code", LONG_ARGS), ("ping", "{}")])
    assert len(LONG_ARGS) > 50_000
    parser, step = cls(), 3
    work, held, content, args = [], [], "", {}
    for k in range(0, len(text), step):
        before = parser.scanned
        part = parser.feed(text[k:k + step])
        work.append(parser.scanned - before)
        held.append(len(parser.text))
        content += part.content
        for d in part.calls:
            args[d.index] = args.get(d.index, "") + d.arguments
    part = parser.finish()
    assert content + part.content == prose
    assert args == {0: LONG_ARGS, 1: "{}"}
    assert max(work) <= step + len(cls.marker) + 16, max(work)  # constant, not the call's length
    assert sum(work) <= 2 * len(text)
    assert max(held) <= 64, max(held)  # the window, not the whole output


def test_llama3_plain_answer_is_read_once():
    parser = PARSERS["llama3_json"]()
    text = "A plain answer, no calls. " * 2000
    out = "".join(parser.feed(text[k:k + 4]).content for k in range(0, len(text), 4)) + parser.finish().content
    assert out == text and parser.scanned <= len(text) + 64 and not parser.text
