"""A request's token sequence as the scheduler and block manager see it."""

from __future__ import annotations

import enum
import itertools
import time

import numpy as np
import torch

from epd.block_hash import placeholder_keys
from epd.multimodal import Placeholder
from epd.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """``WAITING_FOR_REMOTE_KV``: blocks are allocated and another instance is
    writing the prompt's KV into them (decode side of a KV transfer, vLLM v1's
    ``WAITING_FOR_REMOTE_KVS``); the scheduler never schedules it until the KV
    connector reports the KV complete."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_seq_counter = itertools.count()


class Sequence:
    """Prompt + generated tokens of one request, and its place in the KV cache.

    ``num_computed_tokens``: leading tokens whose K/V is in the cache (from the
    prefix cache or computed). ``block_table``: KV block ids, one per
    ``block_size`` tokens. After preemption (recompute) the whole
    ``token_ids`` (prompt + output so far) is prefilled again.

    A resumed request (``params.num_prior_output_tokens`` = N > 0, e.g. migrated
    after streaming N tokens) has its earlier output as the last N prompt tokens:
    they are prefilled like the prompt, but ``all_output_token_ids`` (what the
    penalties count) includes them; ``output_token_ids`` / ``num_output_tokens``
    (what this engine generated, what ``max_tokens`` limits) do not. The engine
    advances a seeded ``generator`` past their N draws
    (``epd.layers.sampler.skip_draws``).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, eos_token_ids: frozenset[int] = frozenset(),
                 mm_placeholders: list[Placeholder] | None = None,
                 mm_embeddings: list[torch.Tensor] | None = None) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.mm_placeholders = list(mm_placeholders or [])
        # One [length, hidden] tensor per placeholder, kept until the sequence
        # finishes (a preempted sequence needs them again for recompute).
        self.mm_embeddings = list(mm_embeddings or [])
        if len(self.mm_embeddings) != len(self.mm_placeholders) or any(
                e.shape[0] != p.length for e, p in zip(self.mm_embeddings, self.mm_placeholders)):
            raise ValueError("mm_embeddings must give one [length, hidden] tensor per placeholder")
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first schedule; -1 = not yet
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        # The matcher of a constrained request (``epd.engine.grammar.Grammar``), set by the engine.
        self.grammar = None
        # draft tokens for the next step (speculative decoding, epd.engine.spec_decode); not in token_ids
        self.spec_tokens: list[int] = []
        # One TokenLogprobs per sampled output token when params.logprobs is set.
        self.output_logprobs: list = []
        self._mrope: tuple | None = None  # (positions [3, P] int64 numpy, delta), computed on first use

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def all_output_token_ids(self) -> list[int]:
        """The request's whole output: the prior output at the end of the prompt
        (``params.num_prior_output_tokens``), then what this engine generated."""
        return self.token_ids[self.num_prompt_tokens - self.params.num_prior_output_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def mrope(self) -> tuple | None:
        """M-RoPE positions of the request (Qwen2-VL / Qwen2.5-VL media, whose placeholders
        carry grids): (``positions`` [3, P] int64 numpy over the original prompt's P tokens,
        ``delta``); every later token (a resumed request's prior output, then each decoded
        token) is at index + delta in all three rows. None: positions are the token indices.
        Source: ``epd.models.mrope.prompt_mrope_positions``."""
        if self._mrope is None and any(p.grid_thw is not None for p in self.mm_placeholders):
            from epd.models.mrope import prompt_mrope_positions

            # The original prompt (a resumed request's prior output was decoded at index + delta;
            # with transformers 5.24's rule that equals continuing its text, so either works).
            prompt_len = self.num_prompt_tokens - self.params.num_prior_output_tokens
            positions, delta = prompt_mrope_positions(prompt_len, self.mm_placeholders)
            self._mrope = (positions.numpy(), delta)
        return self._mrope

    def mrope_positions(self, start: int, count: int) -> np.ndarray:
        """[3, count] int64 positions of tokens start .. start + count - 1 (see :meth:`mrope`)."""
        idx = np.arange(start, start + count, dtype=np.int64)
        table = self.mrope()
        if table is None:
            return np.broadcast_to(idx, (3, count))
        positions, delta = table
        out = np.broadcast_to(idx + delta, (3, count)).copy()
        inside = idx < positions.shape[1]
        out[:, inside] = positions[:, idx[inside]]
        return out

    def block_extra_keys(self, block_index: int, block_size: int) -> tuple[str, ...]:
        """Media item hashes whose placeholder span overlaps block ``block_index``."""
        return placeholder_keys(self.mm_placeholders, block_index, block_size)
