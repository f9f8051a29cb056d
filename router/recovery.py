"""Failure recovery: which failures are retried, where, and how a stream survives them.

A stage fails with a ``RequestError``; a *retryable* one (a worker that died,
missed its deadline, reported a retryable error, or a failed KV transfer) makes
the request run again as a new *attempt*, up to ``max_retries`` times, on other
instances (those that failed it are avoided while others are alive):

- an encode or prefill worker that died, hung or failed a transfer -> the whole
  pipeline again elsewhere;
- a decode worker that died mid-stream -> **migration**: the prompt plus every
  token streamed so far is prefilled on another instance and decoding goes on
  with the remaining ``max_tokens``, so the client receives one whole answer.
  The new attempt's ``SamplingParams.num_prior_output_tokens`` says how many
  trailing prompt tokens are that earlier output: the engines count them as
  output for the penalties and resume a seeded generator after their draws, so
  greedy and seeded sampled requests are token-identical across a migration;
- a failed KV transfer -> ``kv_failure_policy``: "retry" prefills again (either
  end of the link may be at fault, so the decode instances of the failed
  attempt are avoided too), "recompute" has the decode worker prefill the
  prompt itself (text-only requests).

Each attempt has its own wire request id (``<id>``, ``<id>@1``, ...): late
messages of an abandoned attempt (a frozen worker waking up) go nowhere, and
its workers get ``Abort``. A non-retryable error, or the last retry's, reaches
the caller. Retries and migrations are counted (``epd_request_retries_total``,
``epd_migrated_requests_total``, ``epd_kv_transfer_retries_total``) under the
pool and instance that failed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from epd.launch.config import KV_FAILURE_POLICIES
from epd.multimodal import MediaItem
from epd.roles import Role
from epd.router.pipeline import Pipeline
from epd.router.request import RequestError, RequestState, RouterRequest, TokenEvent
from epd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


#: attempts of one request at most, drain moves included
MAX_ATTEMPTS = 64


def check_policy(max_retries: int, kv_failure_policy: str) -> None:
    """Raise ValueError for a bad ``max_retries`` or ``kv_failure_policy``."""
    if kv_failure_policy not in KV_FAILURE_POLICIES:
        raise ValueError(f"kv_failure_policy must be one of {KV_FAILURE_POLICIES}, got {kv_failure_policy!r}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")


def wire_id(request_id: str, attempt: int) -> str:
    """The request id attempt ``attempt`` runs under: ``<id>``, then ``<id>@1``, ..."""
    return request_id if attempt == 0 else f"{request_id}@{attempt}"


@dataclass(slots=True)
class _Flight:
    """One client request across its attempts (retries, migrations)."""

    req: RouterRequest
    attempt: int = 0
    tokens: list[int] = field(default_factory=list)  # streamed to the client so far
    avoid: set[str] = field(default_factory=set)  # instances that failed this request
    recompute: bool = False  # next attempt: prefill on the decode worker (KV transfer failed)
    num_cached_tokens: int | None = None

    def attempt_request(self, wire: str) -> RouterRequest:
        """The request this attempt runs: prompt + tokens so far (marked as prior output,
        so penalties and a seeded generator go on where they were), the remaining budget."""
        req, n = self.req, len(self.tokens)
        params = req.params
        if n:
            params = msgspec.structs.replace(params, max_tokens=params.max_tokens - n,
                                             num_prior_output_tokens=params.num_prior_output_tokens + n)
        return RouterRequest(wire, req.prompt_token_ids + self.tokens, params, req.items, req.placeholders)


class Recovery:
    """Drives a request's attempts through ``pipeline``, retrying per the policy above.

    ``count(metric, pool, instance)`` increments a counter of ``epd.metrics``.
    """

    def __init__(self, pipeline: Pipeline, count: Callable[[str, str, str], None], *, max_retries: int,
                 kv_failure_policy: str) -> None:
        check_policy(max_retries, kv_failure_policy)
        self.pipeline = pipeline
        self.registry = pipeline.registry
        self._count = count
        self.max_retries = max_retries
        self.kv_failure_policy = kv_failure_policy

    def _give_up(self, e: RequestError, attempt: int) -> bool:
        """``e`` ends the request: not retryable, or attempt ``attempt`` was the last. A
        move off a draining instance is planned, not a failure: it spends no retry
        (bounded: it happens only while another instance is routable)."""
        if e.kind == "drain":
            return attempt >= MAX_ATTEMPTS
        return not e.retryable or attempt >= self.max_retries

    async def transcribe(self, request_id: str, items: list[MediaItem]) -> list[str]:
        """Speech-to-text through the E pool, retried on another encoder when one
        dies or fails. Raises RequestError (500) when ``request_id`` is live (see ``Mailbox.open``)."""
        avoid: set[str] = set()
        outcome = RequestState.CANCELLED
        wire = wire_id(request_id, 0)
        self.pipeline.begin(wire, request_id)  # RequestError (500) for a live id: that state is not ours to end
        try:
            for attempt in itertools.count():
                if attempt:
                    wire = wire_id(request_id, attempt)
                    self.pipeline.begin(wire, request_id)
                try:
                    _, _, texts = await self.pipeline.encode(RouterRequest(wire, [], SamplingParams(), items),
                                                             avoid)
                    outcome = RequestState.DONE
                    return texts
                except RequestError as e:
                    if self._give_up(e, attempt):
                        outcome = RequestState.FAILED
                        raise
                    self.note_retry(e, migrated=False)
                    if e.instance:
                        avoid.add(e.instance)
                finally:
                    self.pipeline.end(wire, abort=outcome is not RequestState.DONE)
            raise AssertionError("unreachable")
        finally:
            self.pipeline.states.finish(request_id, outcome)

    async def synthesize(self, request_id: str, text: str, voice: str) -> AsyncIterator[bytes]:
        """One phrase's speech through the tts pool (see ``Router.synthesize``): a worker
        that dies or hangs is replaced by another, which speaks the phrase again; the
        bytes already yielded are skipped (the synthesizer is deterministic)."""
        avoid: set[str] = set()
        outcome = RequestState.CANCELLED
        sent = 0  # PCM bytes yielded so far
        wire = wire_id(request_id, 0)
        self.pipeline.begin(wire, request_id)
        try:
            for attempt in itertools.count():
                if attempt:
                    wire = wire_id(request_id, attempt)
                    self.pipeline.begin(wire, request_id)
                skip = sent
                try:
                    async for pcm in self.pipeline.synthesize(wire, text, voice, avoid):
                        if skip >= len(pcm):
                            skip -= len(pcm)
                            continue
                        pcm, skip = pcm[skip:], 0
                        sent += len(pcm)
                        yield pcm
                    outcome = RequestState.DONE
                    return
                except RequestError as e:
                    if self._give_up(e, attempt):
                        outcome = RequestState.FAILED
                        raise
                    self.note_retry(e, migrated=sent > 0)
                    if e.instance:
                        avoid.add(e.instance)
                finally:
                    self.pipeline.end(wire, abort=outcome is not RequestState.DONE)
        finally:
            self.pipeline.states.finish(request_id, outcome)

    async def generate(self, req: RouterRequest) -> AsyncIterator[TokenEvent]:
        """``req``'s token events across its attempts (see ``Router.generate``)."""
        flight = _Flight(req)
        outcome = RequestState.CANCELLED
        wire = wire_id(req.request_id, 0)
        self.pipeline.begin(wire, req.request_id)  # RequestError (500) for a live id: that state is not ours to end
        try:
            while True:
                try:
                    async for ev in self.pipeline.run(flight.attempt_request(wire), flight.avoid, flight.recompute):
                        if ev.token_ids:  # usage reports the prompt's own prefix hits, not a migration's
                            if flight.num_cached_tokens is None:
                                flight.num_cached_tokens = ev.num_cached_tokens
                            ev.num_cached_tokens = flight.num_cached_tokens
                        flight.tokens.extend(ev.token_ids)
                        yield ev
                        if ev.finished:
                            outcome = RequestState.DONE
                            return
                    raise RequestError("the token stream ended without a finished event")
                except RequestError as e:
                    if self._give_up(e, flight.attempt):
                        outcome = RequestState.FAILED
                        raise
                    self.note_retry(e, migrated=bool(flight.tokens))
                    self._plan_next(flight, e, wire)
                finally:
                    self.pipeline.end(wire, abort=outcome is not RequestState.DONE)
                flight.attempt += 1
                wire = wire_id(req.request_id, flight.attempt)
                self.pipeline.begin(wire, req.request_id)
        finally:
            self.pipeline.states.finish(req.request_id, outcome)

    def _plan_next(self, flight: _Flight, e: RequestError, wire: str) -> None:
        """After attempt ``wire`` failed with ``e``: which instances the next attempt
        avoids, and whether it recomputes on the decode worker."""
        if e.instance:
            flight.avoid.add(e.instance)
        if e.kind == "kv_transfer":  # either end of the link may be at fault: prefer others for both
            flight.avoid.update(i for i in self.pipeline.touched.get(wire, ())
                                if (w := self.registry.get(i)) is not None and w.role == Role.DECODE)
        flight.recompute = (e.kind == "kv_transfer" and self.kv_failure_policy == "recompute"
                            and not flight.req.items)

    def note_retry(self, e: RequestError, migrated: bool) -> None:
        """Log and count a retry (a migration when tokens were already streamed)."""
        w = self.registry.get(e.instance) if e.instance else None
        role, inst = (w.role, w.instance_id) if w is not None else ("router", e.instance or "router")
        logger.warning("%s after: %s", "migrating a request" if migrated else "retrying a request", e)
        if migrated and role in (Role.DECODE, Role.PD):
            self._count("migrated_requests", role, inst)
        else:
            self._count("request_retries", role, inst)
        if e.kind == "kv_transfer":
            self._count("kv_transfer_retries", role, inst)
