"""A request's token sequence as the scheduler and block manager see it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

import torch

from epd.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True, slots=True)
class MultiModalPlaceholder:
    """One media item's span in the prompt.

    ``offset``: index of its first placeholder token; ``length``: number of
    placeholder tokens (= embedding rows); ``item_hash``: full hex digest of the
    item (sha256 of the decoded, preprocessed input); it is mixed into the hash of
    every KV block the span touches, so the same text with a different image never
    shares KV.
    """

    offset: int
    length: int
    item_hash: str


def placeholder_keys(placeholders, block_index: int, block_size: int) -> tuple[str, ...]:
    """Item hashes of the ``placeholders`` (anything with ``offset``, ``length``,
    ``item_hash``: ``MultiModalPlaceholder`` or the wire ``Placeholder``) whose
    span overlaps tokens [block_index * block_size, (block_index + 1) * block_size)."""
    if not placeholders:
        return ()
    start, end = block_index * block_size, (block_index + 1) * block_size
    return tuple(p.item_hash for p in placeholders if p.offset < end and p.offset + p.length > start)


_seq_counter = itertools.count()


class Sequence:
    """Prompt + generated tokens of one request, and its place in the KV cache.

    ``num_computed_tokens``: leading tokens whose K/V is in the cache (from the
    prefix cache or computed). ``block_table``: KV block ids, one per
    ``block_size`` tokens. After preemption (recompute) the whole
    ``token_ids`` (prompt + output so far) is prefilled again.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, eos_token_ids: frozenset[int] = frozenset(),
                 mm_placeholders: list[MultiModalPlaceholder] | None = None,
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
        # One TokenLogprobs per sampled output token when params.logprobs is set.
        self.output_logprobs: list = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_extra_keys(self, block_index: int, block_size: int) -> tuple[str, ...]:
        """Media item hashes whose placeholder span overlaps block ``block_index``."""
        return placeholder_keys(self.mm_placeholders, block_index, block_size)
