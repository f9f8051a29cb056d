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


_IN_STRING = re.compile(r'["\\]')  # what ends or escapes inside a JSON string
_NESTED = re.compile(r'["{}\[\]]')  # what matters inside a nested value
_SCALAR_END = re.compile(r'[\s,}\]]')  # what ends a bare value (number, true, null)
_NOT_SPACE = re.compile(r"\S")
_ARG_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class _CallScanner:
    """One call object's text, scanned once as it streams: its top-level ``"name"`` string
    and its ``"arguments"`` (or ``"parameters"``) value, and its end.

    Positions are indexes in the whole output; ``scan`` reads only text past ``pos``.
    """

    start: int  # the object's "{"
    pos: int = 0  # the next index to scan
    depth: int = 1
    in_str: bool = False
    esc: bool = False
    str_start: int | None = None  # a top-level string's opening quote
    key: str | None = None  # the last top-level string (a key once ":" follows)
    want_value: bool = False  # after a top-level ":", before its value
    value_key: str | None = None  # the key of the top-level value being scanned
    value_start: int | None = None
    value_str: bool = False  # the top-level value being scanned is a string
    scalar: bool = False  # in a top-level bare value
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    in_args: bool = False
    end: int | None = None  # the index after the object's "}"

    def __post_init__(self) -> None:
        self.pos = self.start + 1

    def keep_from(self) -> int:
        """The first index of the output this call may still read (a top-level string's start)."""
        if self.in_str and self.depth == 1:
            return self.value_start if self.value_start is not None else self.str_start
        return self.pos

    def args_upto(self) -> int:
        """The end of the arguments' text scanned so far (``args_start`` when none)."""
        if self.args_start is None:
            return 0
        return self.args_end if self.args_end is not None else self.pos

    def _value_end(self, at: int, text: str, base: int) -> None:
        if self.in_args:
            self.args_end, self.in_args = at, False
        elif self.value_key == "name" and self.name is None and self.value_str:
            raw = text[self.value_start - base + 1:at - base - 1]
            try:
                self.name = json.loads(f'"{raw}"')
            except ValueError:
                self.name = raw
        self.value_key = self.value_start = None

    def _top(self, text: str, base: int, p: int) -> int:
        """Handle the top-level character at ``text[p]``; the next index to scan."""
        m = _NOT_SPACE.search(text, p)
        if m is None:
            return len(text)
        p = m.start()
        c = text[p]
        if self.want_value:  # a value begins
            self.want_value = False
            self.value_key, self.value_start, self.value_str = self.key, base + p, c == '"'
            if self.key in _ARG_KEYS and self.args_start is None:
                self.args_start, self.in_args = base + p, True
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            else:
                self.scalar = True
                return p
            return p + 1
        if c == '"':
            self.in_str, self.str_start = True, base + p
        elif c == ":":
            self.want_value = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.end = base + p + 1
        return p + 1

    def scan(self, text: str, base: int) -> int:
        """Scan ``text`` (the output from index ``base``) past ``pos``; how many characters that read."""
        p, n, begin = self.pos - base, len(text), self.pos
        while p < n and self.end is None:
            if self.in_str:
                if self.esc:
                    self.esc, p = False, p + 1
                    continue
                m = _IN_STRING.search(text, p)
                if m is None:
                    p = n
                    break
                p = m.end()
                if m.group() == "\\":
                    self.esc = True
                    continue
                self.in_str = False
                if self.depth == 1:
                    if self.value_start is not None:
                        self._value_end(base + p, text, base)
                    else:
                        self.key = text[self.str_start - base + 1:p - 1]
            elif self.depth > 1:
                m = _NESTED.search(text, p)
                if m is None:
                    p = n
                    break
                p, c = m.end(), m.group()
                if c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth == 1:
                        self._value_end(base + p, text, base)
            elif self.scalar:
                m = _SCALAR_END.search(text, p)
                if m is None:
                    p = n
                    break
                p, self.scalar = m.start(), False
                self._value_end(base + p, text, base)
            else:
                p = self._top(text, base, p)
        self.pos = base + p
        return self.pos - begin


class ToolCallParser:
    """The calls and content of one output, parsed as it streams (one instance per choice).

    Each character is scanned once: ``feed`` reads only its new text (and a held-back prefix
    of a marker or separator), and keeps only the text it may still send or decode, so a
    token costs the same however long the call it is in. ``scanned`` counts the characters
    read (a test's measure of that work).

    Subclasses give ``name``, ``marker`` (what starts the calls), ``separators`` (text
    allowed between calls, besides whitespace) and ``format_calls`` / ``call_grammar``.
    """

    name: ClassVar[str]
    marker: ClassVar[str]
    separators: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.text = ""  # the output from index ``base`` on (what may still be sent or decoded)
        self.base = 0
        self.content_sent = 0  # index: the output before it went out as content
        self.calls_start: int | None = None  # index just after the marker
        self.marker_at: int | None = None  # the index of the marker before the open call
        self.frozen: list[str | None] = []  # complete calls' names
        self.open: _CallScanner | None = None  # the call object being scanned
        self.resume = 0  # where the text between calls is read next
        self.sent: list[tuple[bool, int]] = []  # per call: name sent, argument chars sent
        self.stopped = False  # text after the calls that is not a call: the rest is dropped
        self.cut_at: int | None = None  # where a begun, unfinished call's text starts (its marker)
        self.scanned = 0
        self._tokens = tuple(sorted((self.marker, *self.separators), key=len, reverse=True))

    @property
    def end(self) -> int:
        """The length of the output fed so far."""
        return self.base + len(self.text)

    @property
    def num_calls(self) -> int:
        """Calls whose name has been sent."""
        return sum(1 for named, _ in self.sent if named)

    def _find_marker(self) -> tuple[int | None, int]:
        """(index just after the marker, or None; how much of the output is surely content)."""
        lo = self.content_sent - self.base
        i = self.text.find(self.marker, lo)
        self.scanned += len(self.text) - lo
        if i >= 0:
            return self.base + i + len(self.marker), self.base + i
        for k in range(min(len(self.marker) - 1, len(self.text) - lo), 0, -1):
            if self.marker.startswith(self.text[-k:]):
                return None, self.end - k
        return None, self.end

    def feed(self, text: str) -> ParsedDelta:
        """The content and call pieces that ``text`` (the output's next chunk) completes."""
        self.text += text
        out = self._advance(final=False)
        self._trim()
        return out

    def finish(self) -> ParsedDelta:
        """The end of the output: held-back text that never became a call is content."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        if self.calls_start is None:
            start, safe = self._find_marker()
            if start is None and final:
                safe = self.end
            out.content = self.text[self.content_sent - self.base:safe - self.base]
            self.content_sent = max(self.content_sent, safe)
            if start is None:
                return out
            self.calls_start = self.resume = start
            self.marker_at = safe if start > safe else None
        while not self.stopped:
            if self.open is None:
                i = self._next_object()
                if i is None:
                    break
                self.open = _CallScanner(i)
                self.sent.append((False, 0))
                self.cut_at = self.marker_at if self.marker_at is not None else i
            self.scanned += self.open.scan(self.text, self.base)
            self._send(len(self.frozen), self.open, out)
            if self.open.end is None:
                break
            self.frozen.append(self.open.name)
            self.resume, self.open, self.marker_at, self.cut_at = self.open.end, None, None, None
        if final and not self.num_calls and self.calls_start is not None:
            out.content += self.text[self.content_sent - self.base:]  # a marker and no call: it was text
            self.content_sent = self.end
        return out

    def _send(self, index: int, call: _CallScanner, out: ParsedDelta) -> None:
        """The open call's name (once) and its arguments' new text, into ``out``."""
        named, n = self.sent[index]
        if call.name is None:
            return
        lo = call.args_start if call.args_start is not None else self.end
        upto = call.args_upto()
        if not named:
            args = self.text[lo - self.base:upto - self.base] if call.args_start is not None else ""
            out.calls.append(ToolCallDelta(index, call.name, args))
            self.sent[index] = (True, len(args))
        elif call.args_start is not None and upto - lo > n:
            out.calls.append(ToolCallDelta(index, None, self.text[lo + n - self.base:upto - self.base]))
            self.sent[index] = (True, upto - lo)

    def _next_object(self) -> int | None:
        """The index of the next call object's ``{``, reading the text between calls from
        ``resume``: whitespace, separators and markers; None while none has begun (a prefix
        of a separator or marker waits), or when other text follows (the calls are over)."""
        p = self.resume - self.base
        while True:
            m = _NOT_SPACE.search(self.text, p)
            self.scanned += (m.start() if m else len(self.text)) - p
            if m is None:
                self.resume = self.end
                return None
            p = m.start()
            if self.text[p] == "{":
                self.resume = self.base + p
                return self.resume
            head = self.text[p:p + len(self._tokens[0])]
            self.scanned += len(head)
            if any(len(t) > len(head) and t.startswith(head) for t in self._tokens):
                self.resume = self.base + p  # a separator or marker may be arriving
                return None
            tok = next((t for t in self._tokens if head.startswith(t)), None)
            if tok is None:
                self.stopped = True
                return None
            if tok == self.marker:
                self.marker_at = self.base + p
            p += len(tok)
            self.scanned += len(tok)

    def _trim(self) -> None:
        """Drop the text nothing will send or decode again: before a marker, a held-back
        prefix of it; with no call named yet, all from the marker (``finish`` may send it as
        content); else the pending text between calls, or the open call's unsent arguments
        and the top-level string it is in."""
        if self.calls_start is None:
            keep = self.content_sent
        elif self.stopped:
            keep = self.end
        elif self.open is None:
            keep = self.resume
        else:
            keep = self.open.keep_from()
            if self.open.args_start is not None:
                named, n = self.sent[len(self.frozen)]
                keep = min(keep, self.open.args_start + (n if named else 0))
        if self.calls_start is not None and not self.num_calls:
            keep = min(keep, self.content_sent)
        if keep > self.base:
            self.text = self.text[keep - self.base:]
            self.base = keep

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

    def __init__(self) -> None:
        super().__init__()
        self.plain = False  # the answer began as text: no call follows

    def _find_marker(self):
        if self.plain:
            return None, self.end
        stripped = self.text.lstrip()  # nothing is trimmed before this is decided (base 0)
        self.scanned += len(self.text)
        lead = len(self.text) - len(stripped)
        if stripped.startswith(self.marker):
            return lead + len(self.marker), lead
        if stripped.startswith("{"):
            return lead, lead
        if not stripped or self.marker.startswith(stripped):
            return None, 0  # undecided: hold it all
        self.plain = True
        return None, self.end

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
