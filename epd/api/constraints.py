"""A request's output constraint: ``response_format``, vLLM's ``structured_outputs`` or a
forced tool call, as one checked ``StructuredOutputs``.

The API compiles each constraint once for its own tokenizer and follows it for one
token (``ConstraintChecker``, ``epd.engine.grammar.GrammarCompiler.check``) before
routing, so a schema, regex or grammar the engine cannot follow is the client's 400
naming ``param``, never a worker's failure. The workers compile it again for their own
tokenizer (they never trust the API's).

Source: OpenAI's ``response_format`` (``json_object``, ``json_schema``); vLLM's
``structured_outputs`` extension.
"""

from __future__ import annotations

import json
import threading

from epd.api.protocol import BadRequest, SamplingFields
from epd.errors import InvalidRequestError
from epd.structured_outputs import StructuredOutputs


class ConstraintChecker:
    """Checks constraints against the served model's tokenizer (``tokenizer``: the HF
    tokenizer; ``vocab_size``: the model's logits width). Checks are cached by constraint."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        from epd.engine.grammar import GrammarCompiler

        eos = getattr(tokenizer, "eos_token_id", None)
        self.compiler = GrammarCompiler(None, vocab_size, frozenset([eos] if isinstance(eos, int) else []), tokenizer)
        self._lock = threading.Lock()  # the CPU pool may check two requests at once

    def warm_up(self) -> None:
        """Build the grammar engine's tokenizer in the background (about 0.5 s)."""
        self.compiler.warm_up()

    def checked(self, spec: StructuredOutputs, param: str) -> StructuredOutputs:
        """``spec`` once it compiles and can be followed.

        Raises:
            BadRequest: it cannot; the message is the grammar engine's first line,
                ``param`` names the request field.
        """
        try:
            with self._lock:
                self.compiler.check(spec)
        except InvalidRequestError as e:
            raise BadRequest(str(e), param) from None
        return spec


def _spec(param: str, **kw) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kw)
    except ValueError as e:
        raise BadRequest(str(e), param) from None


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise BadRequest("the JSON schema is not valid JSON", param) from None
    if not isinstance(schema, dict):
        raise BadRequest("the JSON schema must be a JSON object", param)
    return json.dumps(schema, ensure_ascii=False)  # key order kept: properties come out in schema order


def requested_constraint(body: SamplingFields) -> tuple[StructuredOutputs, str] | None:
    """The constraint ``response_format`` or ``structured_outputs`` asks for, with the
    field that asked (not yet compiled); None when neither does.

    Raises:
        BadRequest: both are given, ``json_schema`` lacks its schema, or the constraint is malformed.
    """
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise BadRequest("give response_format or structured_outputs, not both", "structured_outputs")
    if rf is not None and rf.type == "json_object":
        return _spec("response_format", json_object=True), "response_format"
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise BadRequest("response_format json_schema needs json_schema.schema", "response_format.json_schema")
        return (_spec("response_format.json_schema.schema",
                      json=_schema_text(rf.json_schema.json_schema, "response_format.json_schema.schema")),
                "response_format.json_schema.schema")
    if so is None:
        return None
    given = {k: v for k, v in (("json", so.json_schema), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar)) if v is not None}
    if so.json_object:
        given["json_object"] = True
    if len(given) != 1:
        raise BadRequest(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got "
                         f"{sorted(given) or 'none'}", "structured_outputs")
    (kind, value), = given.items()
    param = f"structured_outputs.{kind}"
    if kind == "json":
        value = _schema_text(value, param)
    return _spec(param, **{kind: value}), param
