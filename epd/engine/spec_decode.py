"""Speculative decoding with n-gram (prompt lookup) proposals, verified in one target step.

Before a step, each running decode sequence that may speculate gets up to k draft
tokens from ``NgramProposer``: the tokens that followed the most recent earlier
occurrence of its last n tokens (prompt and output), for n from ``prompt_lookup_max``
down to ``prompt_lookup_min``. The scheduler gives such a sequence 1 + len(drafts)
tokens (``ScheduledSeq.spec``): its last token and the drafts, each a one-token decode
row of the same persistent batch row at consecutive positions (``InputBatch.build``),
so every attention path (fused CPU decode, eager, CUDA graphs) stores all rows' K/V and
then attends row i over its own context: exact causal attention, one forward. The step
yields logits at each of those positions; ``accept`` keeps the drafts while the target's
greedy token equals them and adds the target's token at the first mismatch (or after the
last draft: the bonus token). The KV of rejected drafts lies past the sequence's
computed tokens: it is never hashed into the prefix cache and is overwritten when those
positions run again.

This cut speculates for greedy requests without penalties, grammar or logprobs (others
decode one token per step), where acceptance is exact: the output equals plain greedy
decoding token for token. Sources: Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; vLLM's ``ngram`` method
(``--speculative-config '{"method": "ngram", ...}'``, ``prompt_lookup_min`` / ``_max``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from epd.sequence import Sequence

__all__ = ["NgramProposer", "SpecDecoder", "SpeculativeConfig", "accept"]

#: vLLM's default n-gram window when the config sets neither bound
DEFAULT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``method``: "ngram" (the only one this engine runs yet); ``num_speculative_tokens``:
    k, drafts per step; ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram sizes
    tried, longest first (vLLM's keys and meaning)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @classmethod
    def parse(cls, spec: dict | str | None) -> SpeculativeConfig | None:
        """From vLLM's ``--speculative-config`` (a JSON object or a dict); None for none.

        Raises:
            ValueError: not a JSON object, an unknown key, a method other than "ngram",
                or bounds that are not 1 <= min <= max and k >= 1.
        """
        if spec is None or spec == "" or spec == {}:
            return None
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {type(spec).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        if set(spec) - known:
            raise ValueError(f"--speculative-config: unknown keys {sorted(set(spec) - known)}; "
                             f"known: {sorted(known)}")
        method = spec.get("method")
        if method != "ngram":
            raise ValueError(f"--speculative-config: method {method!r} is not supported; this engine runs "
                             f"\"ngram\" (prompt lookup)")
        k = spec.get("num_speculative_tokens")
        if k is None:
            raise ValueError("--speculative-config: num_speculative_tokens is required (drafts per step, e.g. 4)")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (k, lo, hi)):
            raise ValueError("--speculative-config: num_speculative_tokens, prompt_lookup_min and "
                             "prompt_lookup_max must be integers")
        if k < 1 or not 1 <= lo <= hi:
            raise ValueError(f"--speculative-config: needs num_speculative_tokens >= 1 and 1 <= prompt_lookup_min "
                             f"<= prompt_lookup_max, got {k}, {lo}, {hi}")
        return cls(method, k, lo, hi)


class NgramProposer:
    """Prompt lookup: the tokens after the most recent earlier occurrence of a sequence's
    last n tokens, n from ``n_max`` down to ``n_min`` (the longest match wins)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` ([n] int), [] when no n-gram recurs."""
        total = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a greedy verification emits: ``targets`` (the target's greedy token at
    each of the 1 + len(drafts) positions) up to and including the first one that differs
    from its draft, or all of them (the last is the bonus token)."""
    out: list[int] = []
    for i, t in enumerate(targets):
        out.append(t)
        if i == len(drafts) or t != drafts[i]:
            break
    return out


class SpecDecoder:
    """The engine's speculation: proposes drafts before a step and counts what was
    accepted (``stats``: vLLM's ``num_drafts``, ``num_draft_tokens``,
    ``num_accepted_tokens`` and accepted tokens per draft position)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether ``seq`` may speculate: greedy, no penalties, grammar or logprobs (their
        state per position is not kept for drafts yet), and decoding (its prompt done)."""
        p = seq.params
        return (p.greedy and not p.presence_penalty and not p.frequency_penalty and seq.grammar is None
                and p.logprobs is None and seq.num_output_tokens >= 1
                and seq.num_tokens - seq.num_computed_tokens == 1)

    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_tokens`` of every running sequence: drafts for the next step, at most
        what its ``max_tokens`` and the model length leave after one more token."""
        k = self.config.num_speculative_tokens
        for seq in running:
            seq.spec_tokens = []
            if not self.eligible(seq):
                continue
            cap = min(k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if cap > 0:
                seq.spec_tokens = self.proposer.propose(np.asarray(seq.token_ids, dtype=np.int64), cap)

    def record(self, drafts: list[int], emitted: list[int]) -> None:
        """Count one verification of ``drafts`` that emitted ``emitted`` (``accept``: the
        accepted drafts and one target token)."""
        accepted = len(emitted) - 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def stats(self) -> dict[str, float]:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                **{f"spec_num_accepted_tokens_pos{i}": n for i, n in enumerate(self.accepted_per_pos)}}
