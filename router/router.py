"""The router: request state machine over the E, P and D pools, token streaming back to the API.

One asyncio task per request walks encode -> prefill -> transfer -> decode ->
done (or cancelled / failed). Replies from workers arrive on one PULL socket
and are dispatched to the request's queue. Every wait has a deadline. A
cancelled request (client gone) sends ``Abort`` to every worker it touched,
so each frees its blocks and buffers whatever stage it was in.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from epd.encoders.processor import MediaItem
from epd.messages import (Abort, EmbeddingRef, EncodeDone, EncodeItem, EncodeRequest, GenerateRequest, Heartbeat,
                          KVReserved, MessageError, PeerInfo, Placeholder, PrefillDone, PrefillRequest, RequestFailed,
                          ReserveKV, Shutdown, StatsRequest, TensorBlob, TokenOutput, WireSamplingParams, WorkerReady,
                          WorkerStats, decode)
from epd.router.policies import NoInstanceError, least_loaded
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
    """A request failed in a pool; ``retryable`` when another instance might succeed."""

    def __init__(self, message: str, *, status: int = 500, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


@dataclass(slots=True)
class RouterRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    items: list[MediaItem] = field(default_factory=list)
    placeholders: list[MultiModalPlaceholder] = field(default_factory=list)


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


class Router:
    """Binds a PULL socket (``endpoint``) that workers report to.

    Args:
        host: address to bind (loopback by default).
        stage_timeout_s: deadline for each stage reply (encode, reserve, prefill).
        token_timeout_s: deadline between two tokens while decoding.
        heartbeat_timeout_s: a worker silent this long is dead.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, stage_timeout_s: float = 120.0,
                 token_timeout_s: float = 120.0, heartbeat_timeout_s: float = 2.0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 100000)
        if port:
            self.pull.bind(f"tcp://{host}:{port}")
        else:
            port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.registry = PoolRegistry(self.ctx, heartbeat_timeout_s)
        self.stage_timeout_s = stage_timeout_s
        self.token_timeout_s = token_timeout_s
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

    async def stop(self, shutdown_workers: bool = True) -> None:
        if shutdown_workers:
            for w in list(self.registry.workers.values()):
                try:
                    w.send(Shutdown())
                except zmq.ZMQError:
                    pass
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
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
    def _pick(self, role: str) -> WorkerHandle:
        try:
            return least_loaded(self.registry.alive(role))
        except NoInstanceError:
            raise RequestError(f"no live {role} instance: the {role} pool is down", status=503) from None

    def has_pool(self, role: str) -> bool:
        return any(w.role == role for w in self.registry.workers.values())

    async def _expect(self, rid: str, types: tuple, timeout_s: float, stage: str, stash: list | None = None):
        """Next message of ``types`` for ``rid``. With ``stash``, TokenOutputs that
        overtake it (D may stream before P's PrefillDone arrives) are kept there."""
        q = self.queues[rid]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(q.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise RequestError(f"{stage} timed out after {timeout_s:.0f} s", status=504, retryable=True) from None
            if stash is not None and isinstance(msg, TokenOutput):
                stash.append(msg)
                continue
            break
        if isinstance(msg, RequestFailed):
            raise RequestError(f"{stage} failed on {msg.instance_id}: {msg.error}",
                               status=503 if msg.retryable else 400, retryable=msg.retryable)
        if not isinstance(msg, types):
            raise RequestError(f"unexpected {type(msg).__name__} during {stage}")
        return msg

    def _set_state(self, rid: str, state: RequestState) -> None:
        self.states[rid] = state

    async def _encode(self, req: RouterRequest) -> tuple[str | None, list[EmbeddingRef], list[str]]:
        if not req.items:
            return None, [], []
        rid = req.request_id
        self._set_state(rid, RequestState.ENCODE)
        e = self._pick("encode")
        self.touched[rid].add(e.instance_id)
        items = [EncodeItem(it.item_hash, it.modality, {k: TensorBlob.from_tensor(t) for k, t in it.data.items()},
                            it.num_tokens) for it in req.items]
        e.inflight += 1
        try:
            e.send(EncodeRequest(rid, items))
            done = await self._expect(rid, (EncodeDone,), self.stage_timeout_s, "encode")
        finally:
            e.inflight -= 1
        return e.instance_id, list(done.embeddings), list(done.transcripts)

    async def transcribe(self, request_id: str, items: list[MediaItem]) -> list[str]:
        """Speech-to-text through the E pool (text-only LMs)."""
        self.queues[request_id] = asyncio.Queue()
        self.touched[request_id] = set()
        try:
            _, _, texts = await self._encode(RouterRequest(request_id, [], WireSamplingParams(), items))
            return texts
        finally:
            self._forget(request_id)

    async def generate(self, req: RouterRequest) -> AsyncIterator[TokenEvent]:
        """Run ``req`` through the pools, yielding tokens as they come.

        Raises RequestError (with an HTTP status) when a stage fails. Closing
        the iterator early (client gone) aborts the request everywhere.
        """
        rid = req.request_id
        self.queues[rid] = asyncio.Queue()
        self.touched[rid] = set()
        outcome = RequestState.CANCELLED
        try:
            e_id, refs, _ = await self._encode(req)
            placeholders = [Placeholder(p.offset, p.length, p.item_hash) for p in req.placeholders]
            if self.has_pool("pd"):
                async for ev in self._generate_aggregated(req, e_id, refs, placeholders):
                    yield ev
            else:
                async for ev in self._generate_disaggregated(req, e_id, refs, placeholders):
                    yield ev
            outcome = RequestState.DONE
        except RequestError:
            outcome = RequestState.FAILED
            raise
        finally:
            if outcome is not RequestState.DONE:
                self._abort_everywhere(rid)
            self.state_counts[outcome.value] += 1
            self._forget(rid)

    async def _generate_aggregated(self, req, e_id, refs, placeholders) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        w = self._pick("pd")
        self.touched[rid].add(w.instance_id)
        self._set_state(rid, RequestState.PREFILL)
        w.inflight += 1
        try:
            w.send(GenerateRequest(rid, req.prompt_token_ids, req.params, placeholders, e_id, refs))
            async for ev in self._stream(rid, first_timeout_s=self.stage_timeout_s):
                yield ev
        finally:
            w.inflight -= 1

    async def _generate_disaggregated(self, req, e_id, refs, placeholders) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        d = self._pick("decode")
        self.touched[rid].add(d.instance_id)
        d.inflight += 1
        try:
            self._set_state(rid, RequestState.PREFILL)
            d.send(ReserveKV(rid, req.prompt_token_ids, req.params))
            reserved = await self._expect(rid, (KVReserved,), self.stage_timeout_s, "KV reservation")
            p = self._pick("prefill")
            self.touched[rid].add(p.instance_id)
            p.inflight += 1
            try:
                p.send(PrefillRequest(rid, req.prompt_token_ids, req.params, d.instance_id,
                                      list(reserved.block_ids), placeholders, e_id, refs))
                early: list[TokenOutput] = []
                done = await self._expect(rid, (PrefillDone,), self.stage_timeout_s, "prefill", stash=early)
            finally:
                p.inflight -= 1
            self._set_state(rid, RequestState.DECODE)
            for msg in reversed(early):  # put the overtaking tokens back in front, in order
                self._requeue_front(rid, msg)
            stats = {k: getattr(done, k) for k in ("kv_bytes", "kv_transfer_s", "kv_exposed_s", "kv_write_s",
                                                   "prefill_s", "queue_s", "num_transfer_requests")}
            yield TokenEvent([done.first_token], False, None, done.num_cached_tokens, stats)
            async for ev in self._stream(rid, first_timeout_s=self.token_timeout_s,
                                         num_cached_tokens=done.num_cached_tokens):
                yield ev
        finally:
            d.inflight -= 1

    async def _stream(self, rid: str, first_timeout_s: float, num_cached_tokens: int = 0) -> AsyncIterator[TokenEvent]:
        timeout = first_timeout_s
        while True:
            msg = await self._expect(rid, (TokenOutput,), timeout, "decode")
            timeout = self.token_timeout_s
            self._set_state(rid, RequestState.DECODE)
            yield TokenEvent(list(msg.token_ids), msg.finished, msg.finish_reason,
                             msg.num_cached_tokens or num_cached_tokens)
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
        """Each live worker's stats (free blocks, running, held buffers ...), by instance."""
        workers = self.registry.alive()
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[token] = (fut, {}, len(workers))
        try:
            for w in workers:
                w.send(StatsRequest(token))
            if not workers:
                return {}
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._stats_waiters.pop(token, None)
