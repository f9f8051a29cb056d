"""The HTTP API's wire shapes: OpenAI's request bodies and error objects.

Request bodies follow OpenAI's API reference (chat completions, completions) as the
official ``openai`` SDK sends them; unknown fields are ignored. Types are strict, as
OpenAI's are: ``"max_tokens": "16"``, ``"stream": "yes"`` or ``"temperature": true`` are
400s naming the field (an integer is still a valid number: ``"temperature": 1``). vLLM's OpenAI server
is the model for the extras (``top_k``, ``ignore_eos``, ``structured_outputs``). Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from epd.sampling_params import MAX_LOGPROBS


# ---- request bodies (OpenAI's shapes) -----------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_Body):
    url: str
    detail: str | None = None


class VideoURL(_Body):
    url: str


class InputAudio(_Body):
    data: str
    format: Literal["wav", "mp3"]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoPart(_Body):
    """``{"type": "video_url", "video_url": {"url": ...}}`` (vLLM's and SGLang's extension)."""

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]


class VideoIOKwargs(_Body):
    """How a request's videos are sampled: ``fps`` (frames per second of video; default
    ``--video-fps``) and ``num_frames`` (at most this many per video; at most, and by
    default, ``--max-video-frames``)."""

    fps: float | None = Field(None, gt=0.0, le=1000.0, allow_inf_nan=False)
    num_frames: int | None = Field(None, ge=1)


class MediaIOKwargs(_Body):
    """vLLM's ``media_io_kwargs`` request field; only ``video`` is read."""

    video: VideoIOKwargs | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """An assistant message's earlier tool call (``messages[i].tool_calls[j]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = Field(None, validate_default=True)  # tool: the call it answers

    @field_validator("tool_call_id")
    @classmethod
    def _tool_result_names_its_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        return v


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this one."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` extension (sent through the SDK's ``extra_body``):
    exactly one of a JSON schema, a regex, a choice of strings, a grammar (Lark or GBNF)
    or ``json_object``."""

    json_schema: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """The fields chat and completions requests share (sampling, streaming, ``n``)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    n: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    ignore_eos: bool | None = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt, a list of token ids, or a batch of either
    (choice ``p * n + i`` is the i-th sample of prompt p)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    media_io_kwargs: MediaIOKwargs | None = None


#: deepest nesting of lists and objects a request may hold (a JSON schema in
#: ``response_format`` or ``tools`` included); walked without recursion
MAX_NESTING_DEPTH = 64


def check_body(body: BaseModel) -> None:
    """Refuse what no field type catches: a string that cannot be UTF-8 encoded (JSON
    allows ``"\\ud800"``; no tokenizer can encode it), or lists and objects nested deeper
    than ``MAX_NESTING_DEPTH`` (a schema 300 levels deep would exhaust the recursion of
    every schema walker after it). An iterative walk over models, lists, tuples and dicts.

    Raises:
        BadRequest: ``param`` names the top-level field that holds it.
    """
    stack: list[tuple[object, int, str | None]] = [(body, 0, None)]
    while stack:
        obj, depth, field = stack.pop()
        if isinstance(obj, str):
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest("the request holds invalid Unicode (a lone UTF-16 surrogate)", field) from None
            continue
        if isinstance(obj, BaseModel):
            items = [getattr(obj, f) for f in type(obj).model_fields]
            if depth == 0:
                stack.extend((v, 1, f) for f, v in zip(type(obj).model_fields, items))
                continue
        elif isinstance(obj, (list, tuple)):
            items = obj
        elif isinstance(obj, dict):
            items = [x for kv in obj.items() for x in kv]
        else:
            continue
        if depth > MAX_NESTING_DEPTH:
            raise BadRequest(f"{field} nests lists and objects more than {MAX_NESTING_DEPTH} levels deep", field)
        stack.extend((v, depth + 1, field) for v in items)


# ---- errors -------------------------------------------------------------------------------------
_UNION_BRANCHES = ("str", "int", "float", "bool", "list", "dict")


def invalid_field(errors: list[dict]) -> tuple[str, list[str]]:
    """The message and field path (``["messages", "0", "content"]``) of the pydantic error
    that says the most: a union's deepest branch. FastAPI's ``body`` and pydantic's union
    branch names (``int``, ``list[str]``, ``literal['inf']``) are dropped from the path."""
    e = max(errors, key=lambda e: len(e.get("loc", ())))
    loc: list[str] = []
    for x in e.get("loc", ()):
        x = str(x)
        if x != "body" and "[" not in x and x not in _UNION_BRANCHES and loc[-1:] != [x]:
            loc.append(x)
    return str(e.get("msg")), loc


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error", 504: "timeout_error"}
_ERROR_CODES = {401: "invalid_api_key", 413: "request_too_large", 429: "rate_limit_exceeded",
                503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code or _ERROR_CODES.get(status)}}


#: seconds a client should wait before retrying a 429 / 503 (``Retry-After``)
RETRY_AFTER_S = 1


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """``error_body`` as a JSON response with HTTP status ``status``; capacity answers
    (429, 503) carry ``Retry-After`` (seconds)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def too_many_requests(limit: int) -> JSONResponse:
    """The 429 for a request over ``--max-pending-requests`` (``limit``)."""
    return error_response(429, f"too many requests in flight ({limit}); retry later")


class BadRequest(Exception):
    """A request the API refuses: answered with ``error_response(status, message, param)``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status
