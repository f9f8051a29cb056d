"""The worker process loop shared by every role: commands in, engine steps, NIXL polls, heartbeats.

A worker binds one ZeroMQ PULL socket for commands (loopback by default) and
pushes everything it reports to the router's PULL socket. Messages are the
typed structs of ``epd.messages`` (msgpack, never pickle). The loop is single
threaded: drain commands, poll NIXL, run one engine step when there is work,
send a heartbeat every ``HEARTBEAT_S``. SIGTERM/SIGINT end it cleanly.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from epd.messages import (Abort, Heartbeat, Message, MessageError, PeerGone, PeerInfo, Region, RequestFailed,
                          Shutdown, StatsRequest, WorkerReady, WorkerStats, decode, encode)
from epd.errors import CapacityError, error_status
from epd.roles import Role

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
#: A heartbeat-thread tick later than this means the whole process was frozen
#: (SIGSTOP, a suspended VM): the router, whose liveness timeout is 2 s, may have
#: declared it dead and retried its requests elsewhere, so in-flight work is fenced.
FREEZE_S = 1.5


@dataclass(slots=True)
class WorkerArgs:
    """What ``epd worker`` was started with."""

    role: Role
    instance_id: str
    router: str
    model: str | None = None
    rank: int = 0
    tp: int = 1
    threads: int | None = None
    host: str = "127.0.0.1"
    engine_kwargs: dict = field(default_factory=dict)
    kv_timeout_s: float = 30.0
    embedding_buffer_mb: int = 256
    kv_staging_mb: int = 0  # staging pool for heterogeneous-TP KV transfers (0: none)


class BaseWorker:
    """Subclasses set up their engine, call ``announce`` and implement
    ``handle_role`` / ``has_work`` / ``step`` / ``poll`` / ``abort`` / ``stats``."""

    role: str = "base"  # subclasses: their Role

    def __init__(self, args: WorkerArgs) -> None:
        self.t0 = time.monotonic()
        self.args = args
        self.instance_id = args.instance_id
        if args.threads:
            torch.set_num_threads(args.threads)
        self.ctx = zmq.Context()
        self.cmd = self.ctx.socket(zmq.PULL)
        port = self.cmd.bind_to_random_port(f"tcp://{args.host}")
        self.cmd_endpoint = f"tcp://{args.host}:{port}"
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(args.router)
        from epd.transfer.nixl_transport import NixlTransport

        self.transport = NixlTransport(args.instance_id)
        self.peers: dict[str, PeerInfo] = {}
        self.running = True
        from epd.metrics import get_metrics

        self.metrics = get_metrics()
        self.labels = {"pool": self.role, "instance": self.instance_id}
        self._counted: dict[str, float] = {}
        self._last_hb: Heartbeat | None = None
        self._last_tick = time.monotonic()
        self._frozen_at = 0.0
        self._hb_seq = 0
        spec = os.environ.get("EPD_INJECT_HANDLER_ERROR", "")  # read once: handle() runs per message
        self._inject: tuple[str, str, int] | None = None
        if spec:
            kind_name, fault, count = spec.split(":")
            self._inject = (kind_name, fault, int(count))
        self._injected = 0  # faults injected so far
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None

    # ---- messaging --------------------------------------------------------------
    def send(self, msg: Message) -> None:
        self.out.send(encode(msg))

    def announce(self, regions: list[Region], kv_layout=None) -> None:
        """Tell the router this worker is ready, and start heartbeating right away (the
        router counts a worker silent for 2 s after WorkerReady as dead)."""
        self.send(WorkerReady(self.role, self.instance_id, os.getpid(), self.cmd_endpoint, self.transport.metadata(),
                              regions, kv_layout, time.monotonic() - self.t0))
        self.load()  # the first load report, which the heartbeat thread repeats until the loop runs
        self._start_heartbeats()

    def _start_heartbeats(self) -> None:
        if self._beat_thread is None:
            self._last_tick = time.monotonic()
            self._beat_thread = threading.Thread(target=self._beat_loop, name="epd-heartbeat", daemon=True)
            self._beat_thread.start()

    # ---- liveness ---------------------------------------------------------------------
    def _beat_loop(self) -> None:
        """Heartbeat thread: repeats the main loop's latest load report every
        ``HEARTBEAT_S`` on its own socket, so a long engine step (a big prefill
        chunk, a Whisper pass) never looks like a dead worker, while a killed or
        frozen process goes silent. Notes when the process itself was frozen."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.args.router)
        try:
            while not self._beat_stop.wait(HEARTBEAT_S):
                now = time.monotonic()
                if now - self._last_tick > FREEZE_S:
                    self._frozen_at = now
                self._last_tick = now
                hb = self._last_hb
                if hb is not None:
                    try:
                        sock.send(encode(hb), zmq.NOBLOCK)
                    except zmq.Again:  # router not reachable right now: the next beat tries again
                        pass
        except zmq.ZMQError:  # context terminated: the worker is closing
            pass
        finally:
            sock.close(0)

    def frozen_since(self, t: float) -> bool:
        """True when the process was frozen for more than ``FREEZE_S`` after monotonic
        time ``t`` (or is only now waking up from it): work begun before then may have
        been retried elsewhere by the router and must not touch a peer any more."""
        return self._frozen_at > t or time.monotonic() - self._last_tick > FREEZE_S

    def _inject_fault(self, msg: Message) -> None:
        """Fault injection for the error-attribution tests: ``EPD_INJECT_HANDLER_ERROR`` =
        ``<message type>:<internal|capacity>:<count>`` makes handling the first ``count``
        messages of that type raise ``InternalError`` / ``CapacityError`` here."""
        if self._inject is None:
            return
        kind_name, fault, count = self._inject
        if type(msg).__name__ != kind_name or self._injected >= count:
            return
        self._injected += 1
        from epd.errors import InternalError

        raise (CapacityError if fault == "capacity" else InternalError)(f"injected {fault} fault")

    def handle(self, msg: Message) -> None:
        self._inject_fault(msg)
        if isinstance(msg, PeerInfo):
            old = self.peers.get(msg.instance_id)
            if old is None or old.nixl_metadata != msg.nixl_metadata:  # new, or restarted under the same id
                if old is not None:  # NIXL refuses a second agent under one name: drop the dead one first
                    self.transport.remove_peer(msg.instance_id)
                    self.peer_gone(old.instance_id, old.pid)  # a restart replaced that process
                self.transport.add_peer(msg.nixl_metadata, msg.regions)
            self.peers[msg.instance_id] = msg
        elif isinstance(msg, PeerGone):
            self.peer_gone(msg.instance_id, msg.pid)
        elif isinstance(msg, Abort):
            self.on_abort(msg)
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, StatsRequest):
            self.send(WorkerStats(self.instance_id, msg.token, self.stats()))
        else:
            self.handle_role(msg)

    # ---- role hooks -----------------------------------------------------------------
    def handle_role(self, msg: Message) -> None:
        logger.warning("%s ignores %s", self.role, type(msg).__name__)

    def has_work(self) -> bool:
        return False

    def step(self) -> None:
        pass

    def poll(self) -> None:
        pass

    def fail(self, request_id: str, exc: BaseException, *, kind: str = "", prefix: str = "") -> None:
        """Tell the router ``request_id`` failed here with ``exc``, saying who failed
        (``epd.errors.error_status``: 400 the request, 503 capacity, 500 epd) and whether
        another instance may succeed (transfer and capacity failures)."""
        from epd.transfer.nixl_transport import TransferError

        msg = str(exc) if isinstance(exc, (ValueError, CapacityError, TransferError)) else f"{type(exc).__name__}: {exc}"
        self.send(RequestFailed(request_id, self.instance_id, prefix + msg,
                                retryable=isinstance(exc, (TransferError, CapacityError)), kind=kind,
                                status=error_status(exc)))

    def peer_gone(self, instance_id: str, pid: int) -> None:
        """The process ``pid`` of peer ``instance_id`` exited (nothing it sent can still land)."""

    def on_abort(self, msg: Abort) -> None:
        """The router's ``Abort``: by default, ``abort(msg.request_id)``."""
        self.abort(msg.request_id)

    def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def observe(self, name: str, value: float) -> None:
        """Histogram ``name`` of ``epd.metrics.Metrics``, labelled with this worker."""
        getattr(self.metrics, name).labels(**self.labels).observe(value)

    def count(self, name: str, value: float = 1.0) -> None:
        if value > 0:
            getattr(self.metrics, name).labels(**self.labels).inc(value)

    def count_total(self, name: str, total: float) -> None:
        """Advance counter ``name`` to a running ``total`` kept elsewhere (engine stats)."""
        self.count(name, total - self._counted.get(name, 0.0))
        self._counted[name] = total

    def update_metrics(self, stats: dict[str, float]) -> None:
        """Gauges and counters from engine stats, once per heartbeat."""
        if "num_blocks" in stats:
            m = self.metrics
            m.kv_cache_usage_ratio.labels(**self.labels).set(stats.get("kv_cache_usage", 0.0))
            m.queue_depth.labels(**self.labels).set(stats.get("num_waiting", 0))
            m.running_requests.labels(**self.labels).set(stats.get("num_running", 0))
            self.count_total("preemptions", stats.get("num_preemptions", 0))
            self.count_total("prefix_cache_queries_tokens", stats.get("prefix_cache_queries", 0))
            self.count_total("prefix_cache_hits_tokens", stats.get("prefix_cache_hits", 0))

    def load(self) -> Heartbeat:
        s = self.stats()
        self.update_metrics(s)
        self._hb_seq += 1  # numbered, so the router can tell a stale repeat from a newer report
        hb = Heartbeat(self.instance_id, int(s.get("num_running", 0)), int(s.get("num_waiting", 0)),
                       int(s.get("num_free_blocks", 0)), int(s.get("num_blocks", 0)), seq=self._hb_seq)
        self._last_hb = hb  # the heartbeat thread repeats it (same number) while the loop is busy
        return hb

    # ---- loop -----------------------------------------------------------------------
    def run(self) -> None:
        def _stop(signum, frame):
            self.running = False

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        last_hb = 0.0
        self._start_heartbeats()
        try:
            while self.running:
                busy = self.has_work()
                if self.cmd.poll(0 if busy else 2):
                    self._drain()
                self.poll()
                if self.has_work():
                    self.step()
                now = time.monotonic()
                if now - last_hb >= HEARTBEAT_S:
                    self.send(self.load())
                    last_hb = now
        finally:
            self.close()

    def _drain(self) -> None:
        while True:
            try:
                data = self.cmd.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(data)
            except MessageError as e:
                logger.warning("%s dropped a malformed command: %s", self.instance_id, e)
                continue
            try:
                self.handle(msg)
            except Exception as e:  # one bad request must not take the worker down
                logger.exception("%s failed handling %s", self.instance_id, type(msg).__name__)
                rid = getattr(msg, "request_id", None)
                if rid is not None:
                    self.abort(rid)
                    self.fail(rid, e)

    def close(self) -> None:
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(2 * HEARTBEAT_S + 1)
        try:
            self.transport.close()
        finally:
            self.cmd.close(0)
            self.out.close()
            self.ctx.term()
