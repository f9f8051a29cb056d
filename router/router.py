"""The router: requests over the E, P and D pools, token streaming back to the API.

``Router`` is the facade the API and the launcher use; it composes

- the pool registry (``epd.router.registry``): which workers exist, their
  control sockets, liveness and load; membership and NIXL peer introductions;
- the mailbox (``epd.router.mailbox``): the PULL socket workers report to,
  replies dispatched to per-request queues, waits with deadlines that also
  watch the workers a stage depends on;
- the routing policies and the KV prefix index (``epd.router.policies``,
  ``epd.router.kv_index``): which instance of a pool gets a request;
- the pipeline (``epd.router.pipeline``): one attempt's stages, encode ->
  prefill -> transfer -> decode, or one aggregated engine; and a phrase's
  speech in the tts pool;
- the recovery policy (``epd.router.recovery``): retries and migrations, each
  attempt under its own wire id;
- the request states (``epd.router.request``): where each open request
  stands, exported as the gauge ``epd_router_requests``.

One asyncio task per request walks its stages; a cancelled request (client
gone) sends ``Abort`` to every worker it touched, so each frees its blocks and
buffers whatever stage it was in. With no live instance in a pool a request
fails at once with HTTP 503. See ``docs/architecture.md``.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from epd.cluster_auth import ClusterKeys
from epd.messages import (
    ROUTER_PING_S,
    ROUTER_TIMEOUT_S,
    Draining,
    Heartbeat,
    KVEvents,
    Shutdown,
    StatsRequest,
    WorkerReady,
    WorkerStats,
)
from epd.multimodal import MediaItem
from epd.roles import Role
from epd.router.encode_split import VIDEO_ENCODE_SPLITS
from epd.router.kv_index import KVIndex
from epd.router.mailbox import Mailbox
from epd.router.pipeline import Pipeline
from epd.router.policies import RoutingPolicy, build_policy
from epd.router.recovery import KV_FAILURE_POLICIES, Recovery, check_policy
from epd.router.registry import PoolRegistry, WorkerHandle
from epd.router.request import RequestError, RequestState, RequestStates, RouterRequest, TokenEvent

__all__ = ["KV_FAILURE_POLICIES", "RequestError", "RequestState", "Router", "RouterRequest", "TokenEvent"]


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
        remote_prefix_reads: a prefill instance reads the prefix blocks another prefill
            instance's KV cache holds instead of prefilling them (``epd.transfer.remote_prefix``),
            and the kv policy counts them as read.
        video_encode_split: "auto" (a long Qwen-VL video is encoded in chunks of temporal
            patches over the encode pool's live instances, ``epd.router.encode_split``) or
            "off" (a request's items all go to one encoder).
        forget_dead_after_s: a worker dead this long (seconds, and its peers told it is
            gone) is forgotten: its socket closed, its pool gone with its last member.
        keys: the router's side of the cluster's CURVE keys (``epd.cluster_auth``, side
            ``ROUTER``): every socket authenticated and encrypted, the inbox admitting only
            the member key. None: no authentication, which only a loopback ``host`` allows.
        model: ``epd.models.checkpoints.model_fingerprint`` of the served checkpoint: a worker
            reporting another one is refused for good ("": not checked).

    Raises:
        ClusterKeysError: ``host`` is not loopback and ``keys`` is None.
        ValueError: ``keys`` are a member's, not the router's.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, stage_timeout_s: float = 120.0,
                 token_timeout_s: float = 120.0, heartbeat_timeout_s: float = 2.0, max_retries: int = 2,
                 kv_failure_policy: str = "retry", encode_routing: str | None = None,
                 prefill_routing: str | None = None, decode_routing: str | None = None,
                 kv_overlap_weight: float = 1.0, keys: ClusterKeys | None = None, model: str = "",
                 video_encode_split: str = "auto", forget_dead_after_s: float = 60.0,
                 remote_prefix_reads: bool = True) -> None:
        from epd.cluster_auth import ROUTER, require_keys

        check_policy(max_retries, kv_failure_policy)
        if forget_dead_after_s < 0:
            raise ValueError(f"forget_dead_after_s must be >= 0, got {forget_dead_after_s}")
        if video_encode_split not in VIDEO_ENCODE_SPLITS:
            raise ValueError(f"video_encode_split must be one of {VIDEO_ENCODE_SPLITS}, got {video_encode_split!r}")
        require_keys(host, keys, "router's control socket", "--router-host")
        self._metrics = None
        self.epoch = secrets.randbits(63) or 1  # this router process; workers re-join a new one
        self.ctx = zmq.asyncio.Context()
        if keys is not None and keys.side != ROUTER:
            raise ValueError(f"the router needs the {ROUTER} keys (load_keys(dir, ROUTER)), got the {keys.side} keys")
        # the inbox admits the member key only; the router's own key commands the workers
        self._auth = (keys.start_authenticator(self.ctx, lambda: self._count("auth_denied", "router", "router"))
                      if keys is not None else None)
        self.registry = PoolRegistry(self.ctx, heartbeat_timeout_s, keys=keys, epoch=self.epoch, model=model,
                                     forget_dead_after_s=forget_dead_after_s)
        self.mailbox = Mailbox(self.ctx, host, port, self.registry, {
            Heartbeat: self.registry.heartbeat, WorkerReady: self._on_ready, Draining: self.registry.draining,
            KVEvents: self._on_kv_events, WorkerStats: self._on_stats}, self._count, self._on_dead, keys=keys)
        self.endpoint = self.mailbox.endpoint
        self.kv_index = KVIndex()  # prefix caches of the prefill, pd and decode instances, from their KVEvents
        self.policies: dict[str, RoutingPolicy] = {
            role: build_policy(role, name, self.kv_index, kv_overlap_weight, remote_prefix_reads)
            for role, name in ((Role.ENCODE, encode_routing), (Role.PREFILL, prefill_routing),
                               (Role.PD, prefill_routing), (Role.DECODE, decode_routing), (Role.TTS, None))}
        self.states = RequestStates(lambda: self.metrics)
        self.state_counts = self.states.outcomes  # requests finished in this process, by outcome
        self.pipeline = Pipeline(self.registry, self.mailbox, self.policies, self.states, lambda: self.metrics,
                                 stage_timeout_s=stage_timeout_s, token_timeout_s=token_timeout_s,
                                 video_encode_split=video_encode_split, kv_index=self.kv_index,
                                 remote_prefix_reads=remote_prefix_reads)
        self.recovery = Recovery(self.pipeline, self._count, max_retries=max_retries,
                                 kv_failure_policy=kv_failure_policy)
        self._stats_waiters: dict[int, tuple[asyncio.Future, dict, int]] = {}
        #: live instances per role that /health requires (``epd serve --pools``); empty: one of each seen
        self.min_pools: dict[str, int] = {}
        self._tokens = itertools.count()

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self.mailbox.start()
        self._ping_task = asyncio.create_task(self._ping_loop())

    async def _ping_loop(self) -> None:
        """``RouterPing`` every ``ROUTER_PING_S`` (workers treat ``ROUTER_TIMEOUT_S`` of
        silence as a lost router); ``PeerGone`` for workers silent past that; forgets
        the long dead (``forget_dead``); the ``epd_pool_instances`` gauge."""
        while True:
            await asyncio.sleep(ROUTER_PING_S)
            try:
                self.registry.ping()
                self.registry.announce_silent(self.registry.heartbeat_timeout_s + ROUTER_TIMEOUT_S + 1.0)
                self.forget_dead()
                self._export_instances()
            except Exception:  # never let bookkeeping stop the pings
                import logging

                logging.getLogger(__name__).exception("router ping loop")

    def forget_dead(self) -> None:
        """Forget the workers dead for ``forget_dead_after_s`` (``PoolRegistry.forget_dead``),
        each death counted first, and what the routing policies kept about them."""
        self.mailbox.check_deaths()  # a death is counted before its worker is forgotten
        for w in self.registry.forget_dead():
            self.mailbox.forget_deaths(w.instance_id)
            self.kv_index.drop_instance(w.instance_id)
            for policy in self.policies.values():
                policy.forget(w.instance_id)

    def _export_instances(self) -> None:
        gauge = self.metrics.pool_instances
        for state in ("live", "draining", "dead"):
            counts = self.registry.counts(state)
            for role in Role:
                gauge.labels(pool=role.value, state=state).set(counts.get(role, 0))

    @property
    def metrics(self):
        if self._metrics is None:
            from epd.metrics import get_metrics

            self._metrics = get_metrics()
        return self._metrics

    def _count(self, name: str, role: str, instance: str) -> None:
        getattr(self.metrics, name).labels(pool=role, instance=instance).inc()

    def mark_dead(self, instance_id: str) -> None:
        """The launcher saw this worker's process exit: stop routing to it now,
        and fail the stages waiting on it (they retry elsewhere)."""
        self.registry.mark_dead(instance_id)

    async def stop(self, shutdown_workers: bool = True) -> None:
        if shutdown_workers:
            for w in list(self.registry.workers.values()):
                w.try_send(Shutdown())
        task = getattr(self, "_ping_task", None)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.mailbox.stop()
        self.registry.close()
        if self._auth is not None:
            self._auth.stop()
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

    def has_pool(self, role: str) -> bool:
        return self.registry.has_pool(role)

    def max_model_len(self, limit: int) -> int:
        """``limit`` (the API's own), or less: the smallest ``max_model_len`` a live
        prefill, decode or pd worker reports (``WorkerReady.max_model_len``)."""
        live = self.registry.max_model_len()
        return min(limit, live) if live is not None else limit

    # ---- inbound control messages -------------------------------------------------------
    def _dispatch(self, msg) -> None:
        """Handle one decoded worker message (the mailbox's receive loop does this)."""
        self.mailbox.dispatch(msg)

    def _on_ready(self, msg: WorkerReady) -> None:
        """A worker process joined (or re-joined under its instance id): register it; its
        prefix-cache entries and death record start empty (a new process, a new cache)."""
        old = self.registry.get(msg.instance_id)
        handle = self.registry.register(msg)
        if handle is not None and handle is not old:
            self.kv_index.drop_instance(msg.instance_id)
            self.mailbox.forget_deaths(msg.instance_id)

    def _on_dead(self, w: WorkerHandle) -> None:
        """The registry declared ``w`` dead (silent past the heartbeat timeout, or exited):
        its cached prefixes must not attract routing, whether or not it ever comes back."""
        self.kv_index.drop_instance(w.instance_id)

    def _on_kv_events(self, msg: KVEvents) -> None:
        w = self.registry.get(msg.instance_id)
        self.kv_index.apply(msg, w.info.pid if w is not None else None,
                            w.info.kv_layout.num_blocks + w.info.num_tier_blocks
                            if w is not None and w.info.kv_layout else None)

    def _on_stats(self, msg: WorkerStats) -> None:
        waiter = self._stats_waiters.get(msg.token)
        if waiter is not None:
            fut, acc, n = waiter
            acc[msg.instance_id] = msg.stats
            if len(acc) >= n and not fut.done():
                fut.set_result(acc)

    # ---- requests -------------------------------------------------------------------
    def _pick(self, role: str, req: RouterRequest | None = None,
              avoid: set[str] | frozenset = frozenset()) -> WorkerHandle:
        return self.pipeline.pick(role, req, avoid)

    async def transcribe(self, request_id: str, items: list[MediaItem]) -> list[str]:
        """Speech-to-text through the E pool (text-only LMs); retried on another
        encoder when one dies or fails (up to ``max_retries``)."""
        return await self.recovery.transcribe(request_id, items)

    def synthesize(self, request_id: str, text: str, voice: str) -> AsyncIterator[bytes]:
        """Text-to-speech of one phrase through the tts pool: an async iterator of PCM16
        little-endian mono bytes at ``TTS_SAMPLE_RATE`` Hz as the worker makes them. A
        worker that dies mid-phrase is replaced by another (synthesis is deterministic:
        the audio already streamed is skipped). Raises RequestError: 503 with no tts
        pool, 400 for an unknown voice. Closing the iterator aborts it on the worker."""
        return self.recovery.synthesize(request_id, text, voice)

    def generate(self, req: RouterRequest) -> AsyncIterator[TokenEvent]:
        """Run ``req`` through the pools: an async iterator of its tokens as they come.

        A retryable failure (dead/hung worker, failed KV transfer) restarts the
        request on other instances, migrating it when tokens were already
        streamed (``epd.router.recovery``); the client's stream just goes on.
        Raises RequestError (with an HTTP status) when a stage fails for good.
        Closing the iterator early (client gone) aborts the request everywhere.
        """
        return self.recovery.generate(req)  # the generator itself, so that closing it aborts at once

    async def abort(self, request_id: str) -> None:
        self.pipeline.abort_everywhere(request_id)

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
            except TimeoutError:
                acc = dict(self._stats_waiters[token][1])
                for w in workers:
                    acc.setdefault(w.instance_id, {"unresponsive": 1})
                return acc
        finally:
            self._stats_waiters.pop(token, None)
