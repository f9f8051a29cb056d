"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (``max_num_batched_tokens``). Running sequences
come first (one token per decode, the next chunk of a partly prefilled
prompt), then waiting ones are admitted while budget, ``max_num_seqs`` and
free blocks allow. When a running sequence cannot get a block, the newest
running sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed later. Source: vLLM v1
``core/sched/scheduler.py`` (unified prefill/decode token budget), nano-vllm
``Scheduler``.

Stall-free batching (Sarathi-Serve, Agrawal et al., OSDI 2024): while sequences are
decoding, a step's prefill tokens (new chunks of prompts, running or admitted) are
capped at ``max_prefill_tokens_with_decodes``, so a long prompt is spread over several
steps and every decode keeps getting a token each short step, instead of waiting for
one step that prefills the whole prompt. Without decodes the whole token budget is
open to prefill (the prompt's TTFT is not held back for nothing). With
``target_step_ms`` the share is also bounded in time: the engine's step-time model
(``epd.engine.step_time``, fitted to this engine's own steps) gives the most prompt
tokens a step with this step's decodes can carry and stay under the target, and at
least one block's worth, so a prompt always progresses. Until the model has seen enough
mixed steps, only the token cap applies.

Sequences that cannot be recomputed. On a decode worker a multimodal sequence has
its media spans (``mm_placeholders``, whose item hashes key its blocks) but not
their embeddings: the encoder's buffers were read by the prefill worker and
released. Recomputing its media positions would run bare placeholder-token
embeddings through the LM (wrong tokens, silently), so:

1. the victim is the newest running sequence that *can* be recomputed (text, or
   with its embeddings);
2. a sequence that cannot get a block and finds no such victim *stalls*: it keeps
   its blocks and KV and gets no token this step (nor is anyone admitted), while
   the others run and free blocks as they finish;
3. only when a step could run nothing at all is the newest stalled sequence
   preempted (else nothing would ever free). Its full blocks stay in the prefix
   cache under hashes that include its item hashes (no other image's KV can
   match), released tail first, so the blocks of its prompt's beginning (its
   media) are evicted last;
4. it is re-admitted only if the prefix cache still holds every block up to the
   end of its last media span: then only text positions are recomputed, from
   token embeddings (exact). Otherwise it ends with finish_reason ``"error"``
   (``SchedulerOutput.failed``; with prefix caching off, always): its media KV is
   gone and cannot be rebuilt here; only a new attempt that encodes its media
   again can finish the request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from epd.engine.block_manager import BlockManager
from epd.engine.step_time import StepTimeModel, step_features
from epd.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_tokens)``.

    ``sample`` is True when the chunk reaches the end of the sequence, so the
    step's logits for its last token produce the next token. ``spec``: draft tokens
    verified in this step (speculative decoding, ``epd.engine.spec_decode``): a decode
    of ``1 + len(spec)`` tokens, its last token and the drafts, whose positions lie past
    the sequence's tokens.
    """

    seq: Sequence
    start: int
    num_tokens: int
    spec: list[int] = field(default_factory=list)

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens - len(self.spec) == self.seq.num_tokens


def can_recompute(seq: Sequence) -> bool:
    """Whether preemption by recompute can rebuild ``seq``'s KV: it has no media
    spans, or it holds their embeddings (not so on a decode worker)."""
    return len(seq.mm_embeddings) == len(seq.mm_placeholders)


def media_end(seq: Sequence) -> int:
    """Position after ``seq``'s last media placeholder token (0: none)."""
    return max((p.offset + p.length for p in seq.mm_placeholders), default=0)


@dataclass(slots=True)
class SchedulerOutput:
    """``failed``: sequences this step ended with finish_reason ``"error"`` (their
    media KV was lost; see the module docstring), already finished and freed."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Decides which tokens of which sequences run in the next step."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_tokens_with_decodes: int | None = None, *,
                 target_step_ms: float | None = None) -> None:
        """``max_prefill_tokens_with_decodes``: prefill tokens per step while any
        sequence decodes (stall-free batching, see the module docstring); None: no cap
        beyond ``max_num_batched_tokens``. ``target_step_ms``: the step-time bound on
        that share (None: none); the engine reports each step's time with ``observe``."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.target_step_ms = target_step_ms
        self.step_time = StepTimeModel()
        self._prefill_budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences in WAITING_FOR_REMOTE_KV, by request id: blocks allocated, prompt KV
        # being written by another instance (see ``add_remote`` / ``remote_kv_ready``).
        self.waiting_for_remote_kv: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_remote(self, seq: Sequence, reuse: bool = True) -> bool:
        """Allocate blocks for ``seq``'s whole prompt, whose KV another instance will
        write, and park it in ``WAITING_FOR_REMOTE_KV``. The longest prefix this
        instance's prefix cache holds heads the block table (decode-side reuse, as
        vLLM's NixlConnector counts a decode instance's local hits): only the blocks
        after it need writing; ``seq.num_cached_tokens`` says how many tokens that is
        (``reuse`` False: none, no lookup). Returns False (nothing changed) when the
        batch is full, sequences are queued, or blocks are short."""
        if len(self.running) + len(self.waiting_for_remote_kv) >= self.max_num_seqs or self.waiting:
            return False
        bm = self.block_manager
        computed = bm.get_computed_blocks(seq) if reuse else []
        if not bm.allocate_slots(seq, seq.num_tokens - len(computed) * bm.block_size, computed):
            return False
        seq.num_cached_tokens = len(computed) * bm.block_size
        if reuse:
            bm.record_prefix_lookup(seq.num_tokens, seq.num_cached_tokens)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[seq.request_id] = seq
        return True

    def remote_kv_ready(self, request_id: str) -> Sequence:
        """The prompt KV of a ``WAITING_FOR_REMOTE_KV`` sequence is in its blocks: it
        joins the running batch (its full blocks enter the prefix cache).

        Raises:
            KeyError: no such sequence waits for remote KV.
        """
        seq = self.waiting_for_remote_kv.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.block_manager.cache_full_blocks(seq)
        self.running.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._prefill_budget = self._prefill_share()
        # 1. Running sequences: decodes and unfinished chunked prefills.
        budget, stalled = self._schedule_running(out, self.max_num_batched_tokens)
        if stalled and not out.scheduled:
            # Nothing could run: the newest stalled sequence must give its blocks up
            # (rule 3 of the module docstring); the others try again.
            self._preempt(stalled[-1], out)
            budget, stalled = self._schedule_running(out, budget)
        # 2. Waiting sequences (not in a step that had to preempt or stall).
        if not out.num_preempted and not stalled:
            self._admit_waiting(out, budget)
        return out

    def _prefill_share(self) -> int:
        """This step's prompt-token budget (stall-free batching, see the module docstring)."""
        cap, target = self.max_prefill_tokens_with_decodes, self.target_step_ms
        if cap is None and target is None:
            return self.max_num_batched_tokens
        decodes, context, chunk_context = 0, 0, None
        for s in self.running:
            if s.num_tokens - s.num_computed_tokens == 1:
                decodes += 1
                context += s.num_tokens
            elif chunk_context is None:
                chunk_context = s.num_computed_tokens
        if not decodes:
            return self.max_num_batched_tokens
        share = min(cap, self.max_num_batched_tokens) if cap is not None else self.max_num_batched_tokens
        if target is not None:
            lo = min(self.block_manager.block_size, share)
            timed = self.step_time.prefill_budget(target, decodes, context, chunk_context or 0, lo, share)
            if timed is not None:
                share = timed
        return share

    def observe(self, out: SchedulerOutput, step_ms: float) -> None:
        """Feed the step-time model one step's wall time in ms (``out``: that step)."""
        if self.target_step_ms is None:
            return
        decodes = [(s.start + i) for s in out.scheduled if s.num_tokens == 1 or s.spec for i in range(s.num_tokens)]
        chunks = [(s.num_tokens, s.start + s.num_tokens) for s in out.scheduled if s.num_tokens != 1 and not s.spec]
        self.step_time.observe(step_features(len(decodes), sum(p + 1 for p in decodes), chunks), step_ms)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, list[Sequence]]:
        """Schedule the running sequences in order, preempting for blocks (rules 1-2 of
        the module docstring). Returns the budget left and the sequences that stalled."""
        stalled: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = self._share(remaining, budget)
            if num_new == 0:  # a prompt chunk past this step's prefill cap: next step
                i += 1
                continue
            spec = seq.spec_tokens[:budget - 1] if remaining == 1 else []
            if spec and self.block_manager.allocate_slots(seq, 1 + len(spec)):  # with lookahead slots
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, 1 + len(spec), spec))
                budget -= 1 + len(spec)
                i += 1
                continue
            victim = None  # (no room for drafts: a plain decode; drafts never preempt anyone)
            while not self.block_manager.allocate_slots(seq, num_new):
                # Sequences before ``i`` are already in this step: never victims.
                victim = next((s for s in reversed(self.running[i:]) if can_recompute(s)), None)
                if victim is None:
                    break
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
                budget -= num_new
                if remaining > 1:
                    self._prefill_budget -= num_new
                i += 1
                continue
            if victim is None:  # no sequence it may preempt: it waits, keeping its KV
                stalled.append(seq)
                i += 1
            # else ``seq`` preempted itself: ``running[i]`` is already the next one.
        return budget, stalled

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit queued sequences in order while budget, ``max_num_seqs`` and blocks
        allow; one whose media KV is gone fails (rule 4 of the module docstring)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            computed = self.block_manager.get_computed_blocks(seq) if seq.num_computed_tokens == 0 else []
            num_computed = len(computed) * self.block_manager.block_size
            if not can_recompute(seq) and num_computed < media_end(seq):
                self.finish(seq, "error")
                out.failed.append(seq)
                continue
            remaining = seq.num_tokens - num_computed
            num_new = self._share(remaining, budget)
            if num_new == 0:
                break
            if not self.block_manager.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_computed
            self.block_manager.record_prefix_lookup(seq.num_tokens, num_computed)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_computed, num_new))
            budget -= num_new
            if remaining > 1:
                self._prefill_budget -= num_new

    def _share(self, remaining: int, budget: int) -> int:
        """Tokens a sequence with ``remaining`` uncomputed tokens gets this step: one
        (a decode, or a prompt's last token) within ``budget``; a prompt chunk also
        within the step's prefill budget (stall-free batching)."""
        if remaining <= 1:
            return min(remaining, budget)
        return max(0, min(remaining, budget, self._prefill_budget))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.num_preempted += 1
        self.block_manager.free(seq)
        seq.spec_tokens = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Apply a step's results. ``sampled``: seq_id -> new token id, or, for a sequence
        that verified drafts (``ScheduledSeq.spec``), the tokens it emitted (the accepted
        drafts and one token of the target's): its computed tokens end after the accepted
        drafts, so the rejected drafts' KV is never hashed into the prefix cache.

        Returns the sequences that received a token this step (finished ones
        included, already removed from ``running`` and freed).
        """
        changed: list[Sequence] = []
        for s in out.scheduled:
            seq = s.seq
            if s.spec:
                emitted = sampled[seq.seq_id]
                seq.token_ids.extend(emitted)
                seq.num_computed_tokens = s.start + len(emitted)
                seq.spec_tokens = []
                self.block_manager.cache_full_blocks(seq)
                changed.append(seq)
                continue
            seq.num_computed_tokens = s.start + s.num_tokens
            self.block_manager.cache_full_blocks(seq)
            if not s.sample:
                continue
            seq.token_ids.append(sampled[seq.seq_id])
            changed.append(seq)
        return changed

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None, *, free: bool = True) -> None:
        """End ``seq`` (any state) and free its blocks (``free=False``: the caller
        frees them later with ``block_manager.free``, e.g. after sending its KV)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            self.waiting_for_remote_kv.pop(seq.request_id, None)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if free:
            self.block_manager.free(seq)
