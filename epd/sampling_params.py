"""Per-request sampling parameters, in vLLM's shape."""

from __future__ import annotations

import math

import msgspec

from epd.structured_outputs import StructuredOutputs

# Temperatures below this are greedy (dividing logits by them overflows); as in vLLM.
_SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """How to pick each output token and when to stop.

    One type in-process and on the wire (a msgspec Struct, as in vLLM): the API
    builds it, the router and workers receive it as is inside ``ReserveKV``,
    ``PrefillRequest`` and ``GenerateRequest``. ``__post_init__`` validates and
    normalizes; msgspec also runs it on decode, so a message carrying an
    out-of-range value fails to decode (``epd.messages.MessageError``). Copy
    with changes through ``msgspec.structs.replace(params, ...)``, which
    validates again. Workers ignore the stop strings (the API process
    detokenizes).

    Args:
        temperature: 0 (anything below 1e-5) means greedy (argmax); > 0 scales
            logits before sampling.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability
            mass reaches ``top_p`` (1.0 = off).
        top_k: keep the ``top_k`` most likely tokens (0 or -1 = off).
        seed: per-request seed; the same seed, prompt and parameters give the same
            tokens whatever else is in the batch.
        presence_penalty / frequency_penalty: OpenAI semantics, applied to logits of
            tokens already generated (``logit -= presence * (count > 0) + frequency * count``).
        max_tokens: maximum number of generated tokens (>= 1).
        stop: strings that end generation; the matched string is cut from the text
            unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating after the model's end-of-sequence token.
        skip_special_tokens: drop special tokens from the detokenized text.
        logprobs: None = off; k >= 0 returns, per generated token, its log-probability
            and the k most likely tokens' (0..20), from the model's raw distribution
            (log_softmax of the logits, before penalties, temperature, top-k/top-p), as
            vLLM returns them by default.
        num_prior_output_tokens: the last N prompt tokens are this request's own
            earlier output (a request resumed on another engine after streaming N
            tokens: the router's migration, ``epd.router.recovery``). The penalties
            count them as output, a seeded generator resumes after their N draws, and
            ``max_tokens`` counts only the tokens generated after them. 0 for a new
            request; the API never sets it.
        structured_outputs: the constraint every sampled token obeys (a JSON schema,
            regex, choice or grammar; ``epd.structured_outputs``), or None. Prefill and
            decode workers each mask with it; a resumed request's matcher is advanced
            past its prior output.

    Raises:
        ValueError: on out-of-range values (the message names the field); on
            decode from the wire, ``msgspec.ValidationError`` (``MessageError``
            from ``epd.messages.decode``).

    Source: vLLM ``SamplingParams``; penalties follow the OpenAI API reference.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    num_prior_output_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if (isinstance(self.num_prior_output_tokens, bool) or not isinstance(self.num_prior_output_tokens, int)
                or self.num_prior_output_tokens < 0):
            raise ValueError(f"num_prior_output_tokens must be an integer >= 0, got {self.num_prior_output_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.top_k == -1:
            self.top_k = 0
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
