"""The router's inbox: one PULL socket every worker reports to, and watched waits on it.

Every worker message arrives on one socket. Control messages (ready,
heartbeats, KV cache events, stats answers) go to the handler registered for
their type; a message about a request (any other, it carries ``request_id``)
goes to that request's queue, opened by ``open`` for each attempt's wire id.
A message for a wire id with no open queue (a late reply of an abandoned
attempt) is dropped.

``expect`` waits for a request's next message with a deadline, and while it
waits watches the workers the stage depends on: one that misses heartbeats for
``heartbeat_timeout_s`` (or that the launcher reports dead) fails the wait at
once (``kind="dead"``), within ``liveness_poll_s``, instead of at its deadline.
A background watch loop (``check_deaths``) logs and counts each worker the
moment it is found dead, whether or not a request waits on it: once per outage
of each process incarnation (instance id + pid of its ``WorkerReady``), so a
worker that comes back (thawed, or restarted under its id) and dies again is
counted again; ``on_dead`` runs with it (the router drops its prefix-cache
entries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from epd.messages import MessageError, RequestFailed, TokenOutput, decode
from epd.router.registry import PoolRegistry, WorkerHandle
from epd.router.request import RequestError

logger = logging.getLogger(__name__)


class Mailbox:
    """Binds a PULL socket on ``host:port`` (0: a free port); ``endpoint`` is its address.

    Args:
        ctx: the router's ZeroMQ context.
        registry: the pools; messages refresh their senders' liveness.
        handlers: message type -> callable, for the control messages.
        count: ``count(metric, pool, instance)`` increments a counter of ``epd.metrics``.
        on_dead: called with each worker handle the moment it is found dead.
        keys: the router's CURVE keys (``epd.cluster_auth.ClusterKeys``, side ``ROUTER``), or None.
    """

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, registry: PoolRegistry,
                 handlers: dict[type, Callable], count: Callable[[str, str, str], None],
                 on_dead: Callable[[WorkerHandle], None] | None = None, keys=None) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 100000)
        if keys is not None:  # a CURVE server: only holders of the member key get a message in
            keys.server(self.pull)
        zhost = f"[{host}]" if ":" in host and not host.startswith("[") else host
        if port:
            self.pull.bind(f"tcp://{zhost}:{port}")
        else:
            port = self.pull.bind_to_random_port(f"tcp://{zhost}")
        self.endpoint = f"tcp://{zhost}:{port}"
        self.registry = registry
        self.handlers = handlers
        self._count = count
        self.liveness_poll_s = min(0.25, registry.heartbeat_timeout_s / 4)
        self.queues: dict[str, asyncio.Queue] = {}
        self._on_dead = on_dead
        self._dead_seen: set[tuple[str, int]] = set()  # (instance id, pid) dead, counted, not back since
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watch_loop())]

    async def stop(self) -> None:
        """Stop both loops and close the socket."""
        for task in self._tasks:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.pull.close(0)

    async def _watch_loop(self) -> None:
        """Log and count each worker the moment it is found dead (silent past the
        heartbeat timeout, or reported by the launcher)."""
        while True:
            await asyncio.sleep(self.liveness_poll_s)
            try:
                self.check_deaths()
            except Exception:  # never let bookkeeping stop the watcher
                logger.exception("router watch loop")

    def check_deaths(self) -> None:
        """Count (``worker_failures``), log and pass to ``on_dead`` every registered
        worker found dead since it was last seen alive; forget those alive again."""
        for w in list(self.registry.workers.values()):
            key = (w.instance_id, w.info.pid)
            if self.registry.is_alive(w):
                self._dead_seen.discard(key)  # thawed: its next death is another failure
            elif key not in self._dead_seen:
                self._dead_seen.add(key)
                if w.draining:  # it said Draining: leaving is the plan, not a failure
                    logger.warning("%s worker %s (pid %d) left after draining", w.role, w.instance_id, w.info.pid)
                else:
                    logger.warning("%s worker %s (pid %d) is dead (%s)", w.role, w.instance_id, w.info.pid,
                                   self._why_dead(w))
                    self._count("worker_failures", w.role, w.instance_id)
                if self._on_dead is not None:
                    self._on_dead(w)

    def _why_dead(self, w: WorkerHandle) -> str:
        if self.registry.stalled(w):
            return f"its main loop has not advanced for {w.info.stall_timeout_s:.0f} s (wedged)"
        return f"no heartbeat for {self.registry.heartbeat_timeout_s:.1f} s"

    def forget_deaths(self, instance_id: str) -> None:
        """``instance_id`` re-registered (a new process, maybe with a recycled pid):
        its next death counts whatever it was before."""
        self._dead_seen = {k for k in self._dead_seen if k[0] != instance_id}

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
                self.dispatch(msg)
            except Exception:  # a bug handling one message must not stop routing
                logger.exception("router failed to handle %s", type(msg).__name__)

    def dispatch(self, msg) -> None:
        """Hand one decoded message to its type's handler or its request's queue."""
        handler = self.handlers.get(type(msg))
        if handler is not None:
            handler(msg)
            return
        rid = getattr(msg, "request_id", None)
        inst = getattr(msg, "instance_id", None)
        if inst:
            self.registry.seen(inst)
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(msg)

    # ---- per-request queues -----------------------------------------------------------
    def open(self, rid: str) -> None:
        """Start collecting the messages for wire id ``rid``.

        Raises:
            RequestError: (500, ``kind="duplicate_id"``) a queue for ``rid`` is open: a live
                request has that id, and replacing its queue would hand its replies to another.
        """
        if rid in self.queues:
            raise RequestError(f"request id {rid!r} is already in flight; a wire id is never reused while live",
                               status=500, kind="duplicate_id")
        self.queues[rid] = asyncio.Queue()

    def close(self, rid: str) -> None:
        """Stop collecting them: later messages for ``rid`` are dropped."""
        self.queues.pop(rid, None)

    def requeue_front(self, rid: str, msg) -> None:
        """Put ``msg`` back at the head of ``rid``'s queue."""
        q = self.queues[rid]
        items = [msg]
        while not q.empty():
            items.append(q.get_nowait())
        for it in items:
            q.put_nowait(it)

    async def expect(self, rid: str, types: tuple, timeout_s: float, stage: str, stash: list | None = None,
                     watch: tuple[WorkerHandle, ...] = (), move_off_draining: bool = False):
        """Next message of ``types`` for ``rid``. With ``stash``, TokenOutputs that
        overtake it (D may stream before P's PrefillDone arrives) are kept there.

        Raises RequestError: a worker's RequestFailed; the deadline passed
        (``kind="timeout"``); a worker in ``watch`` died (``kind="dead"``,
        noticed within ``liveness_poll_s`` of its heartbeat timeout); or, with
        ``move_off_draining``, a worker in ``watch`` drains while another instance
        of its pool can take the request over (``kind="drain"``: it migrates).
        """
        q = self.queues[rid]
        deadline = time.monotonic() + timeout_s
        while True:
            if move_off_draining:
                self._check_draining(watch, stage)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                who = watch[0].instance_id if watch else None
                raise RequestError(f"{stage} timed out after {timeout_s:.0f} s" + (f" on {who}" if who else ""),
                                   status=504, retryable=True, instance=who, kind="timeout")
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for returns a message that lands
                # as the wait is cancelled, and the cancel is lost (CPython gh-86296)
                async with asyncio.timeout(min(remaining, self.liveness_poll_s) if watch else remaining):
                    msg = await q.get()
            except TimeoutError:
                self._check_alive(watch, stage)
                continue
            if stash is not None and isinstance(msg, TokenOutput):
                stash.append(msg)
                continue
            break
        if isinstance(msg, RequestFailed):
            status = msg.status if 400 <= msg.status <= 599 else 500  # who failed, as the worker says
            raise RequestError(f"{stage} failed on {msg.instance_id}: {msg.error}",
                               status=status, retryable=msg.retryable,
                               instance=msg.instance_id, kind=msg.kind)
        if not isinstance(msg, types):
            raise RequestError(f"unexpected {type(msg).__name__} during {stage}")
        return msg

    def _check_draining(self, watch: tuple[WorkerHandle, ...], stage: str) -> None:
        """Raise RequestError (``kind="drain"``) for a draining worker in ``watch`` whose
        pool has a routable instance to move to (else it finishes the request itself)."""
        for w in watch:
            if w.draining and self.registry.routable(w.role):
                raise RequestError(f"{stage}: {w.role} worker {w.instance_id} is draining", status=503,
                                   retryable=True, instance=w.instance_id, kind="drain")

    def _check_alive(self, watch: tuple[WorkerHandle, ...], stage: str) -> None:
        """Raise RequestError (``kind="dead"``) for the first dead worker in ``watch``."""
        for w in watch:
            if not self.registry.is_alive(w):
                raise RequestError(f"{stage}: {w.role} worker {w.instance_id} died ({self._why_dead(w)})",
                                   status=503, retryable=True, instance=w.instance_id, kind="dead") from None
