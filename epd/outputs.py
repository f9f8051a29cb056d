"""What the engine returns for a request (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """One generated token's log-probability (natural log, fp32, from the model's raw
    log_softmax) and the ``len(top_ids)`` most likely alternatives, best first."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence.

    ``token_ids`` are all generated ids (a matched stop token id included);
    ``text`` is their detokenized text with any matched stop string cut;
    ``finish_reason`` is None while running, else "stop" (EOS, stop token or stop
    string), "length" (max_tokens or max_model_len) or "abort".
    ``logprobs`` (when the request asked for them): one ``TokenLogprobs`` per id
    in ``token_ids``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step, or its final result.

    ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    ``num_new_tokens``: how many of the completion's tokens this step added.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    #: tokens this step added to ``outputs[0].token_ids`` (several with speculative decoding)
    num_new_tokens: int = 1
