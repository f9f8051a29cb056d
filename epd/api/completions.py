"""Chat and completions requests: OpenAI bodies -> router requests -> responses.

``CompletionService.handle`` checks a body (model, limits, unsupported fields),
renders the prompt, builds one router request per choice and answers through
``epd.api.streaming``. ``ApiState`` holds what the API changes while it serves.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable

import msgspec
from fastapi import Request
from fastapi.responses import Response

from epd.api.chat_prompt import ChatPromptRenderer
from epd.api.constraints import ConstraintChecker, requested_constraint
from epd.api.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    check_body,
    error_response,
    too_many_requests,
)
from epd.api.streaming import Choice, CompletionResponder, RequestTimer
from epd.api.tools import ToolPlan, tool_plan
from epd.detokenizer import IncrementalDetokenizer
from epd.encoders.media_limits import MediaError
from epd.encoders.processor import MultiModalProcessor, ProcessedPrompt
from epd.errors import CapacityError, InvalidRequestError
from epd.router.router import RequestError, RouterRequest
from epd.sampling_params import SamplingParams
from epd.structured_outputs import StructuredOutputs


class ApiState:
    """The API's mutable state: the requests in flight (streams included) and the
    counter that makes request ids unique; ``created``: the start time /v1/models reports."""

    def __init__(self) -> None:
        self.pending = 0
        self.created = int(time.time())
        self._ids = itertools.count()

    def request_id(self, chat: bool) -> str:
        """A fresh ``chatcmpl-...`` / ``cmpl-...`` id."""
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:20]}{next(self._ids)}"

    def admit(self, limit: int) -> Callable[[], None] | None:
        """Count one more request in flight, or None when ``limit`` are already; the
        callable returned ends it (calling it again does nothing)."""
        if self.pending >= limit:
            return None
        self.pending += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.pending -= 1

        return release


class CompletionService:
    """Serves ``POST /v1/chat/completions`` and ``POST /v1/completions`` for one model.

    ``settings`` is the API's ``ApiSettings``; ``metrics`` (``epd.metrics.Metrics`` or
    None) records per-request latencies; token-id prompts must lie in ``[0, vocab_size)``.
    ``max_model_len``: the longest prompt + output served; ``live_max_model_len()``, when
    given, says it now (no more than ``max_model_len``: the smallest the live workers
    report, ``Router.max_model_len``), and each request is checked against that.
    """

    def __init__(self, tokenizer, processor: MultiModalProcessor, renderer: ChatPromptRenderer,
                 responder: CompletionResponder, state: ApiState, *, settings, model_name: str,
                 max_model_len: int, vocab_size: int, metrics=None,
                 live_max_model_len: Callable[[], int] | None = None) -> None:
        self.tokenizer, self.processor = tokenizer, processor
        self.renderer, self.responder, self.state = renderer, responder, state
        self.settings, self.model_name, self.max_model_len = settings, model_name, max_model_len
        self.live_max_model_len = live_max_model_len or (lambda: max_model_len)
        self.vocab_size, self.metrics = vocab_size, metrics
        self.constraints = ConstraintChecker(tokenizer, vocab_size)
        self.constraints.warm_up()

    async def handle(self, request: Request, body: SamplingFields, chat: bool) -> Response:
        """The response to one request; every refusal is OpenAI's error body."""
        settings = self.settings
        timer = RequestTimer(self.metrics)
        try:
            check_body(body)
        except BadRequest as e:
            return error_response(e.status, str(e), e.param)
        if body.model not in (None, self.model_name, *settings.model_aliases):
            return error_response(404, f"the model {body.model!r} does not exist; this server serves "
                                       f"{self.model_name!r}", "model", "model_not_found")
        release = self.state.admit(settings.max_pending_requests)
        if release is None:
            return too_many_requests(settings.max_pending_requests)
        try:
            self.check_unsupported(body)
            plan, constraint = await self.renderer.cpu.run(self.constraint, body, chat)
            if chat:
                prompt, mm = await self.renderer.render(body, f"asr-{uuid.uuid4().hex}", plan)
            else:
                prompt, mm = body.prompt, {}
            batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
            rid, choices = await self.prepare(body, list(prompt) if batch else [prompt], mm, chat, constraint)
            if plan is not None and plan.parses:
                for c in choices:
                    c.parse_tools(plan)
            return await self.responder.respond(request, body, rid, choices, chat, timer, release)
        except BadRequest as e:
            release()
            return error_response(e.status, str(e), e.param)
        except (InvalidRequestError, MediaError) as e:
            release()
            return error_response(400, str(e), getattr(e, "param", None))
        except RequestError as e:
            release()
            return error_response(e.status if e.status in (400, 429, 503, 504) else 500, str(e))
        except CapacityError as e:  # the API's CPU pool is full
            release()
            return error_response(503, str(e))
        except BaseException:
            release()
            raise

    @staticmethod
    def check_unsupported(body: SamplingFields) -> None:
        """Fields epd cannot honour get a 400 rather than being silently ignored."""
        if body.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        if isinstance(body.stop, list) and len(body.stop) > 4:
            raise BadRequest(f"stop takes at most 4 sequences, got {len(body.stop)}", "stop")
        if isinstance(body, CompletionRequest):
            if body.echo:
                raise BadRequest("echo is not supported", "echo")
            if body.suffix:
                raise BadRequest("suffix is not supported", "suffix")
            if body.best_of is not None and body.best_of != (body.n or 1):
                raise BadRequest("best_of other than n is not supported", "best_of")

    def constraint(self, body: SamplingFields, chat: bool) -> tuple[ToolPlan | None, StructuredOutputs | None]:
        """The chat request's tool plan, and the output constraint of ``response_format`` /
        ``structured_outputs`` or of a forced tool call, each checked against the model's
        tokenizer (runs in the CPU pool: a large schema takes a while).

        Raises:
            BadRequest: two constraints at once, or one that cannot be followed (``param`` names it).
        """
        check = self.constraints.checked
        plan = tool_plan(body, self.renderer.tool_parser.name, check) if chat else None
        forced = plan.constraint(check) if plan is not None else None
        asked = requested_constraint(body)
        if forced is not None and asked is not None:
            raise BadRequest(f"tool_choice {plan.choice!r} forces a tool call; it cannot be combined with "
                             f"{asked[1].split('.')[0]}", "tool_choice")
        return plan, (check(*asked) if asked is not None else forced)

    def sampling(self, body: SamplingFields, prompt_len: int, logprobs: int | None,
                 constraint: StructuredOutputs | None = None) -> tuple[SamplingParams, list[str]]:
        """The request's sampling parameters and stop strings; ``max_tokens`` defaults
        to the context left (capped by ``settings.default_max_tokens``)."""
        settings, max_model_len = self.settings, self.live_max_model_len()
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if prompt_len >= max_model_len:
            raise BadRequest(f"the prompt has {prompt_len} tokens but max_model_len is {max_model_len}",
                             "messages" if isinstance(body, ChatRequest) else "prompt")
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
            if settings.default_max_tokens is not None:
                max_tokens = min(settings.default_max_tokens, max_tokens)
        elif prompt_len + max_tokens > max_model_len:
            raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                             f"({max_model_len})", "max_tokens")
        if (body.n or 1) > settings.max_n:
            raise BadRequest(f"n is {body.n}; this server allows at most {settings.max_n}", "n")
        stop = body.stop
        if isinstance(stop, list) and len(stop) > 16:
            raise BadRequest("at most 16 stop strings are allowed", "stop")
        kw = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
              if getattr(body, k) is not None}
        try:
            sp = SamplingParams(**kw, seed=body.seed, max_tokens=max_tokens, stop=stop,
                                ignore_eos=bool(body.ignore_eos), logprobs=logprobs,
                                structured_outputs=constraint)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return sp, list(sp.stop)

    async def prepare(self, body: SamplingFields, prompts: list, mm: dict, chat: bool,
                      constraint: StructuredOutputs | None = None) -> tuple[str, list[Choice]]:
        """The request id and one ``Choice`` per (prompt, sample): index ``p * n + i``."""
        rid = self.state.request_id(chat)
        max_n = self.settings.max_n
        if len(prompts) * (body.n or 1) > max_n:
            raise BadRequest(f"{len(prompts)} prompt(s) x n={body.n or 1} choices; this server allows at most "
                             f"{max_n} per request", "prompt" if len(prompts) > 1 else "n")
        choices: list[Choice] = []
        for p, prompt in enumerate(prompts):
            choices += await self.prepare_one(body, prompt, mm, chat, rid, p, constraint)
        return rid, choices

    def tokens(self, prompt: str | list[int], mm: dict, chat: bool) -> ProcessedPrompt:
        """Prompt ``prompt`` (text, or token ids) with media ``mm`` as the processor's
        prompt (in the CPU pool: tokenization and media decoding are CPU work).

        Raises:
            BadRequest: a token id outside the vocabulary, or an empty prompt.
            InvalidRequestError / MediaError: from the processor.
        """
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
            ids_ = prompt
        else:
            literal = self.renderer.literal  # a text prompt carries no media: placeholder strings in it are text
            ids_ = literal.encode(literal.escape_placeholders(prompt), add_special_tokens=not chat)
        if not ids_:
            raise BadRequest("the prompt is empty", "prompt")
        return self.processor.process(ids_, mm)

    async def prepare_one(self, body: SamplingFields, prompt: str | list[int], mm: dict, chat: bool, rid: str,
                          p: int, constraint: StructuredOutputs | None = None) -> list[Choice]:
        """The ``n`` choices of prompt ``p`` (text, or token ids)."""
        processed = await self.renderer.cpu.run(self.tokens, prompt, mm, chat)
        if isinstance(body, ChatRequest):
            if body.top_logprobs is not None and not body.logprobs:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        sp, stop = self.sampling(body, len(processed.prompt_token_ids), logprobs, constraint)
        choices = []
        n = body.n or 1
        for i in range(n):
            seed = None if sp.seed is None else (sp.seed + i) % 2**63  # n > 1: distinct, reproducible draws
            wire = msgspec.structs.replace(sp, seed=seed)
            req = RouterRequest(f"{rid}-{p * n + i}", processed.prompt_token_ids, wire, processed.items,
                                processed.placeholders)
            choice = Choice(p * n + i, req, IncrementalDetokenizer(self.tokenizer, processed.prompt_token_ids,
                                                                   stop=stop))
            choice.counts_prompt = i == 0
            choices.append(choice)
        return choices
