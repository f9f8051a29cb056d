"""A chat request's tools: which may be called, how the chat template shows them, and how a
``required`` or named ``tool_choice`` forces a valid call.

``tool_plan`` checks ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (400s naming
``param``); ``ToolPlan.constraint`` is the grammar of a forced call in the tool-call
parser's format, its arguments valid against the function's JSON schema (so even a small
model emits a call that parses and validates). The model's output is parsed back into
``tool_calls`` by ``epd.api.tool_parsers``.

A chat template that renders ``tools`` itself (Qwen2.5, Llama 3.1, Mistral, SmolLM3) gets
them as transformers passes them; one that ignores them (SmolLM2's plain ChatML) gets
``fallback_messages``: the tools described in a system message in the parser's format,
earlier calls as the assistant's text and results as ``<tool_response>`` user turns, the
way Qwen2.5's template writes them.

Source: OpenAI's chat completions reference (``tools``, ``tool_choice``,
``parallel_tool_calls``); vLLM's ``tool_choice`` handling; transformers' chat templating
guide (tool use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from epd.api.protocol import BadRequest, ChatRequest, Tool
from epd.api.tool_parsers import PARSERS, ToolCallParser
from epd.structured_outputs import StructuredOutputs

#: the parameters of a function that declares none
NO_PARAMETERS = {"type": "object", "properties": {}}
_PROBE_TOOL = {"type": "function", "function": {"name": "epd_probe_fn_7f3a", "description": "probe",
                                                "parameters": NO_PARAMETERS}}


@dataclass(slots=True)
class ToolPlan:
    """The tools of one chat request.

    ``choice``: ``"auto"``, ``"required"``, ``"none"`` or the name of the function that
    must be called; ``parallel``: several calls may come in one answer; ``parser``: the
    tool-call format the model writes (``epd.api.tool_parsers``).
    """

    tools: list[Tool]
    choice: str
    parallel: bool
    parser: type[ToolCallParser]

    @property
    def parses(self) -> bool:
        """Whether the output is parsed for tool calls (not with ``tool_choice: "none"``)."""
        return self.choice != "none"

    def functions(self) -> list[tuple[str, dict]]:
        """(name, parameters schema) of each function the model may call now."""
        fns = [(t.function.name, t.function.parameters or NO_PARAMETERS) for t in self.tools]
        return fns if self.choice in ("auto", "required", "none") else [f for f in fns if f[0] == self.choice]

    def constraint(self, check) -> StructuredOutputs | None:
        """The grammar of a forced call (``required`` or a named function), passed through
        ``check`` (``ConstraintChecker.checked``); None otherwise.

        Raises:
            BadRequest: the grammar does not compile (``param``: ``tools``).
        """
        if self.choice in ("auto", "none"):
            return None
        grammar = self.parser.call_grammar(self.functions(), self.parallel and self.choice == "required")
        return check(StructuredOutputs(grammar=grammar), "tools")

    def template_tools(self) -> list[dict]:
        """The tools as transformers' ``apply_chat_template(tools=...)`` takes them (OpenAI's shape)."""
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]


def tool_plan(body: ChatRequest, parser_name: str, check) -> ToolPlan | None:
    """The chat request's ``ToolPlan``, or None when it has no tools; each function's
    parameters pass ``check`` (``ConstraintChecker.checked``).

    Raises:
        BadRequest: a ``tool_choice`` without tools or naming no tool, two tools with one
            name, or parameters that are not a JSON schema the grammar engine takes.
    """
    choice = body.tool_choice
    named = None if isinstance(choice, str) or choice is None else choice.function.name
    return plan_tools(list(body.tools or []), named or choice, named is not None, body.parallel_tool_calls is not False,
                      parser_name, check)


def plan_tools(tools: list[Tool], choice: str | None, named: bool, parallel: bool, parser_name: str, check, *,
               param: str = "tools", choice_param: str = "tool_choice",
               parameters_param: str = "tools.{i}.function.parameters") -> ToolPlan | None:
    """The ``ToolPlan`` of ``tools`` and ``choice`` (``"auto"``, ``"none"``, ``"required"``,
    None: auto; or, with ``named``, the function that must be called), or None without
    tools. The chat API's ``tool_plan`` and the realtime session's tools both come here;
    ``param`` / ``choice_param`` / ``parameters_param`` name the fields in errors.

    Raises:
        BadRequest: as ``tool_plan``.
    """
    if not tools:
        if choice not in (None, "none", "auto") or named:
            raise BadRequest("tool_choice needs tools", choice_param)
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("two tools have the same function name", param)
    for i, t in enumerate(tools):
        params = t.function.parameters
        if params is not None:
            where = parameters_param.format(i=i)
            if params.get("type", "object") != "object":
                raise BadRequest("a function's parameters must be a JSON schema of type object", where)
            check(StructuredOutputs(json=json.dumps(params, sort_keys=True)), where)
    if named and choice not in names:
        raise BadRequest(f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})",
                         choice_param)
    return ToolPlan(list(tools), choice or "auto", parallel, PARSERS[parser_name])


def apply_template(tokenizer, msgs: list[dict], plan: ToolPlan | None, native_tools: bool,
                   parser: type[ToolCallParser], escape=None) -> str:
    """The chat template's text over ``msgs`` (with the generation prompt) and the tools of
    ``plan``: passed as ``tools=`` to a template that shows them (``native_tools``), else
    described by ``fallback_messages``, as are earlier calls and results. ``escape``
    (``LiteralText.escape_value``) marks the client's text in the tools (names,
    descriptions, schemas); ``msgs`` come already marked.

    Raises:
        whatever the template raises (jinja errors for conversations it rejects).
    """
    kw = {}
    tools = plan.template_tools() if plan is not None else []
    if escape is not None:
        tools = escape(tools)
    if native_tools:
        if plan is not None:
            kw["tools"] = tools
    elif plan is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
        msgs = fallback_messages(msgs, tools, parser)
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)


def template_renders_tools(tokenizer) -> bool:
    """Whether the model's chat template shows ``tools`` (a probe tool's name must appear)."""
    try:
        out = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL],
                                            add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that rejects tools does not render them
        return False
    return isinstance(out, str) and _PROBE_TOOL["function"]["name"] in out


def template_message(m, content) -> dict:
    """A chat message as transformers' templates take it: assistant ``tool_calls`` with their
    arguments parsed (templates write them with ``tojson``), a tool result's ``tool_call_id``."""
    msg = {"role": m.role, "content": content}
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": parse_arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        msg["name"] = m.name
    return msg


def parse_arguments(text: str):
    """A call's ``arguments`` JSON text as the object templates write with ``tojson`` (the
    text itself when it is not a JSON object)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def fallback_messages(msgs: list[dict], tools: list[dict], parser: type[ToolCallParser]) -> list[dict]:
    """``msgs`` for a template that ignores tools: the request's ``tools`` (OpenAI's shape) in a system
    message, earlier calls as assistant text in ``parser``'s format, results as
    ``<tool_response>`` user turns."""
    out = []
    for m in msgs:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = (m.get("content") or "")
            text += ("\n" if text else "") + parser.format_calls(
                [(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False)
                  if not isinstance(c["function"]["arguments"], str) else c["function"]["arguments"])
                 for c in calls])
            m["content"] = text
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if not tools:
        return out
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = parser.format_calls([("<function-name>", "<arguments-json-object>")])
    system = ("You may call functions to help with the user's request. The functions, with their "
              f"parameters as JSON schemas:\n<tools>\n{listing}\n</tools>\n\nTo call a function, answer with "
              f"{example}")
    if out and out[0]["role"] in ("system", "developer") and isinstance(out[0].get("content"), str):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out

