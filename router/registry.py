"""Pool registry: which workers exist, their control sockets, liveness and load.

Membership: a worker joins with ``WorkerReady`` (``register``), which also
introduces it to the peers it moves data with over NIXL: prefill / aggregated
workers read embeddings from encoders and write KV to decoders, so each side
gets the other's ``PeerInfo``. A worker stays alive while its heartbeats (or
any message) arrive within ``heartbeat_timeout_s``; the launcher can declare it
dead sooner (``mark_dead``). A restarted worker re-registers under its instance
id and replaces its old handle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from epd.messages import Heartbeat, Message, PeerGone, PeerInfo, WorkerReady, encode
from epd.roles import Role

logger = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    """One worker instance as the router knows it."""

    info: WorkerReady
    socket: zmq.asyncio.Socket
    last_seen: float = field(default_factory=time.monotonic)
    load: Heartbeat | None = None
    inflight: int = 0  # requests the router has routed here and not yet finished

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> str:
        return self.info.role

    def send(self, msg: Message) -> None:
        self.socket.send(encode(msg), zmq.NOBLOCK)

    def try_send(self, msg: Message) -> None:
        """``send``, ignoring a socket error (best effort: aborts, shutdown)."""
        try:
            self.send(msg)
        except zmq.ZMQError:
            pass


class PoolRegistry:
    """Workers by role; a worker is alive while heartbeats arrive within ``heartbeat_timeout_s``."""

    def __init__(self, ctx: zmq.asyncio.Context, heartbeat_timeout_s: float = 2.0) -> None:
        self.ctx = ctx
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[str, WorkerHandle] = {}

    def add(self, info: WorkerReady) -> WorkerHandle:
        old = self.workers.pop(info.instance_id, None)
        if old is not None:
            old.socket.close(0)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100000)
        sock.connect(info.cmd_endpoint)
        handle = WorkerHandle(info, sock)
        self.workers[info.instance_id] = handle
        return handle

    def register(self, info: WorkerReady) -> WorkerHandle:
        """``add`` a worker that reported ready, and exchange ``PeerInfo`` with its NIXL peers."""
        handle = self.add(info)
        logger.info("worker %s (%s) ready in %.1f s", info.instance_id, info.role, info.startup_s)
        peer = PeerInfo(info.instance_id, info.nixl_metadata, list(info.regions), info.kv_layout, info.pid)
        # Prefill / aggregated workers read from encoders and write to decoders.
        if info.role in (Role.ENCODE, Role.DECODE):
            for w in self.workers.values():
                if w.role in (Role.PREFILL, Role.PD) and w is not handle:
                    w.send(peer)
        if info.role in (Role.PREFILL, Role.PD):
            for w in self.workers.values():
                if w.role in (Role.ENCODE, Role.DECODE):
                    handle.send(PeerInfo(w.instance_id, w.info.nixl_metadata, list(w.info.regions),
                                         w.info.kv_layout, w.info.pid))
        return handle

    def heartbeat(self, hb: Heartbeat) -> None:
        """``hb`` refreshes its worker's liveness, and its load unless it is a numbered
        report older than the one kept (a late repeat from the heartbeat thread)."""
        w = self.workers.get(hb.instance_id)
        if w is not None:
            w.last_seen = time.monotonic()
            if w.load is None or not hb.seq or hb.seq >= w.load.seq:
                w.load = hb

    def seen(self, instance_id: str) -> None:
        w = self.workers.get(instance_id)
        if w is not None:
            w.last_seen = time.monotonic()

    def is_alive(self, w: WorkerHandle) -> bool:
        """``w`` is still the registered incarnation of its instance (not replaced by a
        restart) and heard from within the heartbeat timeout."""
        return (self.workers.get(w.instance_id) is w
                and time.monotonic() - w.last_seen <= self.heartbeat_timeout_s)

    def mark_dead(self, instance_id: str) -> None:
        """Treat ``instance_id`` as dead now (its process exited) until it reports again."""
        w = self.workers.get(instance_id)
        if w is not None:
            w.last_seen = float("-inf")
            # Its peers may hold blocks fenced for what it was writing: they are free now.
            gone = PeerGone(instance_id, w.info.pid)
            for other in self.workers.values():
                if other is not w:
                    other.try_send(gone)

    def alive(self, role: str | None = None) -> list[WorkerHandle]:
        now = time.monotonic()
        return [w for w in self.workers.values()
                if (role is None or w.role == role) and now - w.last_seen <= self.heartbeat_timeout_s]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.alive():
            out[w.role] = out.get(w.role, 0) + 1
        return out

    def get(self, instance_id: str) -> WorkerHandle | None:
        return self.workers.get(instance_id)

    def has_pool(self, role: str) -> bool:
        """Some worker of ``role`` has registered (alive or not)."""
        return any(w.role == role for w in self.workers.values())

    def close(self) -> None:
        for w in self.workers.values():
            w.socket.close(0)
        self.workers.clear()
