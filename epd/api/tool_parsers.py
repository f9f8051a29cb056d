"""Tool calls in a model's output: incremental parsers for the common formats, and the
grammar that forces a valid call in each.

Formats (named as vLLM's ``--tool-call-parser`` names them):

* ``hermes`` (Hermes function calling; Qwen2.5/3, SmolLM3): ``<tool_call>\\n{"name": "f",
  "arguments": {...}}\\n</tool_call>``, one block per call; text before the first block is content.
* ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole answer is ``{"name": "f",
  "parameters": {...}}`` (``arguments`` accepted too), optionally after ``<|python_tag|>``,
  calls separated by ``;``. An answer that does not start with ``{`` is content.
* ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``; text before the marker is content.

Streaming (``ToolCallParser.feed``): a prefix of a call marker is held back until it is
resolved, so a partial tag is never streamed as content; a call's name is sent once, as
soon as its string is complete; then its arguments stream as the raw text of their JSON
value, never past its closing bracket. ``parse_tool_calls`` runs the same parser over a
whole output, so the fragments of a stream concatenate to exactly its non-streamed arguments.
Text after the calls is dropped. A forced call's arguments hold the declared parameters
only (``closed_objects``).

Source: the Hermes function-calling format (NousResearch/Hermes-Function-Calling), Meta's
Llama 3.1 model card (JSON tool calling), Mistral's ``[TOOL_CALLS]`` token; vLLM's
``hermes_tool_parser.py``, ``llama_tool_parser.py``, ``mistral_tool_parser.py`` as the
behaviour users know.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

#: most calls a forced ``parallel_tool_calls`` answer may hold
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=\S)')


def closed_objects(schema):
    """``schema`` (a copy) with ``additionalProperties: false`` on every object that lists
    ``properties`` and says nothing of others: a forced call's arguments are the declared
    parameters only (OpenAI's strict function calling), so a weak model cannot add keys
    until it runs out of tokens."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    closable = isinstance(out.get("properties"), dict) and out.get("type", "object") == "object"
    if closable and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass(slots=True)
class ToolCallDelta:
    """A call's next piece: ``name`` on its first delta only, then argument fragments."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class ParsedDelta:
    """What the next text of an output adds: content, and tool-call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def _scan_value(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at ``text[i]``; None while incomplete."""
    if text[i] in "{[":
        depth, in_str, esc = 0, False, False
        for j in range(i, len(text)):
            c = text[j]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    if text[i] == '"':
        esc = False
        for j in range(i + 1, len(text)):
            if esc:
                esc = False
            elif text[j] == "\\":
                esc = True
            elif text[j] == '"':
                return j + 1
        return None
    m = re.compile(r"[^,}\]\s]*").match(text, i)
    return m.end() if m.end() < len(text) else None


@dataclass(slots=True)
class _Call:
    """One call object's text as parsed so far."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


def _parse_object(text: str, start: int) -> tuple[_Call, int | None]:
    """The call object at ``text[start] == "{"`` and its end (None while incomplete)."""
    end = _scan_value(text, start)
    obj = text[start:end] if end is not None else text[start:]
    call = _Call()
    m = _NAME.search(obj)
    if m is not None:
        try:
            call.name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            call.name = m.group(1)
    a = _ARGS.search(obj)
    if a is not None:
        v_end = _scan_value(obj, a.end())
        call.arguments = obj[a.end():v_end] if v_end is not None else obj[a.end():]
        if end is not None and v_end is None:  # a scalar right before the object's "}"
            call.arguments = call.arguments.rstrip().rstrip("}").rstrip()
    call.complete = end is not None
    return call, end


class ToolCallParser:
    """The calls and content of one output, parsed as it streams (one instance per choice).

    Subclasses give ``name``, ``marker`` (what starts the calls), ``separators`` (text
    allowed between calls, besides whitespace) and ``format_calls`` / ``call_grammar``.
    """

    name: ClassVar[str]
    marker: ClassVar[str]
    separators: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.calls_start: int | None = None  # index in text just after the marker
        self.frozen: list[_Call] = []  # complete calls
        self.resume = 0  # where the next call is looked for
        self.sent: list[tuple[bool, int]] = []  # per call: name sent, argument chars sent
        self.stopped = False  # text after the calls that is not a call: the rest is dropped
        self.cut_at: int | None = None  # where a begun, unfinished call's text starts (its marker)

    @property
    def num_calls(self) -> int:
        """Calls whose name has been sent."""
        return sum(1 for named, _ in self.sent if named)

    def _find_marker(self) -> tuple[int | None, int]:
        """(index just after the marker, or None; how much text is surely content)."""
        i = self.text.find(self.marker)
        if i >= 0:
            return i + len(self.marker), i
        for k in range(min(len(self.marker) - 1, len(self.text)), 0, -1):
            if self.marker.startswith(self.text[-k:]):
                return None, len(self.text) - k
        return None, len(self.text)

    def feed(self, text: str) -> ParsedDelta:
        """The content and call pieces that ``text`` (the output's next chunk) completes."""
        self.text += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        """The end of the output: held-back text that never became a call is content."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        if self.calls_start is None:
            start, safe = self._find_marker()
            if start is None and final:
                safe = len(self.text)
            out.content = self.text[self.content_sent:safe]
            self.content_sent = max(self.content_sent, safe)
            if start is None:
                return out
            self.calls_start = self.resume = start
        calls = list(self.frozen)
        pos = self.resume
        self.cut_at = None
        while not self.stopped:
            i = self._next_object(pos)
            if i is None:
                break
            call, end = _parse_object(self.text, i)
            calls.append(call)
            if end is None:
                lo = self.resume if self.frozen else max(0, self.calls_start - len(self.marker))
                j = self.text.rfind(self.marker, lo, i)
                self.cut_at = j if j >= 0 else i
                break
            self.frozen.append(call)
            pos = self.resume = end
        for index, call in enumerate(calls):
            if index >= len(self.sent):
                self.sent.append((False, 0))
            named, n = self.sent[index]
            if call.name is None:
                continue
            if not named:
                out.calls.append(ToolCallDelta(index, call.name, call.arguments))
                self.sent[index] = (True, len(call.arguments))
            elif len(call.arguments) > n:
                out.calls.append(ToolCallDelta(index, None, call.arguments[n:]))
                self.sent[index] = (True, len(call.arguments))
        if final and not self.num_calls and self.calls_start is not None:
            out.content += self.text[self.content_sent:]  # a marker and no call: it was text
            self.content_sent = len(self.text)
        return out

    def _next_object(self, pos: int) -> int | None:
        """The index of the next call object's ``{`` after ``pos``; None while none has begun
        (or when other text follows: the calls are over)."""
        rest = self.text[pos:]
        i = rest.find("{")
        between = rest if i < 0 else rest[:i]
        for sep in (*self.separators, self.marker):
            between = between.replace(sep, "")
        if between.strip():
            if not any((s + self.marker).startswith(between.strip()) for s in ("", *self.separators)):
                self.stopped = True
            return None
        return None if i < 0 else pos + i

    @classmethod
    def format_calls(cls, calls: list[tuple[str, str]]) -> str:
        """Calls ``(name, arguments JSON text)`` as the model writes them (earlier turns)."""
        raise NotImplementedError

    @classmethod
    def _call_schema(cls, tools: list[tuple[str, dict]], args_key: str = "arguments") -> str:
        from epd.engine.grammar import bounded_schema

        options = [{"type": "object", "properties": {"name": {"const": name},
                                                     args_key: bounded_schema(closed_objects(params))},
                    "required": ["name", args_key], "additionalProperties": False} for name, params in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)

    @classmethod
    def call_grammar(cls, tools: list[tuple[str, dict]], parallel: bool) -> str:
        """An llguidance Lark grammar of one call (``parallel``: 1 to ``MAX_PARALLEL_CALLS``)
        in this format, naming one of ``tools`` ((name, parameters JSON schema)) with
        arguments valid against its schema; compact JSON, bounded strings."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    name = "hermes"
    marker = "<tool_call>"
    separators = ("</tool_call>",)

    @classmethod
    def format_calls(cls, calls):
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(n, ensure_ascii=False)}, "arguments": {a}}}\n'
                         "</tool_call>" for n, a in calls)

    @classmethod
    def call_grammar(cls, tools, parallel):
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return (f"start: call{more}\n"
                f'call: "<tool_call>\\n" %json {cls._call_schema(tools)} "\\n</tool_call>"\n')


class MistralParser(ToolCallParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    separators = ("[", ",", "]")

    @classmethod
    def format_calls(cls, calls):
        return "[TOOL_CALLS][" + ", ".join(f'{{"name": {json.dumps(n, ensure_ascii=False)}, "arguments": {a}}}'
                                           for n, a in calls) + "]"

    @classmethod
    def call_grammar(cls, tools, parallel):
        more = f' ("," call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return f'start: "[TOOL_CALLS][" call{more} "]"\ncall: %json {cls._call_schema(tools)}\n'


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    marker = "<|python_tag|>"
    separators = (";",)

    def _find_marker(self):
        stripped = self.text.lstrip()
        lead = len(self.text) - len(stripped)
        if stripped.startswith(self.marker):
            return lead + len(self.marker), lead
        if stripped.startswith("{"):
            return lead, lead
        if not stripped or self.marker.startswith(stripped):
            return None, 0  # undecided: hold it all
        return None, len(self.text)

    @classmethod
    def format_calls(cls, calls):
        return "; ".join(f'{{"name": {json.dumps(n, ensure_ascii=False)}, "parameters": {a}}}' for n, a in calls)

    @classmethod
    def call_grammar(cls, tools, parallel):
        more = f' (";" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return f"start: call{more}\ncall: %json {cls._call_schema(tools, 'parameters')}\n"


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parse_tool_calls(parser_cls: type[ToolCallParser], text: str) -> tuple[str, list[tuple[str, str]]]:
    """A whole output's content and calls ``(name, arguments JSON text)``: the parser fed the
    text in one piece, its fragments concatenated (what any streaming of it yields)."""
    parser = parser_cls()
    content, calls = "", {}
    for part in (parser.feed(text), parser.finish()):
        content += part.content
        for c in part.calls:
            name, args = calls.get(c.index, (c.name, ""))
            calls[c.index] = (name, args + c.arguments)
    return content, [calls[i] for i in sorted(calls)]


def detect_parser(chat_template: str | None) -> str:
    """The tool-call format a chat template writes: ``mistral`` for ``[TOOL_CALLS]``,
    ``llama3_json`` for Llama 3's ``<|python_tag|>`` / ``Environment: ipython``, else
    ``hermes`` (``<tool_call>``, and the default)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "Environment: ipython" in t:
        return "llama3_json"
    return "hermes"
