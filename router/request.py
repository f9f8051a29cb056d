"""What the router's callers hand it and get back, and where each open request stands.

``RouterRequest`` is one request as the API built it; ``TokenEvent`` is what the
router streams back; ``RequestError`` is how a request fails (with an HTTP
status, and whether another instance might succeed).

``RequestState`` is the stage a request is in, as the router sees it from the
messages it sends and receives (see ``docs/architecture.md``):

- ``encode``: its media items are with an encode worker (``EncodeRequest`` sent,
  ``EncodeDone`` not yet back); transcriptions (``Router.transcribe``) too.
- ``prefill``: from the first message to the engine that computes its prompt
  until that engine is done with the prompt. Disaggregated: the decode worker
  reserving the KV blocks (``ReserveKV``), then the prefill worker's queue and
  forward with its KV writes into those blocks, until ``PrefillDone``. The writes
  overlap the forward layer by layer and the router sees one reply for both, so
  they count as prefill. Aggregated (and a decode worker recomputing a prompt
  whose KV transfer failed): ``GenerateRequest`` until the first token.
- ``transfer`` (disaggregated only): from ``PrefillDone`` (the prefill worker's
  KV writes are complete and its ``KVReady`` notification is on its way) until
  the decode worker streams its first token: the KV handed over to the decode
  worker (notification, unpacking a staged transfer, joining its batch).
- ``decode``: tokens are streaming from the engine that decodes it.
- ``done`` / ``cancelled`` (the client left, or its task was cancelled) /
  ``failed`` (a non-retryable error, or retries exhausted): the outcome. The
  request leaves the state map as it enters one of these.

A retried or migrated request keeps its state across attempts (keyed by the
client's request id, not the attempt's wire id) and re-enters the stages of
its next attempt. ``RequestStates`` keeps the map and exports it as the gauge
``epd_router_requests{pool="router", instance="router", state=...}`` (requests
open in the router per live state); outcomes are totalled in ``outcomes``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from epd.messages import TokenLogprob
from epd.multimodal import MediaItem, Placeholder
from epd.sampling_params import SamplingParams


class RequestState(enum.Enum):
    ENCODE = "encode"
    SPEECH = "speech"  # a phrase being synthesized in the tts pool
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


#: the states a request is in while it is open (the gauge's ``state`` label values)
LIVE_STATES = (RequestState.ENCODE, RequestState.SPEECH, RequestState.PREFILL, RequestState.TRANSFER,
               RequestState.DECODE)
#: the outcomes; a request entering one leaves the state map
OUTCOMES = (RequestState.DONE, RequestState.CANCELLED, RequestState.FAILED)


class RequestError(RuntimeError):
    """A request failed in a pool; ``retryable`` when another instance might succeed.

    ``instance``: the worker that failed, when one did; ``kind``: "dead" (no
    heartbeat), "timeout" (stage deadline), "kv_transfer", or "" (a worker's error).
    """

    def __init__(self, message: str, *, status: int = 500, retryable: bool = False, instance: str | None = None,
                 kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.instance = instance
        self.kind = kind


@dataclass(slots=True)
class RouterRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    items: list[MediaItem] = field(default_factory=list)
    placeholders: list[Placeholder] = field(default_factory=list)


@dataclass(slots=True)
class TokenEvent:
    """New token ids of a request; the last event has ``finished`` set."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    # First event of a disaggregated request: the prefill worker's PrefillDone
    # (kv_bytes, kv_transfer_s, kv_exposed_s, prefill_s, queue_s, num_transfer_requests).
    prefill_stats: dict | None = None
    # One TokenLogprob per id in token_ids when the request asked for logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)


class RequestStates:
    """The live state of every open request (client request id -> ``RequestState``),
    mirrored in the ``router_requests`` gauge of ``metrics()`` (``epd.metrics``).

    ``enter`` moves a request into a live state; ``finish`` records its outcome
    and forgets it, so finished requests never stay in ``states``.
    """

    def __init__(self, metrics: Callable[[], object]) -> None:
        self._metrics = metrics
        self.states: dict[str, RequestState] = {}
        self.outcomes: dict[str, int] = {s.value: 0 for s in OUTCOMES}

    def _gauge(self, state: RequestState):
        return self._metrics().router_requests.labels(pool="router", instance="router", state=state.value)

    def enter(self, key: str, state: RequestState) -> None:
        """``key`` is now in the live ``state``."""
        old = self.states.get(key)
        if old is state:
            return
        if old is not None:
            self._gauge(old).dec()
        self.states[key] = state
        self._gauge(state).inc()

    def finish(self, key: str, outcome: RequestState) -> None:
        """``key`` ended with ``outcome`` (done, cancelled or failed): count it, forget it."""
        old = self.states.pop(key, None)
        if old is not None:
            self._gauge(old).dec()
        self.outcomes[outcome.value] += 1
