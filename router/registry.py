"""Pool registry: which workers exist, their control sockets, liveness and load.

Membership: a worker joins with ``WorkerReady`` (``register``), answered with
``Registered`` (the router's ``epoch``), which also introduces it to the peers it
moves data with over NIXL: prefill / aggregated workers read embeddings from
encoders and write KV to decoders, so each side gets the other's ``PeerInfo``, and
prefill workers read prefix blocks from each other (remote prefix reads)
(only members reach the router's socket: with cluster keys it is CURVE
authenticated). A worker stays alive while its heartbeats (or any message)
arrive within ``heartbeat_timeout_s``; the launcher can declare it dead sooner
(``mark_dead``). A restarted worker re-registers under its instance id and
replaces its old handle once that one is dead; a second process claiming a live
instance id is refused (``RegistrationRefused``); only its own process's heartbeats
(``Heartbeat.incarnation``) keep an instance alive, so a replacement's never hold its
dead predecessor's place. A draining worker (``Draining``, on SIGTERM) stays alive
but is no longer ``routable``. A worker whose main loop stops advancing
(``Heartbeat.loop``) for its ``WorkerReady.stall_timeout_s`` counts as dead too,
though it still heartbeats (a wedged loop).

Forgetting: a dead worker whose peers were told it is gone (``PeerGone``) is
forgotten ``forget_dead_after_s`` after it was found dead (``forget_dead``): its
socket closes and its pool, when it was the last member, no longer exists
(``has_pool``). Kubernetes gives every replacement pod a new instance id, so
without this every pod that ever ran would stay registered.

Each worker's PUSH socket sets ``ZMQ_IMMEDIATE``: nothing queues for a peer
without a connection. What ``send`` cannot hand over yet (the connection to a
worker that just joined is still being made, or is broken) waits in order in
the handle's ``backlog`` (at most ``BACKLOG`` messages), flushed on each of the
worker's heartbeats and each ping; pings are dropped instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from epd.cluster_auth import ClusterKeys
from epd.kernels.kv_quant import KV_QUANT
from epd.messages import (
    ROUTER_PING_S,
    Draining,
    Heartbeat,
    Message,
    PeerGone,
    PeerInfo,
    Registered,
    RegistrationRefused,
    RouterPing,
    WorkerReady,
    encode,
)
from epd.roles import Role

logger = logging.getLogger(__name__)

#: messages kept for a worker whose connection is not up (``WorkerHandle.backlog``); also the socket's SNDHWM
BACKLOG = 1000
#: seconds before the first retry of a backlog ``send`` left
RETRY_FIRST_S = 0.005


@dataclass
class WorkerHandle:
    """One worker instance as the router knows it."""

    info: WorkerReady
    socket: zmq.Socket
    last_seen: float = field(default_factory=time.monotonic)
    load: Heartbeat | None = None
    inflight: int = 0  # requests the router has routed here and not yet finished
    draining: bool = False  # it said Draining: alive, but routed nothing new
    loop: int = 0  # the highest main-loop iteration count its heartbeats carried
    loop_at: float = field(default_factory=time.monotonic)  # when that count last advanced
    dead_at: float | None = None  # when ``forget_dead`` first found it dead (None: alive at its last sweep)
    backlog: list[bytes] = field(default_factory=list)  # encoded messages waiting for a connection, in order
    _retry: asyncio.TimerHandle | None = None  # the next ``flush`` of a backlog left by ``send``

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> str:
        return self.info.role

    def send(self, msg: Message) -> None:
        """Hand ``msg`` to the socket, after whatever waits in ``backlog``; while the
        connection is not up it waits there too (beyond ``BACKLOG`` messages it is
        dropped: the worker is dead, or will find the router lost and re-join).

        Raises:
            zmq.ZMQError: the socket is closed (the worker was forgotten).
        """
        if len(self.backlog) < BACKLOG:
            self.backlog.append(encode(msg))
        else:
            logger.warning("worker %s: no connection, %d messages waiting: dropped %s", self.instance_id,
                           BACKLOG, type(msg).__name__)
        self.flush()
        if self.backlog and self._retry is None:
            self._schedule_retry(RETRY_FIRST_S)

    def flush(self) -> None:
        """Send what waits in ``backlog``, in order, as far as the connection takes it."""
        while self.backlog:
            try:
                self.socket.send(self.backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            del self.backlog[0]

    def _schedule_retry(self, delay_s: float) -> None:
        """``flush`` again in ``delay_s``, then at doubling delays up to ``ROUTER_PING_S``
        (from there each ping flushes): a connection being made is up within milliseconds."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop: the next heartbeat or ping flushes
            return

        def retry() -> None:
            self._retry = None
            if self.socket.closed:
                return
            self.flush()
            if self.backlog and delay_s * 2 <= ROUTER_PING_S:
                self._schedule_retry(delay_s * 2)

        self._retry = loop.call_later(delay_s, retry)

    def try_send(self, msg: Message) -> None:
        """``send``, ignoring a socket error (best effort: aborts, shutdown)."""
        try:
            self.send(msg)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        """Close its socket at once (nothing queued is sent) and drop the backlog."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self.backlog.clear()
        self.socket.close(0)


class PoolRegistry:
    """Workers by role; a worker is alive while heartbeats arrive within ``heartbeat_timeout_s``."""

    def __init__(self, ctx: zmq.asyncio.Context, heartbeat_timeout_s: float = 2.0, *,
                 keys: ClusterKeys | None = None, epoch: int = 0, model: str = "",
                 forget_dead_after_s: float = 60.0) -> None:
        self.ctx = ctx
        self.model = model  # the fingerprint every worker must serve ("": not checked)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_dead_after_s = forget_dead_after_s
        self.keys = keys
        self.epoch = epoch
        self.workers: dict[str, WorkerHandle] = {}
        self._gone_sent: set[tuple[str, int, int]] = set()  # (instance, pid, incarnation) announced gone

    def _connect(self, endpoint: str) -> zmq.Socket:
        """A PUSH socket to a worker's command socket; a plain (not asyncio) socket, so a
        non-blocking send that cannot go out raises ``zmq.Again`` at once."""
        sock = zmq.Socket(self.ctx, zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, BACKLOG)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # a dead peer's reconnecting pipe queues nothing
        if self.keys is not None:
            self.keys.client(sock)
        sock.connect(endpoint)
        return sock

    def add(self, info: WorkerReady) -> WorkerHandle:
        old = self.workers.pop(info.instance_id, None)
        if old is not None:
            old.close()
        handle = WorkerHandle(info, self._connect(info.cmd_endpoint))
        self.workers[info.instance_id] = handle
        return handle

    def _refuse(self, info: WorkerReady, reason: str, permanent: bool = False) -> None:
        logger.warning("refused worker %s (pid %d at %s): %s", info.instance_id, info.pid, info.cmd_endpoint, reason)
        sock = zmq.Socket(self.ctx, zmq.PUSH)  # queues until connected (not IMMEDIATE): the answer must go out
        if self.keys is not None:
            self.keys.client(sock)
        sock.connect(info.cmd_endpoint)
        sock.setsockopt(zmq.LINGER, 1000)  # the answer still goes out after close
        try:
            sock.send(encode(RegistrationRefused(info.instance_id, reason, permanent)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        sock.close()

    def register(self, info: WorkerReady) -> WorkerHandle | None:
        """``add`` a worker that reported ready, answer ``Registered``, and exchange
        ``PeerInfo`` with its NIXL peers. A repeat of the registered process's own
        ``WorkerReady`` is answered again; another process claiming the id of a live
        instance is refused (None)."""
        if self.model and info.model and info.model != self.model:
            self._refuse(info, f"it serves another model (fingerprint {info.model}) than this router "
                               f"({self.model}): start it with the same --model as `epd serve`", permanent=True)
            return None
        other = next((w for w in self.workers.values() if w.info.kv_layout is not None
                      and w.instance_id != info.instance_id), None)
        mine_layout = info.kv_layout if other is not None else None
        if mine_layout is not None and other.info.kv_layout.dtype != mine_layout.dtype:
            mine, theirs = mine_layout.dtype, other.info.kv_layout.dtype
            # a quantized cache's layout dtype is its kind ("int8", "fp8_e4m3"): the flag that differs
            # is --kv-cache-dtype (with "auto" the cache follows --dtype)
            flags = ("--kv-cache-dtype (and, with --kv-cache-dtype auto, --dtype)"
                     if mine in KV_QUANT or theirs in KV_QUANT else "--dtype")
            self._refuse(info, f"its KV cache is {mine}, but worker {other.instance_id}'s is {theirs}: KV moves "
                               f"between prefill and decode byte for byte, so start every prefill and decode worker "
                               f"with the same {flags}", permanent=True)
            return None
        if mine_layout is not None and other.info.kv_layout.block_size != mine_layout.block_size:
            self._refuse(info, f"its KV blocks hold {mine_layout.block_size} tokens, but worker "
                               f"{other.instance_id}'s hold {other.info.kv_layout.block_size}: KV moves between "
                               f"prefill and decode block by block, so start every prefill and decode worker with "
                               f"the same --block-size", permanent=True)
            return None
        old = self.workers.get(info.instance_id)
        if old is not None and info.incarnation and old.info.incarnation == info.incarnation:
            old.last_seen = time.monotonic()
            old.send(Registered(info.instance_id, self.epoch))  # its first answer was lost, or it re-joins
            return old
        same_process = old is not None and (old.info.pid, _host(old.info.cmd_endpoint)) == (
            info.pid, _host(info.cmd_endpoint))  # a restart that got the pid back, or the same process anew
        if old is not None and self.is_alive(old) and not same_process:
            self._refuse(info, f"instance id {info.instance_id!r} is held by a live worker (pid {old.info.pid} at "
                               f"{old.info.cmd_endpoint}); give every worker its own --instance-id")
            return None
        handle = self.add(info)
        handle.send(Registered(info.instance_id, self.epoch))
        logger.info("worker %s (%s) ready in %.1f s", info.instance_id, info.role, info.startup_s)
        peer = PeerInfo(info.instance_id, info.nixl_metadata, list(info.regions), info.kv_layout, info.pid)
        # Prefill / aggregated workers read from encoders and write to decoders.
        if info.role in (Role.ENCODE, Role.DECODE):
            for w in self.workers.values():
                if w.role in (Role.PREFILL, Role.PD) and w is not handle:
                    w.send(peer)
        if info.role in (Role.PREFILL, Role.PD):
            for w in self.workers.values():
                if w.role in (Role.ENCODE, Role.DECODE) or (info.role == w.role == Role.PREFILL and w is not handle):
                    handle.send(PeerInfo(w.instance_id, w.info.nixl_metadata, list(w.info.regions),
                                         w.info.kv_layout, w.info.pid))
        # Prefill workers read prefix blocks from each other (epd.transfer.remote_prefix).
        if info.role == Role.PREFILL:
            for w in self.workers.values():
                if w.role == Role.PREFILL and w is not handle:
                    w.send(peer)
        return handle

    def heartbeat(self, hb: Heartbeat) -> None:
        """``hb`` refreshes its worker's liveness and main-loop progress, and its load
        unless it is a numbered report older than the one kept (a late repeat from the
        heartbeat thread); it flushes the worker's backlog. A beat of another process
        than the registered one (``incarnation``) changes nothing."""
        w = self.workers.get(hb.instance_id)
        if w is None or (hb.incarnation and w.info.incarnation and hb.incarnation != w.info.incarnation):
            return
        now = time.monotonic()
        w.last_seen = now
        if hb.loop > w.loop:
            w.loop, w.loop_at = hb.loop, now
        if w.load is None or not hb.seq or hb.seq >= w.load.seq:
            w.load = hb
        w.flush()

    def draining(self, msg: Draining) -> None:
        """``msg``'s worker drains: route nothing new to it."""
        w = self.workers.get(msg.instance_id)
        if w is not None and w.info.pid == msg.pid and not w.draining:
            logger.warning("worker %s (%s) is draining", w.instance_id, w.role)
            w.draining = True

    def ping(self) -> None:
        """``RouterPing`` to every registered worker (dead-looking ones too: a thawed
        worker then finds the router was there all along)."""
        ping = encode(RouterPing(self.epoch))
        for w in self.workers.values():
            w.flush()
            if not w.backlog:  # a ping waits for nothing: without a connection it is dropped
                try:
                    w.socket.send(ping, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def seen(self, instance_id: str) -> None:
        w = self.workers.get(instance_id)
        if w is not None:
            w.last_seen = time.monotonic()

    def is_alive(self, w: WorkerHandle) -> bool:
        """``w`` is still the registered incarnation of its instance (not replaced by a
        restart), heard from within the heartbeat timeout, and its main loop advanced
        within its ``stall_timeout_s``."""
        return self.workers.get(w.instance_id) is w and self._live(w, time.monotonic())

    def _live(self, w: WorkerHandle, now: float) -> bool:
        stall = w.info.stall_timeout_s
        return now - w.last_seen <= self.heartbeat_timeout_s and not (stall > 0 and now - w.loop_at > stall)

    def stalled(self, w: WorkerHandle) -> bool:
        """``w`` heartbeats, but its main loop has not advanced for its ``stall_timeout_s``."""
        stall = w.info.stall_timeout_s
        now = time.monotonic()
        return now - w.last_seen <= self.heartbeat_timeout_s and stall > 0 and now - w.loop_at > stall

    def mark_dead(self, instance_id: str) -> None:
        """Treat ``instance_id`` as dead now (its process exited) until it reports again."""
        w = self.workers.get(instance_id)
        if w is not None:
            w.last_seen = float("-inf")
            self._announce_gone(w)

    def _announce_gone(self, w: WorkerHandle) -> None:
        """Its peers may hold blocks fenced for what it was writing: tell them they are
        free (``PeerGone``), once per process incarnation."""
        key = (w.instance_id, w.info.pid, w.info.incarnation)
        if key in self._gone_sent:
            return
        self._gone_sent.add(key)
        gone = PeerGone(w.instance_id, w.info.pid)
        for other in self.workers.values():
            if other is not w:
                other.try_send(gone)

    def announce_silent(self, gone_after_s: float) -> None:
        """``PeerGone`` for every worker silent for ``gone_after_s``: longer than the
        heartbeat timeout plus a worker's router timeout, so it is either dead, or
        running but cut off, in which case it has lost this router and dropped every
        send (``BaseWorker.router_lost``): nothing it was told can still write."""
        now = time.monotonic()
        for w in list(self.workers.values()):
            if now - w.last_seen > gone_after_s:
                self._announce_gone(w)

    def forget_dead(self) -> list[WorkerHandle]:
        """Forget every worker dead for ``forget_dead_after_s`` whose peers were told it
        is gone (``PeerGone``; a wedged worker that still heartbeats is kept): close its
        socket and drop it. Returns the forgotten handles."""
        now = time.monotonic()
        gone = []
        for w in list(self.workers.values()):
            if self._live(w, now):
                w.dead_at = None
                continue
            if w.dead_at is None:
                w.dead_at = now
            key = (w.instance_id, w.info.pid, w.info.incarnation)
            if now - w.dead_at >= self.forget_dead_after_s and key in self._gone_sent:
                logger.warning("%s worker %s (pid %d) forgotten: dead for %.0f s", w.role, w.instance_id,
                               w.info.pid, now - w.dead_at)
                del self.workers[w.instance_id]
                self._gone_sent.discard(key)
                w.close()
                gone.append(w)
        return gone

    def alive(self, role: str | None = None) -> list[WorkerHandle]:
        now = time.monotonic()
        return [w for w in self.workers.values() if (role is None or w.role == role) and self._live(w, now)]

    def routable(self, role: str | None = None) -> list[WorkerHandle]:
        """Alive and not draining: where new work may go."""
        return [w for w in self.alive(role) if not w.draining]

    def counts(self, state: str = "live") -> dict[str, int]:
        """Instances per role: ``live`` (routable), ``draining`` (alive, draining) or
        ``dead`` (registered, not alive, not forgotten yet)."""
        out: dict[str, int] = {}
        members = ([w for w in self.workers.values() if not self.is_alive(w)] if state == "dead"
                   else [w for w in self.alive() if w.draining == (state == "draining")])
        for w in members:
            out[w.role] = out.get(w.role, 0) + 1
        return out

    def max_model_len(self) -> int | None:
        """The smallest ``max_model_len`` any live prefill, decode or pd worker reports
        (a request may go through any of them); None: none reports one."""
        lens = [w.info.max_model_len for w in self.alive() if w.info.max_model_len > 0
                and w.role in (Role.PREFILL, Role.DECODE, Role.PD)]
        return min(lens) if lens else None

    def get(self, instance_id: str) -> WorkerHandle | None:
        return self.workers.get(instance_id)

    def has_pool(self, role: str) -> bool:
        """Some worker of ``role`` is registered (alive, or dead and not forgotten yet)."""
        return any(w.role == role for w in self.workers.values())

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self.workers.clear()


def _host(endpoint: str) -> str:
    """The host of a ``tcp://host:port`` endpoint."""
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
