"""Function calling on ``/v1/realtime``, with the chat API's machinery.

``check_tools`` turns a session's (or a response's) ``tools`` and ``tool_choice`` into
a ``epd.api.tools.ToolPlan``: each function's ``parameters`` checked by the grammar
engine, ``required`` or a named function forcing a valid call through the same grammar
as the chat API's. ``CallStream`` cuts the model's output into the message's text and
``function_call`` output items as it streams, with the chat API's tool-call parser
(``epd.api.streaming.ToolCallStream``), and sends OpenAI's events for each call:
``response.output_item.added``, ``response.function_call_arguments.delta`` (argument
fragments), ``response.function_call_arguments.done`` (``name``, whole ``arguments``),
``response.output_item.done``, plus ``conversation.item.added`` / ``.done`` for a
response in the conversation.  A call cut short (``max_output_tokens``) ends with status
``incomplete`` and no ``arguments.done``: there is nothing whole to run.

Realtime tools are flat (``{"type": "function", "name", "description", "parameters"}``)
where the chat API's nest under ``function``; ``tool_choice`` is ``"auto"``, ``"none"``,
``"required"`` or ``{"type": "function", "name": ...}``.

Source: OpenAI's Realtime API reference (``session.tools``, ``tool_choice``, the
``function_call`` / ``function_call_output`` items and the
``response.function_call_arguments.*`` events).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from epd.api.protocol import BadRequest, FunctionDefinition, Tool
from epd.api.realtime.conversation import Item
from epd.api.realtime.protocol import ClientError, new_id
from epd.api.streaming import ToolCallStream
from epd.api.tools import ToolPlan, plan_tools

__all__ = ["SessionTools", "check_tools", "CallStream"]

MAX_TOOLS = 128


@dataclass(frozen=True, slots=True)
class SessionTools:
    """Tools as the client gave them (``tools``: OpenAI's flat realtime shape, echoed in
    ``session.updated``; ``choice``: the ``tool_choice`` given) and their ``plan`` (None
    without tools)."""

    tools: list[dict]
    choice: str | dict
    plan: ToolPlan | None


NO_TOOLS = SessionTools([], "auto", None)


def check_tools(tools: list | None, tool_choice, param: str, parser_name: str, check) -> SessionTools:
    """The ``SessionTools`` of realtime ``tools`` / ``tool_choice`` (``param``: ``session``
    or ``response``, for the error's field); ``check``: ``ConstraintChecker.checked``
    (blocking: run it in the CPU pool).

    Raises:
        ClientError: a tool that is not a function, a bad name or ``parameters`` schema,
            two tools of one name, a ``tool_choice`` naming no tool (``param`` names the field).
    """
    tools = list(tools or [])
    if len(tools) > MAX_TOOLS:
        raise ClientError(f"at most {MAX_TOOLS} tools, got {len(tools)}", f"{param}.tools")
    parsed: list[Tool] = []
    for i, raw in enumerate(tools):
        where = f"{param}.tools.{i}"
        if not isinstance(raw, dict) or raw.get("type", "function") != "function":
            kind = raw.get("type") if isinstance(raw, dict) else type(raw).__name__
            raise ClientError(f"tool {i} is of type {kind!r}; epd's realtime API calls functions only "
                              "({\"type\": \"function\", \"name\", \"description\", \"parameters\"})", where,
                              "unsupported_tool_type")
        try:
            fn = FunctionDefinition.model_validate({k: raw[k] for k in ("name", "description", "parameters")
                                                    if raw.get(k) is not None})
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err.get("loc", ())) or "name"
            raise ClientError(f"invalid tool {i}: {field}: {err.get('msg')} (a name is 1..64 of A-Z a-z 0-9 _ -)",
                              f"{where}.{field}") from None
        parsed.append(Tool(type="function", function=fn))
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ClientError("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                              "\"name\": ...}", f"{param}.tool_choice")
        name, named = choice["name"], True
    elif choice in ("auto", "none", "required"):
        name, named = choice, False
    else:
        raise ClientError(f"tool_choice {choice!r} is not 'auto', 'none', 'required' or a function",
                          f"{param}.tool_choice")
    try:
        plan = plan_tools(parsed, name, named, True, parser_name, check, param=f"{param}.tools",
                          choice_param=f"{param}.tool_choice", parameters_param=f"{param}.tools.{{i}}.parameters")
    except BadRequest as e:
        raise ClientError(str(e), e.param) from None
    return SessionTools(tools, choice, plan)


class CallStream:
    """One response's output cut into message text and ``function_call`` items as it streams.

    ``stream``: the ``ResponseStream`` (its ``session`` sends events and inserts items;
    ``resp``: the response, whose ``outputs`` the calls join, in output order).
    """

    def __init__(self, plan: ToolPlan, stream) -> None:
        self.parser = ToolCallStream(plan)
        self.stream = stream
        self.items: list[Item] = []  # one per call, by parser index
        self.indexes: list[int] = []  # each call's output_index
        self.finished = 0  # calls whose done events went out

    def feed(self, text: str, done: bool) -> str:
        """The content of the output's next ``text`` (the rest are calls: their events go out)."""
        content, entries = self.parser.delta(text, done)
        for e in entries:
            if "id" in e:
                self._open(e["id"], e["function"]["name"])
            fragment = e["function"]["arguments"]
            if fragment:
                item = self.items[e["index"]]
                item.arguments = (item.arguments or "") + fragment
                self._emit("response.function_call_arguments.delta", e["index"], delta=fragment)
        whole = len(self.parser.parser.frozen) if not done else len(self.items)
        for i in range(self.finished, min(whole, len(self.items))):
            self._close(i, complete=not (done and self.parser.cut and i >= len(self.parser.parser.frozen)))
        self.finished = max(self.finished, min(whole, len(self.items)))
        return content

    def cancel(self) -> None:
        """The response was cancelled: each call still open ends ``incomplete``."""
        for i in range(self.finished, len(self.items)):
            self._close(i, complete=False)
        self.finished = len(self.items)

    def _open(self, call_id: str, name: str) -> None:
        s, resp = self.stream.session, self.stream.resp
        item = Item(new_id("item"), "assistant", [], "in_progress", type="function_call", call_id=call_id,
                    name=name, arguments="")
        self.items.append(item)
        self.indexes.append(len(resp.outputs))
        resp.outputs.append(item)
        if resp.in_conversation:
            s.emit_item_added(item, s.insert(item, None))
        s.emit("response.output_item.added", response_id=resp.id, output_index=self.indexes[-1], item=item.to_json())

    def _emit(self, kind: str, i: int, **fields) -> None:
        item = self.items[i]
        self.stream.session.emit(kind, response_id=self.stream.resp.id, item_id=item.id, output_index=self.indexes[i],
                                 call_id=item.call_id, **fields)

    def _close(self, i: int, complete: bool) -> None:
        s, resp, item = self.stream.session, self.stream.resp, self.items[i]
        item.status = "completed" if complete else "incomplete"
        if complete:
            self._emit("response.function_call_arguments.done", i, name=item.name, arguments=item.arguments or "")
        s.emit("response.output_item.done", response_id=resp.id, output_index=self.indexes[i], item=item.to_json())
        if resp.in_conversation:
            s.emit("conversation.item.done", item=item.to_json())
