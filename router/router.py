"""The router: request state machine over the E, P and D pools, token streaming back to the API.

One asyncio task per request walks encode -> prefill -> transfer -> decode ->
done (or cancelled / failed). Replies from workers arrive on one PULL socket
and are dispatched to the request's queue. Every wait has a deadline. A
cancelled request (client gone) sends ``Abort`` to every worker it touched,
so each frees its blocks and buffers whatever stage it was in.

Failure recovery. Every wait also watches the workers the stage depends on:
a worker that misses heartbeats for ``heartbeat_timeout_s`` (or that the
launcher reports dead) fails the stage at once, not at its deadline. A failed
*attempt* is retried, up to ``max_retries`` times, on other instances: an
encode or prefill worker that died, hung or failed a transfer -> the whole
pipeline again elsewhere; a decode worker that died mid-stream -> **migration**:
the prompt plus every token streamed so far is prefilled on another instance
and decoding continues, so the client receives one whole answer. Each attempt
has its own wire request id (``<id>``, ``<id>@1``, ...): late messages of an
abandoned attempt (a frozen worker waking up) go nowhere, and its workers get
``Abort``. A failed KV transfer is retried through prefill again
(``kv_failure_policy="retry"``) or recomputed on the decode worker itself
(``"recompute"``, text-only requests). With no live instance in a pool a
request fails at once with HTTP 503. Greedy requests are token-identical
across a migration; a seeded sampled request continues with a fresh generator.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from epd.encoders.processor import MediaItem
from epd.messages import (Abort, EmbeddingRef, EncodeDone, EncodeItem, EncodeRequest, GenerateRequest, Heartbeat,
                          KVReserved, MessageError, PeerInfo, Placeholder, PrefillDone, PrefillRequest, RequestFailed,
                          ReserveKV, Shutdown, StatsRequest, TensorBlob, TokenLogprob, TokenOutput, WireSamplingParams,
                          WorkerReady, WorkerStats, decode)
from epd.messages import KVEvents
from epd.router.kv_index import KVIndex
from epd.router.policies import NoInstanceError, RoutingPolicy, build_policy
from epd.router.registry import PoolRegistry, WorkerHandle
from epd.sequence import MultiModalPlaceholder

logger = logging.getLogger(__name__)


class RequestState(enum.Enum):
    ENCODE = "encode"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


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


KV_FAILURE_POLICIES = ("retry", "recompute")


@dataclass(slots=True)
class RouterRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    items: list[MediaItem] = field(default_factory=list)
    placeholders: list[MultiModalPlaceholder] = field(default_factory=list)


@dataclass(slots=True)
class _Flight:
    """One client request across its attempts (retries, migrations)."""

    req: RouterRequest
    attempt: int = 0
    tokens: list[int] = field(default_factory=list)  # streamed to the client so far
    avoid: set[str] = field(default_factory=set)  # instances that failed this request
    recompute: bool = False  # next attempt: prefill on the decode worker (KV transfer failed)
    num_cached_tokens: int | None = None

    def attempt_request(self, wire_id: str) -> RouterRequest:
        """The request this attempt runs: prompt + tokens so far, the remaining budget."""
        req, n = self.req, len(self.tokens)
        params = req.params
        if n:
            params = msgspec.structs.replace(params, max_tokens=params.max_tokens - n)
        return RouterRequest(wire_id, req.prompt_token_ids + self.tokens, params, req.items, req.placeholders)


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


class Router:
    """Binds a PULL socket (``endpoint``) that workers report to.

    Args:
        host: address to bind (loopback by default).
        stage_timeout_s: deadline for each stage reply (encode, reserve, prefill).
        token_timeout_s: deadline between two tokens while decoding.
        heartbeat_timeout_s: a worker silent this long is dead.
        max_retries: further attempts of a request after a retryable failure
            (dead, hung or failing worker; failed KV transfer); 0 disables recovery.
        kv_failure_policy: "retry" (prefill again, on another prefill instance when
            there is one) or "recompute" (the decode worker prefills the prompt itself).
        encode_routing / prefill_routing / decode_routing: routing policy per pool
            (``epd.router.policies.POLICIES``; None: the pool's default, media-affinity /
            kv / free-kv); the aggregated ``pd`` pool follows ``prefill_routing``.
        kv_overlap_weight: weight of the blocks still to prefill in the kv policy's cost.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, stage_timeout_s: float = 120.0,
                 token_timeout_s: float = 120.0, heartbeat_timeout_s: float = 2.0, max_retries: int = 2,
                 kv_failure_policy: str = "retry", encode_routing: str | None = None,
                 prefill_routing: str | None = None, decode_routing: str | None = None,
                 kv_overlap_weight: float = 1.0) -> None:
        if kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(f"kv_failure_policy must be one of {KV_FAILURE_POLICIES}, got {kv_failure_policy!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 100000)
        if port:
            self.pull.bind(f"tcp://{host}:{port}")
        else:
            port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.registry = PoolRegistry(self.ctx, heartbeat_timeout_s)
        self.kv_index = KVIndex()  # prefix caches of the prefill / pd instances, from their KVEvents
        self.policies: dict[str, RoutingPolicy] = {
            role: build_policy(role, name, self.kv_index, kv_overlap_weight)
            for role, name in (("encode", encode_routing), ("prefill", prefill_routing), ("pd", prefill_routing),
                               ("decode", decode_routing))}
        self.stage_timeout_s = stage_timeout_s
        self.token_timeout_s = token_timeout_s
        self.max_retries = max_retries
        self.kv_failure_policy = kv_failure_policy
        self.liveness_poll_s = min(0.25, heartbeat_timeout_s / 4)
        self._dead_seen: set[int] = set()  # id() of handles already counted as failed
        self._metrics = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.states: dict[str, RequestState] = {}
        self.touched: dict[str, set[str]] = {}
        self._stats_waiters: dict[int, tuple[asyncio.Future, dict, int]] = {}
        self._tokens = itertools.count()
        self._task: asyncio.Task | None = None
        self.ready_event = asyncio.Event()
        self.state_counts: dict[str, int] = {s.value: 0 for s in RequestState}

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._receive_loop())
        self._watch_task = asyncio.create_task(self._watch_loop())

    @property
    def metrics(self):
        if self._metrics is None:
            from epd.metrics import get_metrics

            self._metrics = get_metrics()
        return self._metrics

    def _count(self, name: str, role: str, instance: str) -> None:
        getattr(self.metrics, name).labels(pool=role, instance=instance).inc()

    async def _watch_loop(self) -> None:
        """Log and count each worker the moment it is found dead (silent past the
        heartbeat timeout, or reported by the launcher)."""
        while True:
            await asyncio.sleep(self.liveness_poll_s)
            try:
                for w in list(self.registry.workers.values()):
                    if id(w) not in self._dead_seen and not self.registry.is_alive(w):
                        self._dead_seen.add(id(w))
                        logger.warning("%s worker %s is dead (no heartbeat for %.1f s)", w.role, w.instance_id,
                                       self.registry.heartbeat_timeout_s)
                        self._count("worker_failures", w.role, w.instance_id)
            except Exception:  # never let bookkeeping stop the watcher
                logger.exception("router watch loop")

    def mark_dead(self, instance_id: str) -> None:
        """The launcher saw this worker's process exit: stop routing to it now,
        and fail the stages waiting on it (they retry elsewhere)."""
        self.registry.mark_dead(instance_id)

    async def stop(self, shutdown_workers: bool = True) -> None:
        if shutdown_workers:
            for w in list(self.registry.workers.values()):
                try:
                    w.send(Shutdown())
                except zmq.ZMQError:
                    pass
        for task in (self._task, getattr(self, "_watch_task", None)):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self.registry.close()
        self.pull.close(0)
        self.ctx.term()

    async def wait_ready(self, expected: dict[str, int], timeout_s: float, on_poll=None) -> None:
        """Wait until ``expected[role]`` instances of every role are alive.

        ``on_poll()`` runs every 0.2 s (the launcher checks for dead children).
        Raises TimeoutError naming what is missing.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.registry.counts()
            if all(counts.get(role, 0) >= n for role, n in expected.items()):
                return
            if on_poll is not None:
                on_poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {timeout_s:.0f} s: have {counts}, need {expected}")
            await asyncio.sleep(0.2)

    def pools_alive(self) -> dict[str, int]:
        return self.registry.counts()

    # ---- inbound ------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            data = await self.pull.recv()
            try:
                msg = decode(data)
            except MessageError as e:
                logger.warning("router dropped a malformed message: %s", e)
                continue
            try:
                self._dispatch(msg)
            except Exception:  # a bug handling one message must not stop routing
                logger.exception("router failed to handle %s", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Heartbeat):
            self.registry.heartbeat(msg)
        elif isinstance(msg, WorkerReady):
            self._on_ready(msg)
        elif isinstance(msg, KVEvents):
            w = self.registry.get(msg.instance_id)
            self.kv_index.apply(msg, w.info.pid if w is not None else None,
                                w.info.kv_layout.num_blocks if w is not None and w.info.kv_layout else None)
        elif isinstance(msg, WorkerStats):
            waiter = self._stats_waiters.get(msg.token)
            if waiter is not None:
                fut, acc, n = waiter
                acc[msg.instance_id] = msg.stats
                if len(acc) >= n and not fut.done():
                    fut.set_result(acc)
        else:
            rid = getattr(msg, "request_id", None)
            inst = getattr(msg, "instance_id", None)
            if inst:
                self.registry.seen(inst)
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(msg)

    def _on_ready(self, info: WorkerReady) -> None:
        handle = self.registry.add(info)
        logger.info("worker %s (%s) ready in %.1f s", info.instance_id, info.role, info.startup_s)
        peer = PeerInfo(info.instance_id, info.nixl_metadata, list(info.regions), info.kv_layout)
        # Prefill / aggregated workers read from encoders and write to decoders.
        if info.role in ("encode", "decode"):
            for w in self.registry.workers.values():
                if w.role in ("prefill", "pd") and w is not handle:
                    w.send(peer)
        if info.role in ("prefill", "pd"):
            for w in self.registry.workers.values():
                if w.role in ("encode", "decode"):
                    handle.send(PeerInfo(w.instance_id, w.info.nixl_metadata, list(w.info.regions),
                                         w.info.kv_layout))

    # ---- requests -------------------------------------------------------------------
    def _pick(self, role: str, req: RouterRequest | None = None, avoid: set[str] | frozenset = frozenset()) -> WorkerHandle:
        """A live instance of ``role`` for ``req``, preferring instances not in ``avoid``
        (those that already failed this request). Raises RequestError (503) when the
        pool has no live instance."""
        alive = self.registry.alive(role)
        candidates = [w for w in alive if w.instance_id not in avoid] or alive
        policy = self.policies[role]
        try:
            w = policy.select(candidates, req)
        except NoInstanceError:
            raise RequestError(f"no live {role} instance: the {role} pool is down", status=503) from None
        self.metrics.routing_decisions.labels(pool=role, instance=w.instance_id, policy=policy.name).inc()
        return w

    def has_pool(self, role: str) -> bool:
        return any(w.role == role for w in self.registry.workers.values())

    async def _expect(self, rid: str, types: tuple, timeout_s: float, stage: str, stash: list | None = None,
                      watch: tuple[WorkerHandle, ...] = ()):
        """Next message of ``types`` for ``rid``. With ``stash``, TokenOutputs that
        overtake it (D may stream before P's PrefillDone arrives) are kept there.

        Raises RequestError: a worker's RequestFailed; the deadline passed
        (``kind="timeout"``); or a worker in ``watch`` died (``kind="dead"``,
        noticed within ``liveness_poll_s`` of its heartbeat timeout).
        """
        q = self.queues[rid]
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                who = watch[0].instance_id if watch else None
                raise RequestError(f"{stage} timed out after {timeout_s:.0f} s" + (f" on {who}" if who else ""),
                                   status=504, retryable=True, instance=who, kind="timeout")
            try:
                msg = await asyncio.wait_for(q.get(), min(remaining, self.liveness_poll_s) if watch else remaining)
            except asyncio.TimeoutError:
                for w in watch:
                    if not self.registry.is_alive(w):
                        raise RequestError(
                            f"{stage}: {w.role} worker {w.instance_id} died (no heartbeat for "
                            f"{self.registry.heartbeat_timeout_s:.1f} s)", status=503, retryable=True,
                            instance=w.instance_id, kind="dead") from None
                continue
            if stash is not None and isinstance(msg, TokenOutput):
                stash.append(msg)
                continue
            break
        if isinstance(msg, RequestFailed):
            raise RequestError(f"{stage} failed on {msg.instance_id}: {msg.error}",
                               status=503 if msg.retryable else 400, retryable=msg.retryable,
                               instance=msg.instance_id, kind=msg.kind)
        if not isinstance(msg, types):
            raise RequestError(f"unexpected {type(msg).__name__} during {stage}")
        return msg

    def _set_state(self, rid: str, state: RequestState) -> None:
        self.states[rid] = state

    async def _encode(self, req: RouterRequest, avoid: set[str] | frozenset = frozenset()
                      ) -> tuple[str | None, list[EmbeddingRef], list[str]]:
        if not req.items:
            return None, [], []
        rid = req.request_id
        self._set_state(rid, RequestState.ENCODE)
        e = self._pick("encode", req, avoid)
        self.touched[rid].add(e.instance_id)
        items = [EncodeItem(it.item_hash, it.modality, {k: TensorBlob.from_tensor(t) for k, t in it.data.items()},
                            it.num_tokens) for it in req.items]
        e.inflight += 1
        try:
            e.send(EncodeRequest(rid, items))
            done = await self._expect(rid, (EncodeDone,), self.stage_timeout_s, "encode", watch=(e,))
        finally:
            e.inflight -= 1
        return e.instance_id, list(done.embeddings), list(done.transcripts)

    async def transcribe(self, request_id: str, items: list[MediaItem]) -> list[str]:
        """Speech-to-text through the E pool (text-only LMs); retried on another
        encoder when one dies or fails (up to ``max_retries``)."""
        avoid: set[str] = set()
        for attempt in itertools.count():
            wire = request_id if attempt == 0 else f"{request_id}@{attempt}"
            self.queues[wire] = asyncio.Queue()
            self.touched[wire] = set()
            ok = False
            try:
                _, _, texts = await self._encode(RouterRequest(wire, [], WireSamplingParams(), items), avoid)
                ok = True
                return texts
            except RequestError as e:
                if not e.retryable or attempt >= self.max_retries:
                    raise
                self._note_retry(e, migrated=False)
                if e.instance:
                    avoid.add(e.instance)
            finally:
                if not ok:
                    self._abort_everywhere(wire)
                self._forget(wire)
        raise AssertionError("unreachable")

    async def generate(self, req: RouterRequest) -> AsyncIterator[TokenEvent]:
        """Run ``req`` through the pools, yielding tokens as they come.

        A retryable failure (dead/hung worker, failed KV transfer) restarts the
        request on other instances, migrating it when tokens were already
        streamed (see the module docstring); the client's stream just goes on.
        Raises RequestError (with an HTTP status) when a stage fails for good.
        Closing the iterator early (client gone) aborts the request everywhere.
        """
        flight = _Flight(req)
        outcome = RequestState.CANCELLED
        try:
            while True:
                wire = req.request_id if flight.attempt == 0 else f"{req.request_id}@{flight.attempt}"
                self.queues[wire] = asyncio.Queue()
                self.touched[wire] = set()
                try:
                    async for ev in self._attempt(flight, wire):
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
                    if not e.retryable or flight.attempt >= self.max_retries:
                        outcome = RequestState.FAILED
                        raise
                    self._note_retry(e, migrated=bool(flight.tokens))
                    if e.instance:
                        flight.avoid.add(e.instance)
                    if e.kind == "kv_transfer":  # either end of the link may be at fault: prefer others for both
                        flight.avoid.update(i for i in self.touched.get(wire, ())
                                            if (w := self.registry.get(i)) is not None and w.role == "decode")
                    flight.recompute = (e.kind == "kv_transfer" and self.kv_failure_policy == "recompute"
                                        and not req.items)
                finally:
                    if outcome is not RequestState.DONE:
                        self._abort_everywhere(wire)
                    self._forget(wire)
                flight.attempt += 1
        finally:
            self.state_counts[outcome.value] += 1

    def _note_retry(self, e: RequestError, migrated: bool) -> None:
        w = self.registry.get(e.instance) if e.instance else None
        role, inst = (w.role, w.instance_id) if w is not None else ("router", e.instance or "router")
        logger.warning("%s after: %s", "migrating a request" if migrated else "retrying a request", e)
        if migrated and role in ("decode", "pd"):
            self._count("migrated_requests", role, inst)
        else:
            self._count("request_retries", role, inst)
        if e.kind == "kv_transfer":
            self._count("kv_transfer_retries", role, inst)

    async def _attempt(self, flight: _Flight, wire: str) -> AsyncIterator[TokenEvent]:
        """One try of a request through the pools under wire id ``wire``."""
        req = flight.attempt_request(wire)
        e_id, refs, _ = await self._encode(req, flight.avoid)
        placeholders = [Placeholder(p.offset, p.length, p.item_hash) for p in req.placeholders]
        if flight.recompute:
            gen = self._generate_aggregated(req, None, [], [], flight.avoid, role="decode")
        elif self.has_pool("pd"):
            gen = self._generate_aggregated(req, e_id, refs, placeholders, flight.avoid)
        else:
            gen = self._generate_disaggregated(req, e_id, refs, placeholders, flight.avoid)
        async for ev in gen:
            yield ev

    async def _generate_aggregated(self, req, e_id, refs, placeholders, avoid=frozenset(),
                                   role: str = "pd") -> AsyncIterator[TokenEvent]:
        """The whole request on one engine: a ``pd`` worker, or (``role="decode"``)
        a decode worker recomputing a prompt whose KV transfer failed."""
        rid = req.request_id
        w = self._pick(role, req, avoid)
        self.touched[rid].add(w.instance_id)
        self._set_state(rid, RequestState.PREFILL)
        w.inflight += 1
        try:
            w.send(GenerateRequest(rid, req.prompt_token_ids, req.params, placeholders, e_id, refs))
            async for ev in self._stream(rid, first_timeout_s=self.stage_timeout_s, watch=(w,)):
                yield ev
        finally:
            w.inflight -= 1

    async def _generate_disaggregated(self, req, e_id, refs, placeholders, avoid=frozenset()
                                      ) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        d = self._pick("decode", req, avoid)
        self.touched[rid].add(d.instance_id)
        d.inflight += 1
        try:
            self._set_state(rid, RequestState.PREFILL)
            d.send(ReserveKV(rid, req.prompt_token_ids, req.params))
            reserved = await self._expect(rid, (KVReserved,), self.stage_timeout_s, "KV reservation", watch=(d,))
            p = self._pick("prefill", req, avoid)
            self.touched[rid].add(p.instance_id)
            p.inflight += 1
            try:
                p.send(PrefillRequest(rid, req.prompt_token_ids, req.params, d.instance_id,
                                      list(reserved.block_ids), placeholders, e_id, refs,
                                      decode_staging_block=reserved.staging_block))
                early: list[TokenOutput] = []
                done = await self._expect(rid, (PrefillDone,), self.stage_timeout_s, "prefill", stash=early,
                                          watch=(p, d))
            finally:
                p.inflight -= 1
            self._set_state(rid, RequestState.DECODE)
            for msg in reversed(early):  # put the overtaking tokens back in front, in order
                self._requeue_front(rid, msg)
            stats = {k: getattr(done, k) for k in ("kv_bytes", "kv_transfer_s", "kv_exposed_s", "kv_write_s",
                                                   "prefill_s", "queue_s", "num_transfer_requests")}
            yield TokenEvent([done.first_token], False, None, done.num_cached_tokens, stats,
                             [done.first_logprob] if done.first_logprob is not None else [])
            async for ev in self._stream(rid, first_timeout_s=self.token_timeout_s,
                                         num_cached_tokens=done.num_cached_tokens, watch=(d,)):
                yield ev
        finally:
            d.inflight -= 1

    async def _stream(self, rid: str, first_timeout_s: float, num_cached_tokens: int = 0,
                      watch: tuple[WorkerHandle, ...] = ()) -> AsyncIterator[TokenEvent]:
        timeout = first_timeout_s
        while True:
            msg = await self._expect(rid, (TokenOutput,), timeout, "decode", watch=watch)
            timeout = self.token_timeout_s
            self._set_state(rid, RequestState.DECODE)
            yield TokenEvent(list(msg.token_ids), msg.finished, msg.finish_reason,
                             msg.num_cached_tokens or num_cached_tokens, None, list(msg.logprobs))
            if msg.finished:
                return

    def _requeue_front(self, rid: str, msg) -> None:
        q = self.queues[rid]
        items = [msg]
        while not q.empty():
            items.append(q.get_nowait())
        for it in items:
            q.put_nowait(it)

    def _abort_everywhere(self, rid: str) -> None:
        for inst in self.touched.get(rid, ()):
            w = self.registry.get(inst)
            if w is not None:
                try:
                    w.send(Abort(rid))
                except zmq.ZMQError:
                    pass

    def _forget(self, rid: str) -> None:
        self.queues.pop(rid, None)
        self.touched.pop(rid, None)
        self.states.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        self._abort_everywhere(request_id)

    async def worker_stats(self, timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
        """Each live worker's stats (free blocks, running, held buffers ...), by instance.

        A worker busy in a long step (or frozen) answers late: after ``timeout_s``
        the answers so far are returned, and each silent instance maps to
        ``{"unresponsive": 1}``."""
        workers = self.registry.alive()
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[token] = (fut, {}, len(workers))
        try:
            for w in workers:
                w.send(StatsRequest(token))
            if not workers:
                return {}
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            except asyncio.TimeoutError:
                acc = dict(self._stats_waiters[token][1])
                for w in workers:
                    acc.setdefault(w.instance_id, {"unresponsive": 1})
                return acc
        finally:
            self._stats_waiters.pop(token, None)
