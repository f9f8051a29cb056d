"""The worker process loop shared by every role: commands in, engine steps, NIXL polls, heartbeats.

A worker binds one ZeroMQ PULL socket for commands on its advertised address
(loopback by default) and pushes everything it reports to the router's PULL
socket; with cluster keys both are CURVE-authenticated (``epd.cluster_auth``): the
command socket admits the router's key only, and the worker reports with the member key.
Messages are the typed structs of ``epd.messages`` (msgpack, never pickle). The
loop is single threaded: drain commands, poll NIXL, run one engine step when
there is work, send a heartbeat every ``HEARTBEAT_S``.

Membership (see docs/architecture.md, "Membership"):

- **joining**: ``WorkerReady`` is repeated every ``REGISTER_RETRY_S`` until the
  router answers ``Registered`` (its epoch); ``RegistrationRefused`` (a live process
  holds the instance id) is logged and asked again, so a restarted process joins
  once its predecessor is found dead; a worker is *ready* (``/health`` of
  ``--http-port``) while registered;
- **router lost**: the router pings every worker (``RouterPing``); a registered
  worker that has read no ping for ``router_timeout_s`` (checked only right after
  reading every queued command, so a long engine step never looks like a lost
  router) aborts everything the old router gave it (no block or buffer leaks;
  see ``router_lost``) and joins again, so a restarted router gets it back;
- **drain**: SIGTERM tells the router ``Draining`` (it routes nothing new here and
  migrates a decode worker's streams), the worker finishes what it holds within
  ``drain_timeout_s`` and exits 0; a second SIGTERM (or SIGINT) stops at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from epd.cluster_auth import ClusterKeys
from epd.errors import CapacityError, InternalError, error_status
from epd.messages import (
    ROUTER_TIMEOUT_S,
    Abort,
    Draining,
    Heartbeat,
    Message,
    MessageError,
    PeerGone,
    PeerInfo,
    Region,
    Registered,
    RegistrationRefused,
    RequestFailed,
    RouterPing,
    Shutdown,
    StatsRequest,
    WorkerReady,
    WorkerStats,
    decode,
    encode,
    request_id_of,
)
from epd.roles import Role

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
#: A heartbeat-thread tick later than this means the whole process was frozen
#: (SIGSTOP, a suspended VM): the router, whose liveness timeout is 2 s, may have
#: declared it dead and retried its requests elsewhere, so in-flight work is fenced.
FREEZE_S = 1.5
#: seconds between two WorkerReady while the router has not answered
REGISTER_RETRY_S = 1.0
#: default ``--stall-timeout``: seconds the main loop may spend in one iteration (the
#: longest engine step, a Whisper pass) before the worker counts as wedged
STALL_TIMEOUT_S = 60.0


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
    embedding_ttl_s: float = 1.0  # an encoder reclaims embeddings this long after the router ended their request
    embedding_buffer_mb: int = 256
    kv_staging_mb: int = 0  # staging pool for heterogeneous-TP KV transfers (0: none)
    kv_agents: str = "rank0"  # "rank0" | "per-rank": NIXL agents of a TP instance (epd.transfer.rank_agent)
    keys: ClusterKeys | None = None  # CURVE keys of the cluster (None: no authentication, loopback only)
    http_port: int = 0  # /health and /metrics on host:http_port (0: none)
    drain_timeout_s: float = 30.0  # SIGTERM: seconds to finish what the worker holds
    router_timeout_s: float = ROUTER_TIMEOUT_S  # no RouterPing read for this long: the router is lost
    stall_timeout_s: float = STALL_TIMEOUT_S  # main loop without an iteration this long: wedged (0: never judged)
    early_signals: list[int] = field(default_factory=list)  # SIGTERM/SIGINT caught before the worker existed


class BaseWorker:
    """Subclasses set up their engine, call ``announce`` and implement
    ``handle_role`` / ``has_work`` / ``step`` / ``poll`` / ``abort`` / ``stats``."""

    role: str = "base"  # subclasses: their Role

    def __init__(self, args: WorkerArgs) -> None:
        self.t0 = time.monotonic()
        self.args = args
        self.instance_id = args.instance_id
        self.budget = None
        if args.threads:
            torch.set_num_threads(args.threads)
        elif args.tp == 1 and not torch.cuda.is_available():
            from epd.workers.thread_budget import ThreadBudget

            try:
                self.budget = ThreadBudget()
            except (OSError, RuntimeError) as e:
                logger.warning("no thread budget (%s): torch keeps its default threads", e)
        self.ctx = zmq.Context()
        self._auth = (args.keys.start_authenticator(self.ctx, self._count_denied) if args.keys is not None
                      else None)  # admits the router's key only: no other member can command this worker
        self.cmd = self.ctx.socket(zmq.PULL)
        if args.keys is not None:
            args.keys.server(self.cmd)
        port = self.cmd.bind_to_random_port(f"tcp://{_zmq_host(args.host)}")
        self.cmd_endpoint = f"tcp://{_zmq_host(args.host)}:{port}"
        self.out = self.router_socket()
        self.out.setsockopt(zmq.LINGER, 2000)
        from epd.transfer.nixl_transport import NixlTransport

        self.transport = NixlTransport(args.instance_id)
        self.peers: dict[str, PeerInfo] = {}
        self.running = True
        from epd.metrics import get_metrics

        self.metrics = get_metrics()
        self.labels = {"pool": self.role, "instance": self.instance_id}
        for name in ("auth_denied", "transfers_unterminated"):  # at 0 from the start, so alerts on them have data
            getattr(self.metrics, name).labels(**self.labels)
        self._counted: dict[str, float] = {}
        self._last_hb: Heartbeat | None = None
        self._last_tick = time.monotonic()
        self._frozen_at = 0.0
        self._loop = 0  # main-loop iterations: the progress every heartbeat carries
        self._loop_at = time.monotonic()  # when the main loop last began an iteration
        self._hb_seq = 0
        # Fault injection for the migration tests: every step of this worker takes this many
        # seconds longer, as on a slow or overloaded host, so a test acts while it is still
        # generating (the client, not the worker, is what lags on a busy test machine).
        self._inject_step_delay_s = float(os.environ.get("EPD_INJECT_STEP_DELAY_S", "0") or 0)
        spec = os.environ.get("EPD_INJECT_HANDLER_ERROR", "")  # read once: handle() runs per message
        self._inject: tuple[str, str, int] | None = None
        if spec:
            kind_name, fault, count = spec.split(":")
            self._inject = (kind_name, fault, int(count))
        self._injected = 0  # faults injected so far
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._ready_msg: WorkerReady | None = None
        self.epoch: int | None = None  # the epoch of the router this worker is registered with
        self._router_seen = 0.0  # monotonic time of the last Registered / RouterPing read
        self._last_ready_sent = 0.0
        self.draining = False
        self._drain_deadline = 0.0
        self._signals = 0
        self.exit_code = 0
        self._unreachable_logged = 0.0
        self._http = None
        if threading.current_thread() is threading.main_thread():  # from the start: SIGTERM while loading drains too
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
            for signum in args.early_signals:  # caught by ``epd worker`` while this was importing
                self._on_signal(signum, None)
        if args.http_port:
            from epd.workers.health_server import HealthServer

            self._http = HealthServer(self, args.host, args.http_port)

    def _count_denied(self) -> None:
        """A CURVE client that is not the router was refused at the command socket (ZAP thread)."""
        from epd.metrics import get_metrics

        get_metrics().auth_denied.labels(pool=self.role, instance=self.instance_id).inc()

    # ---- messaging --------------------------------------------------------------
    def router_socket(self) -> zmq.Socket:
        """A PUSH socket connected to the router (a CURVE client with cluster keys)."""
        sock = self.ctx.socket(zmq.PUSH)
        if self.args.keys is not None:
            self.args.keys.client(sock)
        sock.connect(self.args.router)
        return sock

    def send(self, msg: Message) -> None:
        """Push ``msg`` to the router; never blocks. While no router connection is up
        (the router is down, or the handshake fails: other keys) it is dropped, with a
        warning every 10 s naming what to check; a lost router is noticed from its
        pings (``router_lost``), and the requests it had fail over on its side."""
        try:
            self.out.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            now = time.monotonic()
            if now - self._unreachable_logged > 10.0:
                self._unreachable_logged = now
                logger.warning("%s: no connection to the router at %s (is it up? same --cluster-keys?); "
                               "dropped %s", self.instance_id, self.args.router, type(msg).__name__)

    def announce(self, regions: list[Region], kv_layout=None) -> None:
        """Tell the router this worker is ready (repeated until it answers), and start
        heartbeating right away (the router counts a worker silent for 2 s as dead)."""
        engine = getattr(self, "engine", None)
        self._ready_msg = WorkerReady(self.role, self.instance_id, os.getpid(), self.cmd_endpoint,
                                      self.transport.metadata(), regions, kv_layout, time.monotonic() - self.t0,
                                      incarnation=secrets.randbits(63) or 1, model=self._model_fingerprint(),
                                      max_model_len=engine.config.max_model_len if engine is not None else 0,
                                      stall_timeout_s=self.args.stall_timeout_s,
                                      num_tier_blocks=engine.block_manager.num_tier_blocks if engine is not None else 0)
        self._send_ready()
        self.load()  # the first load report, which the heartbeat thread repeats until the loop runs
        self._start_heartbeats()

    def _model_fingerprint(self) -> str:
        from epd.models.checkpoints import model_fingerprint, resolve_model

        return model_fingerprint(resolve_model(self.args.model))

    def _send_ready(self) -> None:
        if not self._last_ready_sent:
            engine = getattr(self, "engine", None)
            dtype = f", {str(engine.config.torch_dtype).removeprefix('torch.')}" if engine is not None else ""
            if engine is not None:
                cfg = engine.config
                if cfg.quantization:
                    dtype += f", {cfg.quantization} weights"
                kv = cfg.kv_cache_dtype if cfg.kv_quant else str(cfg.torch_dtype).removeprefix("torch.")
                dtype += (f", KV cache {kv}: {engine.runner.num_blocks} blocks of {cfg.block_size} tokens, "
                          f"{2**30 // cfg.kv_bytes_per_block()} blocks/GiB")
            print(f"epd worker {self.instance_id} ({self.role}{dtype}, pid {os.getpid()}): commands on "
                  f"{self.cmd_endpoint}{', authenticated' if self.args.keys else ''}; joining {self.args.router}",
                  flush=True)
        self._last_ready_sent = time.monotonic()
        self.send(self._ready_msg)

    @property
    def registered(self) -> bool:
        """A router has accepted this worker and has not been lost since."""
        return self.epoch is not None

    def _start_heartbeats(self) -> None:
        if self._beat_thread is None:
            self._last_tick = self._loop_at = time.monotonic()
            self._beat_thread = threading.Thread(target=self._beat_loop, name="epd-heartbeat", daemon=True)
            self._beat_thread.start()

    # ---- liveness ---------------------------------------------------------------------
    def _beat_loop(self) -> None:
        """Heartbeat thread: repeats the main loop's latest load report every
        ``HEARTBEAT_S`` on its own socket, with the loop's current iteration count,
        so a long engine step (a big prefill chunk, a Whisper pass) never looks like a
        dead worker, a killed or frozen process goes silent, and a wedged main loop
        shows as a count that stops (the router judges it by ``stall_timeout_s``).
        Notes when the process itself was frozen, or its loop stalled: work begun
        before then may have been retried elsewhere (``frozen_since``)."""
        sock = self.router_socket()
        sock.setsockopt(zmq.LINGER, 0)
        try:
            while not self._beat_stop.wait(HEARTBEAT_S):
                now = time.monotonic()
                if now - self._last_tick > FREEZE_S or self.loop_stalled(now):
                    self._frozen_at = now
                self._last_tick = now
                hb = self._last_hb
                if hb is not None:
                    try:
                        sock.send(encode(msgspec.structs.replace(hb, loop=self._loop)), zmq.NOBLOCK)
                    except zmq.Again:  # router not reachable right now: the next beat tries again
                        pass
        except zmq.ZMQError:  # context terminated: the worker is closing
            pass
        finally:
            sock.close(0)

    def loop_stalled(self, now: float | None = None) -> bool:
        """The main loop has begun no iteration for over ``stall_timeout_s`` (a hung
        handler or step): the router routes nothing here and ``/live`` answers 503."""
        limit = self.args.stall_timeout_s
        return limit > 0 and (time.monotonic() if now is None else now) - self._loop_at > limit

    def frozen_since(self, t: float) -> bool:
        """True when the process was frozen for more than ``FREEZE_S`` after monotonic
        time ``t`` (or is only now waking up from it): work begun before then may have
        been retried elsewhere by the router and must not touch a peer any more."""
        return self._frozen_at > t or time.monotonic() - self._last_tick > FREEZE_S

    def _inject_fault(self, msg: Message) -> None:
        """Fault injection for the failure tests: ``EPD_INJECT_HANDLER_ERROR`` =
        ``<message type>:<internal|capacity|stall>:<count>`` makes handling the first
        ``count`` messages of that type raise ``InternalError`` / ``CapacityError`` here,
        or (``stall``) block the main loop, as a hung handler would, until a signal
        (the heartbeat thread goes on beating)."""
        if self._inject is None:
            return
        kind_name, fault, count = self._inject
        if type(msg).__name__ != kind_name or self._injected >= count:
            return
        self._injected += 1
        if fault == "stall":
            logger.warning("%s: injected stall: the main loop blocks handling %s", self.instance_id, kind_name)
            while self.running and not self._signals:
                time.sleep(0.05)
            return
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
                self.transport.add_peer(msg.nixl_metadata, msg.regions, msg.instance_id)
                self.peer_added(msg)
            self.peers[msg.instance_id] = msg
        elif isinstance(msg, PeerGone):
            self.peer_gone(msg.instance_id, msg.pid)
        elif isinstance(msg, Abort):
            self.on_abort(msg)
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, Registered):
            if msg.instance_id == self.instance_id:
                if self.epoch is None:
                    logger.info("%s registered with router epoch %x", self.instance_id, msg.epoch)
                self.epoch = msg.epoch
                self._router_seen = time.monotonic()
        elif isinstance(msg, RouterPing):
            if msg.epoch == self.epoch:
                self._router_seen = time.monotonic()
        elif isinstance(msg, RegistrationRefused):
            # Keep asking: a restarted process is refused until the router finds its predecessor
            # dead (a heartbeat timeout); a real duplicate stays refused (and never ready).
            if msg.instance_id == self.instance_id and self.epoch is None:
                if msg.permanent:
                    print(f"epd worker {self.instance_id}: the router refused it: {msg.reason}", flush=True)
                    self.exit_code = 1
                    self.running = False
                else:
                    logger.error("%s: the router refused this worker (asking again in %.0f s): %s",
                                 self.instance_id, REGISTER_RETRY_S, msg.reason)
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

        plain = isinstance(exc, (ValueError, CapacityError, TransferError))
        msg = str(exc) if plain else f"{type(exc).__name__}: {exc}"
        self.send(RequestFailed(request_id, self.instance_id, prefix + msg,
                                retryable=isinstance(exc, (TransferError, CapacityError)), kind=kind,
                                status=error_status(exc)))

    def peer_added(self, msg: PeerInfo) -> None:
        """A new peer (or a restarted one) was loaded into this worker's agent."""

    def peer_gone(self, instance_id: str, pid: int) -> None:
        """The process ``pid`` of peer ``instance_id`` exited (nothing it sent can still land)."""

    def on_abort(self, msg: Abort) -> None:
        """The router's ``Abort``: by default, ``abort(msg.request_id)``."""
        self.abort(msg.request_id)

    def abort(self, request_id: str) -> None:
        pass

    def in_flight(self) -> set[str]:
        """Request ids this worker holds anything for (queued, running, blocks, buffers)."""
        return set()

    def router_lost(self) -> None:
        """The router that gave this worker its requests is gone: abort every one of them
        (the default: ``abort`` each of ``in_flight``), freeing what they hold."""
        for rid in self.in_flight():
            self.abort(rid)

    def stats(self) -> dict[str, float]:
        return {}

    def observe(self, name: str, value: float) -> None:
        """Histogram ``name`` of ``epd.metrics.Metrics``, labelled with this worker."""
        getattr(self.metrics, name).labels(**self.labels).observe(value)

    def count(self, name: str, value: float = 1.0) -> None:
        if value > 0:
            getattr(self.metrics, name).labels(**self.labels).inc(value)

    def count_total(self, name: str, total: float) -> None:
        """Advance counter ``name`` to a running ``total`` kept elsewhere (engine stats). Its
        series exists from the first call, at 0 until the total moves (so a rate over it
        is 0, not missing)."""
        if name not in self._counted:
            getattr(self.metrics, name).labels(**self.labels)
        self.count(name, total - self._counted.get(name, 0.0))
        self._counted[name] = total

    def update_metrics(self, stats: dict[str, float]) -> None:
        """Gauges and counters from this worker's ``stats()``, once per heartbeat (each
        worker kind adds its own)."""

    def load(self) -> Heartbeat:
        s = self.stats()
        self.update_metrics(s)
        self._hb_seq += 1  # numbered, so the router can tell a stale repeat from a newer report
        hb = Heartbeat(self.instance_id, int(s.get("num_running", 0)), int(s.get("num_waiting", 0)),
                       int(s.get("num_free_blocks", 0)), int(s.get("num_blocks", 0)), seq=self._hb_seq,
                       loop=self._loop, incarnation=self._ready_msg.incarnation if self._ready_msg else 0)
        self._last_hb = hb  # the heartbeat thread repeats it (same number) while the loop is busy
        return hb

    # ---- loop -----------------------------------------------------------------------
    def run(self) -> int:
        """The loop, until Shutdown, a signal or the end of a drain. Returns the exit code (0)."""

        last_hb = 0.0
        self._start_heartbeats()
        if self._http is not None:
            self._http.start()
        try:
            while self.running:
                self._loop += 1  # progress the heartbeats carry: a wedged loop stops counting
                self._loop_at = time.monotonic()
                busy = self.has_work()
                if self.cmd.poll(0 if busy else 2):  # (milliseconds)
                    self._drain()
                self._check_router()  # right after reading every queued command
                self.transport.progress()  # what this agent posted (notifications) leaves only as UCX progresses
                self.poll()
                if self.has_work():
                    if self.budget is not None:
                        self.budget.acquire()
                    self.step()
                    if self._inject_step_delay_s:
                        time.sleep(self._inject_step_delay_s)
                elif self.budget is not None:
                    self.budget.release()
                now = time.monotonic()
                if now - last_hb >= HEARTBEAT_S:
                    self.send(self.load())
                    last_hb = now
                if self.draining:
                    self._drain_step(now)
        finally:
            self.close()
        return self.exit_code

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        if signum == signal.SIGTERM and self._signals == 1 and self.args.drain_timeout_s > 0:
            self.draining = True  # the loop tells the router and finishes what it holds
        else:
            self.running = False

    def _check_router(self) -> None:
        """Join (again) while unregistered; notice a lost router."""
        now = time.monotonic()
        if self._ready_msg is None:
            return
        if self.epoch is not None and now - self._router_seen > self.args.router_timeout_s:
            held = self.in_flight()
            logger.warning("%s: no word from the router (epoch %x) for %.1f s: aborting %d request(s) and "
                           "joining again", self.instance_id, self.epoch, now - self._router_seen, len(held))
            self.epoch = None
            self.router_lost()
        if self.epoch is None and not self.draining and now - self._last_ready_sent >= REGISTER_RETRY_S:
            self._send_ready()

    def _drain_step(self, now: float) -> None:
        """Draining: tell the router once, stop when nothing is held or at the deadline."""
        if not self._drain_deadline:
            self._drain_deadline = now + self.args.drain_timeout_s
            logger.warning("%s: SIGTERM: draining %d request(s) (at most %.0f s)", self.instance_id,
                           len(self.in_flight()), self.args.drain_timeout_s)
            self.send(Draining(self.instance_id, os.getpid()))
        held = self.in_flight()
        if not held:
            logger.warning("%s: drained in %.2f s", self.instance_id,
                           now - (self._drain_deadline - self.args.drain_timeout_s))
            self.running = False
        elif now >= self._drain_deadline:
            logger.warning("%s: drain timeout: aborting %d request(s)", self.instance_id, len(held))
            for rid in held:
                self.abort(rid)
                self.fail(rid, CapacityError(f"{self.instance_id} shut down (drain timeout)"))
            self.running = False

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
                rid = request_id_of(data)
                if rid is not None:  # the router must not wait for it: it fails now (500, ours)
                    self.fail(rid, InternalError(f"{self.instance_id} could not read its command: {e}"))
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
        if self.budget is not None:
            self.budget.close()
        self._beat_stop.set()
        if self._http is not None:
            self._http.stop()
        if self._beat_thread is not None:
            self._beat_thread.join(2 * HEARTBEAT_S + 1)
        try:
            self.transport.close()
        finally:
            self.cmd.close(0)
            self.out.close()
            if self._auth is not None:
                self._auth.stop()
            self.ctx.term()


def _zmq_host(host: str) -> str:
    """``host`` as a ZeroMQ tcp endpoint takes it (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
