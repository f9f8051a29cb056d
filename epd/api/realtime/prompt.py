"""``/v1/realtime`` prompts: a response's conversation items rendered through the model's
chat template into a router request (``ConversationPrompt``), dropping the oldest items
that do not fit the context. The protocol is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import uuid

from epd.api.chat_prompt import LiteralText, flatten, template_takes_parts
from epd.api.constraints import ConstraintChecker
from epd.api.cpu_pool import CpuPool, shared_pool
from epd.api.protocol import BadRequest
from epd.api.realtime.conversation import Item, ResponseState
from epd.api.realtime.protocol import ClientError
from epd.api.tool_parsers import PARSERS, detect_parser
from epd.api.tools import ToolPlan, apply_template, parse_arguments, template_renders_tools
from epd.encoders.processor import AUDIO_PLACEHOLDER, MultiModalProcessor, ProcessedPrompt
from epd.router.router import RouterRequest
from epd.sampling_params import SamplingParams

#: one conversation item as a prompt: its chat message (None: left out) and its audio clips
_Turn = tuple[dict | None, list]


class ConversationPrompt:
    """Renders conversation items through the model's chat template into a router request.

    ``cpu``: the pool the render, tokenization and audio features run in, off the event
    loop (default: the process's, ``shared_pool``); ``tool_parser``: the format the model
    writes tool calls in (``epd.api.tool_parsers.PARSERS``; None: detected from the chat
    template); ``vocab_size``: the model's logits width, for the grammar engine that
    checks tools (default: the tokenizer's length).
    """

    def __init__(self, tokenizer, processor: MultiModalProcessor, max_model_len: int,
                 cpu: CpuPool | None = None, tool_parser: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.tokenizer, self.processor, self.max_model_len = tokenizer, processor, max_model_len
        self.cpu = cpu or shared_pool()
        self.tool_parser = PARSERS[tool_parser or detect_parser(getattr(tokenizer, "chat_template", None))]
        self.native_tools = template_renders_tools(tokenizer)
        self.vocab_size = vocab_size
        self._constraints: ConstraintChecker | None = None
        self.embed_audio = processor.modalities.get("audio") == "embed"
        self.audio_tok = (tokenizer.convert_ids_to_tokens(processor.placeholder_ids["audio"])
                          if self.embed_audio else AUDIO_PLACEHOLDER)
        self.structured = template_takes_parts(tokenizer, None, self.audio_tok if self.embed_audio else None)
        self.literal = LiteralText(tokenizer, processor.placeholder_ids)  # typed special tokens stay text

    @property
    def constraints(self) -> ConstraintChecker:
        """The grammar engine's checker of tools and forced calls (built on first use)."""
        if self._constraints is None:
            self._constraints = ConstraintChecker(self.tokenizer, self.vocab_size or len(self.tokenizer))
        return self._constraints

    async def messages(self, items: list[Item], instructions: str | None) -> tuple[list[dict], list[_Turn]]:
        """The system message of ``instructions`` (none without), and per item its chat
        message (None: an answer cancelled before its first word) and audio clips, in
        order; transcripts awaited. A ``function_call`` joins the assistant message
        before it as a ``tool_calls`` entry (or makes one); a ``function_call_output`` is a
        ``tool`` message."""
        escape = self.literal.escape
        head: list[dict] = [{"role": "system", "content": escape(instructions)}] if instructions else []
        turns: list[_Turn] = []
        for it in items:
            if it.type == "function_call":
                call = {"id": it.call_id, "type": "function",
                        "function": {"name": it.name, "arguments": parse_arguments(it.arguments or "{}")}}
                call = self.literal.escape_value(call)
                prev = turns[-1][0] if turns else None
                if prev is not None and prev["role"] == "assistant":
                    prev.setdefault("tool_calls", []).append(call)
                else:
                    turns.append(({"role": "assistant", "content": "", "tool_calls": [call]}, []))
                continue
            if it.type == "function_call_output":
                turns.append(({"role": "tool", "tool_call_id": it.call_id, "content": escape(it.output or "")}, []))
                continue
            parts, audios = [], []
            for p in it.parts:
                if p.type != "input_audio":
                    parts.append({"type": "text", "text": escape(p.text or "")})
                elif self.embed_audio:
                    audios.append((p.pcm, p.rate))
                    parts.append({"type": "audio"})
                else:
                    text = await asyncio.shield(p.asr) if p.asr is not None else (p.transcript or "")
                    parts.append({"type": "text", "text": escape(text)})
            skip = it.role == "assistant" and not any(p.get("text") for p in parts)
            turns.append((None if skip else {"role": it.role, "content": flatten(parts, None, self.audio_tok,
                                                                                 self.structured)}, audios))
        return head, turns

    async def build_request(self, resp: ResponseState) -> tuple[RouterRequest, int]:
        """The router request of a response and its number of audio placeholder tokens.

        Keeps the newest items whose prompt plus ``max_output_tokens`` (at least one
        token) fits ``max_model_len`` (the oldest are dropped); the prompt is rendered in
        the CPU pool, at most ``2 + ceil(log2(len(items)))`` times (``_fit``).

        Raises:
            ClientError: nothing to answer, or the newest item alone is too long.
            InvalidRequestError / MediaError: from the processor.
            CapacityError: the CPU pool is full.
        """
        head, turns = await self.messages(list(resp.items), resp.instructions)
        plan: ToolPlan | None = resp.tools
        processed = await self.cpu.run(self._fit, head, turns, resp.max_output_tokens, plan)
        constraint = None
        if plan is not None:
            try:
                constraint = await self.cpu.run(plan.constraint, self.constraints.checked)
            except BadRequest as e:
                raise ClientError(str(e), e.param) from None
        n = len(processed.prompt_token_ids)
        max_tokens = self.max_model_len - n if resp.max_output_tokens == "inf" else resp.max_output_tokens
        sp = SamplingParams(temperature=resp.temperature, max_tokens=max_tokens, structured_outputs=constraint)
        req = RouterRequest(f"{resp.id}-{uuid.uuid4().hex[:6]}", processed.prompt_token_ids,
                            sp, processed.items, processed.placeholders)
        audio_tokens = sum(p.length for p, it in zip(processed.placeholders, processed.items)
                           if it.modality == "audio")
        return req, audio_tokens

    def _render(self, head: list[dict], turns: list[_Turn], k: int, plan: ToolPlan | None = None) -> list[int]:
        """Token ids of the chat template over ``head``, the messages of ``turns[k:]`` and
        the tools of ``plan``."""
        msgs = head + [m for m, _ in turns[k:] if m is not None]
        try:
            text = apply_template(self.tokenizer, msgs, plan, self.native_tools, self.tool_parser,
                                  self.literal.escape_value)
        except Exception as e:  # jinja raises for conversations the template rejects
            raise ClientError(f"the model's chat template rejected the conversation: {e}") from None
        return self.literal.encode(text)

    def _process(self, ids: list[int], turns: list[_Turn], k: int) -> ProcessedPrompt:
        """The processor's prompt of ``ids``, the render of ``turns[k:]``, with their clips."""
        audios = [a for _, clips in turns[k:] for a in clips]
        return self.processor.process(ids, {"audio": audios} if audios else None)

    def _fit(self, head: list[dict], turns: list[_Turn], max_output_tokens: int | str,
             plan: ToolPlan | None = None) -> ProcessedPrompt:
        """The prompt of the newest turns, as many as leave ``max_output_tokens`` (at least
        one token) of ``max_model_len``; runs in the CPU pool.

        The same prompt as dropping the oldest turn and re-rendering until it fits, since
        dropping turns only shortens a prompt, but the first turn kept is found by
        bisection: ``2 + ceil(log2(len(turns)))`` renders at most (one when everything
        fits), and each clip's features are computed at most twice.

        Raises:
            ClientError: the template rejects the messages, or the newest turn alone is too long.
        """
        limit = self.max_model_len - (1 if max_output_tokens == "inf" else max_output_tokens)
        full = self._process(self._render(head, turns, 0, plan), turns, 0)
        n = len(full.prompt_token_ids)
        if n <= limit:
            return full
        # extra[k]: the tokens the clips of turns[k:] add past their placeholder token (full.items: the clips, in order)
        extra = [0] * (len(turns) + 1)
        clip_tokens = reversed([it.num_tokens - 1 for it in full.items])
        for k in range(len(turns) - 1, -1, -1):
            extra[k] = extra[k + 1] + sum(next(clip_tokens) for _ in turns[k][1])
        ids: dict[int, list[int]] = {}

        def size(k: int) -> int:
            ids[k] = self._render(head, turns, k, plan)
            return len(ids[k]) + extra[k]

        lo, hi = 0, len(turns) - 1  # turns[lo:] is too long; turns[hi:] is the last candidate
        if hi > 0:
            n = size(hi)
        if n > limit:
            raise ClientError(f"the newest item alone makes a {n}-token prompt; with max_output_tokens "
                              f"{max_output_tokens} it does not fit max_model_len {self.max_model_len}", None,
                              "context_length_exceeded")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if size(mid) <= limit:
                hi = mid
            else:
                lo = mid
        return self._process(ids[hi], turns, hi)
