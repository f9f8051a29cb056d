"""Constrained decoding on a random tiny model: nothing but the grammar can make its output right.

Every output must parse and validate, greedy and sampled, ending with ``finish_reason``
"stop"; a request resumed after N tokens (the router's migration) must continue exactly as
the uninterrupted one (its matcher is rebuilt from the tokens already streamed).
"""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest

from epd import LLM, SamplingParams
from epd.engine.grammar import MAX_STRING_CHARS, bounded_schema
from epd.errors import InvalidRequestError
from epd.structured_outputs import StructuredOutputs

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
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
SAMPLING = [dict(temperature=0.0)] + [dict(temperature=1.0, seed=s) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    engine = LLM(tiny_model_dirs["llama"], block_size=8, dtype="float32")
    yield engine
    engine.shutdown()


def _run(llm, spec: StructuredOutputs, prompt="hello world", max_tokens=300, **kw):
    tok = llm.engine.tokenizer
    out = llm.generate([tok.encode(prompt)], [SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **kw)])
    comp = out[0].outputs[0]
    return comp.text, comp.finish_reason, comp.token_ids


@pytest.mark.parametrize("kw", SAMPLING, ids=lambda kw: f"seed{kw.get('seed', 'greedy')}")
def test_json_schema_outputs_validate(llm, kw):
    text, reason, _ = _run(llm, StructuredOutputs(json=json.dumps(SCHEMA)), **kw)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert " " not in text.replace(json.loads(text)["name"], "").replace(json.loads(text)["address"]["city"], "")


@pytest.mark.parametrize("kw", SAMPLING, ids=lambda kw: f"seed{kw.get('seed', 'greedy')}")
def test_regex_choice_and_grammars(llm, kw):
    text, reason, _ = _run(llm, StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,5}"), **kw)
    assert reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
    choices = ["alpha", "beta gamma", "δέλτα"]
    text, reason, _ = _run(llm, StructuredOutputs(choice=choices), **kw)
    assert reason == "stop" and text in choices
    lark = 'start: "(" num ("+" num){0,3} ")"\nnum: /[1-9][0-9]?/'
    text, reason, _ = _run(llm, StructuredOutputs(grammar=lark), **kw)
    assert reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)", text), text
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    text, reason, _ = _run(llm, StructuredOutputs(grammar=gbnf), **kw)
    assert reason == "stop" and text in ("yes", "no", "maybe")


def test_json_object_is_a_bounded_json_object(llm):
    """``json_object``: whatever the random model writes is a prefix of one compact JSON
    object; where it stops, it parses."""
    for seed in range(4):
        text, reason, _ = _run(llm, StructuredOutputs(json_object=True), max_tokens=200, temperature=1.0, seed=seed)
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_ignore_eos_still_stops_when_the_grammar_is_complete(llm):
    text, reason, _ = _run(llm, StructuredOutputs(choice=["done"]), ignore_eos=True, max_tokens=50)
    assert (text, reason) == ("done", "stop")


@pytest.mark.parametrize("kw", SAMPLING[:2], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_under_its_grammar(llm, kw):
    """The router's migration: prompt + the first n tokens, ``num_prior_output_tokens=n``.
    The matcher is advanced past them; the rest equals the uninterrupted run."""
    tok = llm.engine.tokenizer
    prompt = tok.encode("hello world")
    params = SamplingParams(max_tokens=300, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA)), **kw)
    full = llm.generate([prompt], [params])[0].outputs[0].token_ids
    for n in (1, 7, len(full) - 2):
        resumed = msgspec.structs.replace(params, max_tokens=300 - n, num_prior_output_tokens=n)
        rest = llm.generate([prompt + full[:n]], [resumed])[0].outputs[0]
        assert rest.token_ids == full[n:], n
        assert rest.finish_reason == "stop"


def test_prior_output_that_breaks_the_grammar_is_refused(llm):
    """A compiled grammar refuses the request at once; one still compiling (off the engine
    loop) ends it with finish_reason "error" once compiled. Nothing stays behind."""
    tok = llm.engine.tokenizer
    bad = tok.encode("hello") + tok.encode("nope")
    spec = StructuredOutputs(choice=["yes", "no"])
    params = SamplingParams(structured_outputs=spec, num_prior_output_tokens=2)
    llm.engine.add_request("bad-compiling", bad, params)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    (out,) = [o for o in outs if o.request_id == "bad-compiling"]
    assert out.outputs[0].finish_reason == "error" and "does not follow" in out.outputs[0].stop_reason
    assert llm.engine.grammars.is_compiled(spec)
    with pytest.raises(InvalidRequestError, match="does not follow"):
        llm.engine.add_request("bad", bad, params)
    assert not llm.engine.has_unfinished_requests()


def test_invalid_constraints_are_refused_before_anything_runs(llm):
    """A constraint that does not compile ends its request alone (finish_reason "error",
    the compiler's message as reason) before any token of it runs; the check the API does
    first (``GrammarCompiler.check``) raises the same message."""
    cases = ((StructuredOutputs(json='{"type": "nonsense"}'), "Invalid type"),
             (StructuredOutputs(regex="a(b"), "unclosed group"),
             (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule"),
             (StructuredOutputs(json="[1, 2]"), "must be an object"))
    for i, (spec, match) in enumerate(cases):
        with pytest.raises(InvalidRequestError, match=match):
            llm.engine.grammars.check(spec)
        llm.engine.add_request(f"x{i}", [5, 6, 7], SamplingParams(structured_outputs=spec))
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in llm.engine.step()})
    for i, (_, match) in enumerate(cases):
        assert outs[f"x{i}"].finish_reason == "error" and re.search(match, outs[f"x{i}"].stop_reason), outs[f"x{i}"]
        assert outs[f"x{i}"].token_ids == []
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


def test_unbounded_strings_get_a_max_length():
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string", "maxLength": 3},
                                                "c": {"type": ["string", "null"], "pattern": "x"},
                                                "d": {"anyOf": [{"type": "string", "enum": ["q"]}]}}}
    out = bounded_schema(schema)["properties"]
    assert out["a"]["maxLength"] == MAX_STRING_CHARS and out["b"]["maxLength"] == 3
    assert out["c"]["maxLength"] == MAX_STRING_CHARS and "maxLength" not in out["d"]["anyOf"][0]
    assert "maxLength" not in schema["properties"]["a"]  # a copy


def test_sampling_params_carry_the_constraint_over_the_wire():
    from epd.messages import GenerateRequest, decode, encode

    params = SamplingParams(structured_outputs=StructuredOutputs(choice=["a", "b"]))
    msg = GenerateRequest("r", [1, 2], params)
    assert decode(encode(msg)).params.structured_outputs == params.structured_outputs
