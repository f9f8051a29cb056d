"""Process supervisor of ``epd launch``: one worker process per instance, none left behind.

:class:`Launcher` turns a launch plan (:func:`epd.launch.spec.build_launch_plan`)
into processes: a pool of ``devices`` devices with TP ``tp`` is ``devices // tp``
instances ``<role>-<i>``, each of ``tp`` consecutive devices. The launcher starts each
instance's rank 0, which starts ranks 1..tp-1 itself (its engine's ModelRunner
processes, which die with it by PDEATHSIG and share its staging memory)::

    python -m epd.cli worker --role prefill --instance-id prefill-0 --rank 0 --tp 4 \\
        --router tcp://127.0.0.1:5555 --model DIR --threads 1 [extra args]

:func:`supervise` restarts the instances whose process exits while serving.

No orphans, three ways:

* every child gets ``PR_SET_PDEATHSIG = SIGTERM`` (Linux), so the kernel terminates
  it when the launcher dies, even by SIGKILL. The signal fires when the *thread*
  that spawned the child exits, so call :meth:`Launcher.start` from the main
  thread (or one that lives as long as the launcher);
* :meth:`Launcher.stop` sends SIGTERM, waits, SIGKILLs stragglers and their
  descendants (found with psutil when installed), and reaps every child;
* children ignore SIGINT: Ctrl-C in the terminal reaches the whole foreground
  process group, but only the launcher acts on it (drain, then SIGTERM the
  workers), so workers don't die mid-request with a KeyboardInterrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from epd.launch.spec import LaunchSpecError, PoolSpec
from epd.roles import Role

__all__ = ["WorkerProcess", "Launcher", "default_threads_per_worker", "host_cores", "worker_argv", "supervise"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: seconds between :func:`supervise`'s checks for exited workers
MONITOR_S = 0.25


@dataclass
class WorkerProcess:
    """One worker process: rank 0 of one instance (it starts the instance's other ranks).

    Attributes:
        role: the instance's pool (:class:`~epd.roles.Role`).
        instance_id: e.g. "prefill-0".
        rank: TP rank inside the instance (0: the launcher starts rank 0 only).
        popen: the running process.
        argv: its command line (reused by :meth:`Launcher.restart`).
        tp: TP size of the instance.
        device_index: the instance's first device, 0..total devices-1, in launch order.
        returncode: exit status once reaped (negative: killed by that signal).
    """

    role: Role
    instance_id: str
    rank: int
    popen: subprocess.Popen
    argv: list[str]
    tp: int = 1
    device_index: int = 0
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def describe(self) -> str:
        """``"prefill-0 rank 0 (pid 1234)"``, plus how it exited when it did."""
        s = f"{self.instance_id} rank {self.rank} (pid {self.pid})"
        rc = self.returncode
        if rc is not None:
            if rc < 0:
                try:
                    sig = signal.Signals(-rc).name
                except ValueError:
                    sig = f"signal {-rc}"
                s += f" killed by {sig}"
            else:
                s += f" exited with status {rc}"
        return s


@dataclass(frozen=True)
class _Slot:
    """One instance of the plan: the process the launcher starts for it (its rank 0)."""

    role: Role
    instance_id: str
    tp: int
    device_index: int  # the instance's first device


WorkerCmd = Sequence[str] | Callable[[str, str, int, int], Sequence[str]]


def host_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads_per_worker(num_processes: int) -> int:
    """CPU threads per worker: the usable cores shared evenly, at least 1.

    Uses the process's CPU affinity when available (containers and ``taskset`` often
    allow fewer cores than ``os.cpu_count()`` reports), else ``os.cpu_count()``.
    """
    return max(1, host_cores() // max(1, num_processes))


def worker_argv(role: Role | str, instance_id: str, rank: int, tp: int, *, router_endpoint: str, model: str | None,
                threads: int | None, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one worker process (``python -m epd.cli worker ...``);
    ``threads`` None omits ``--threads`` (the worker shares the host's cores by who has
    work, ``epd.workers.thread_budget``)."""
    argv = [sys.executable, "-m", "epd.cli", "worker", "--role", str(role), "--instance-id", instance_id,
            "--rank", str(rank), "--tp", str(tp), "--router", router_endpoint]
    if model:
        argv += ["--model", str(model)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return argv + list(extra)


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        lib.prctl.restype = ctypes.c_int
        lib.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.signal.restype = ctypes.c_void_p
        return lib
    except (OSError, AttributeError):
        return None


class Launcher:
    """Starts, watches and stops the worker processes of a launch plan.

    Args:
        plan: pools from :func:`epd.launch.spec.build_launch_plan`.
        model: model directory (or default-model name) passed to every worker; None omits ``--model``.
        router_endpoint: the router's ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:5555``.
        threads_per_worker: fixed torch threads per worker process (also exported as
            ``OMP_NUM_THREADS``); None: the thread budget (``epd.workers.thread_budget``:
            each single-rank worker uses ``cores // busy workers`` threads, step by step),
            and the ranks of a tensor-parallel instance a fixed even share
            (:func:`default_threads_per_worker`).
        extra_worker_args: appended to every worker's command line.
        env: base environment of the workers (default: this process's, read at
            :meth:`start`, so ``$PROMETHEUS_MULTIPROC_DIR`` set before is inherited).
        worker_cmd: tests only: a fixed argv for every worker, or a callable
            ``(role, instance_id, rank, tp) -> argv``, instead of ``epd worker``.
        log_dir: when set, each worker's stdout+stderr go to
            ``<log_dir>/<instance_id>-rank0.log`` instead of this process's.
        ignore_sigint_in_children: children ignore SIGINT (see module doc).
    """

    def __init__(self, plan: list[PoolSpec], *, model: str | None, router_endpoint: str,
                 threads_per_worker: int | None, extra_worker_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, worker_cmd: WorkerCmd | None = None,
                 log_dir: str | os.PathLike | None = None, ignore_sigint_in_children: bool = True):
        self.plan = list(plan)
        self.model = model
        self.router_endpoint = router_endpoint
        self.extra_worker_args = list(extra_worker_args)
        self.env = dict(env) if env is not None else None
        self.worker_cmd = worker_cmd
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.ignore_sigint_in_children = ignore_sigint_in_children
        self.slots = self._layout(self.plan)
        self.threads_per_worker = threads_per_worker
        # every device runs one rank (a process), the ones rank 0 starts included
        self.even_share = default_threads_per_worker(sum(pool.devices for pool in self.plan))
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise LaunchSpecError(f"threads per worker must be >= 1, got {threads_per_worker}")
        self.workers: list[WorkerProcess] = []  # every process started, exited ones included
        self._reported: set[int] = set()  # pids poll_dead has returned
        self._lock = threading.RLock()  # reentrant: a signal handler may call stop() inside start()
        self._stopping = False
        self._stopped = False
        self._libc = _libc()
        self._parent_pid = os.getpid()
        self._signals_seen = 0

    # ---------------------------------------------------------------- layout
    @staticmethod
    def _layout(plan: list[PoolSpec]) -> list[_Slot]:
        """One slot per instance, in launch order."""
        slots, dev = [], 0
        for pool in plan:
            tp = 1 if pool.role in (Role.ENCODE, Role.TTS) else pool.tp
            if pool.devices % tp:
                raise LaunchSpecError(f"TP {tp} does not divide the {pool.devices} devices of the {pool.role} pool")
            for i in range(pool.devices // tp):
                slots.append(_Slot(pool.role, f"{pool.role}-{i}", tp, dev))
                dev += tp
        return slots

    @property
    def num_processes(self) -> int:
        """Processes the launcher starts: one per instance."""
        return len(self.slots)

    def _argv(self, slot: _Slot) -> list[str]:
        if self.worker_cmd is None:
            return worker_argv(slot.role, slot.instance_id, 0, slot.tp, router_endpoint=self.router_endpoint,
                               model=self.model, threads=self._threads(slot), extra=self.extra_worker_args)
        if callable(self.worker_cmd):
            return list(self.worker_cmd(slot.role, slot.instance_id, 0, slot.tp))
        return list(self.worker_cmd)

    def _threads(self, slot: _Slot) -> int | None:
        """``--threads`` of ``slot``'s process: the fixed setting, else None (the thread
        budget) for a single-rank instance and the even share for a TP instance's ranks."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        return self.even_share if slot.tp > 1 else None

    def _child_env(self, slot: _Slot) -> dict[str, str]:
        env = dict(os.environ if self.env is None else self.env)
        threads = self._threads(slot)
        n = str(threads if threads is not None else host_cores())
        env.setdefault("OMP_NUM_THREADS", n)
        env.setdefault("MKL_NUM_THREADS", n)
        env["EPD_INSTANCE_ID"] = slot.instance_id
        env["EPD_RANK"] = "0"
        env["EPD_DEVICE_INDEX"] = str(slot.device_index)
        env["EPD_LAUNCHER_PID"] = str(self._parent_pid)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # UCX (under NIXL) listens on every interface unless told otherwise; the
        # pools talk over loopback by default, so keep the data plane there too.
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        return env

    def _preexec(self) -> Callable[[], None] | None:
        libc = self._libc
        if libc is None:
            return None
        parent = os.getpid()
        ignore_int = self.ignore_sigint_in_children

        def preexec() -> None:  # runs in the child between fork and exec: async-signal-safe calls only
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if ignore_int:
                libc.signal(signal.SIGINT, 1)  # SIG_IGN survives exec; Python then skips KeyboardInterrupt
            if os.getppid() != parent:  # the launcher died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

        return preexec

    def _spawn(self, slot: _Slot, argv: list[str] | None = None) -> WorkerProcess:
        argv = argv or self._argv(slot)
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{slot.instance_id}-rank0.log", "ab")
        try:
            popen = subprocess.Popen(argv, env=self._child_env(slot), stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT if out is not None else None,
                                     preexec_fn=self._preexec(), start_new_session=False, close_fds=True)
        finally:
            if out is not None:
                out.close()
        wp = WorkerProcess(slot.role, slot.instance_id, 0, popen, argv, tp=slot.tp, device_index=slot.device_index)
        logger.info("started %s: %s", wp.describe(), " ".join(argv))
        return wp

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Spawn one process (rank 0) per instance of the plan (call once, from the main thread)."""
        with self._lock:
            if self.workers:
                raise RuntimeError("Launcher.start() was already called")
            if self._stopping:
                raise RuntimeError("Launcher was stopped")
            for slot in self.slots:
                if self._stopping:  # a signal handler stopped us meanwhile
                    break
                self.workers.append(self._spawn(slot))
            if self._stopping:
                self.stop()

    def live_workers(self) -> list[WorkerProcess]:
        """Workers not yet reaped."""
        return [w for w in self.workers if w.returncode is None]

    def _reaped(self, wp: WorkerProcess, rc: int) -> None:
        wp.returncode = rc
        from epd import metrics

        with contextlib.suppress(OSError):
            metrics.mark_process_dead(wp.pid)

    def poll_dead(self) -> list[WorkerProcess]:
        """Workers that exited since the last call (each reported once), reaped."""
        dead = []
        with self._lock:
            for wp in self.workers:
                if wp.returncode is None:
                    rc = wp.popen.poll()
                    if rc is not None:
                        self._reaped(wp, rc)
                if wp.returncode is not None and wp.pid not in self._reported:
                    self._reported.add(wp.pid)
                    dead.append(wp)
        return dead

    def restart(self, wp: WorkerProcess) -> WorkerProcess:
        """Start a new process with ``wp``'s command line (``wp`` must have exited)."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("Launcher is stopping")
            if wp.returncode is None and wp.popen.poll() is None:
                raise RuntimeError(f"{wp.describe()} is still running")
            if wp.returncode is None:
                self._reaped(wp, wp.popen.returncode)
            self._reported.add(wp.pid)
            slot = _Slot(wp.role, wp.instance_id, wp.tp, wp.device_index)
            new = self._spawn(slot, wp.argv)
            self.workers.append(new)
            return new

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every worker, wait up to ``timeout_s``, SIGKILL what is left (and its
        descendants), reap all. Idempotent; safe to call from a signal handler."""
        with self._lock:
            self._stopping = True
            live = self.live_workers()
            if not live:
                self._stopped = True
                return
            descendants = self._descendants(live)
            for wp in live:
                self._signal(wp.popen, signal.SIGTERM)
            deadline = time.monotonic() + max(0.0, timeout_s)
            for wp in live:
                try:
                    rc = wp.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    continue
                self._reaped(wp, rc)
            stragglers = self.live_workers()
            for wp in stragglers:
                logger.warning("%s did not exit within %.1f s of SIGTERM: killing it", wp.describe(), timeout_s)
                self._signal(wp.popen, signal.SIGKILL)
            for wp in stragglers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._reaped(wp, wp.popen.wait(timeout=5.0))
            self._kill_descendants(descendants)
            self._stopped = True

    def kill(self) -> None:
        """SIGKILL every live worker and reap it (the impatient second Ctrl-C)."""
        with self._lock:
            self._stopping = True
            live = self.live_workers()
            descendants = self._descendants(live)
            for wp in live:
                self._signal(wp.popen, signal.SIGKILL)
            for wp in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._reaped(wp, wp.popen.wait(timeout=5.0))
            self._kill_descendants(descendants)

    @staticmethod
    def _signal(popen: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(sig)

    @staticmethod
    def _descendants(live: list[WorkerProcess]) -> list:
        try:
            import psutil
        except ImportError:
            return []
        found = []
        for wp in live:
            with contextlib.suppress(psutil.Error):
                found += psutil.Process(wp.pid).children(recursive=True)
        return found

    @staticmethod
    def _kill_descendants(procs: list) -> None:
        """Workers' own children that outlived them (PDEATHSIG covers only direct children)."""
        if not procs:
            return
        import psutil

        alive = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    alive.append(p)
        psutil.wait_procs(alive, timeout=2.0)

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stopping(self) -> bool:
        """stop() or kill() has begun: exited workers are not restarted any more."""
        return self._stopping

    # ---------------------------------------------------------------- signals
    def install_signal_handlers(self, on_stop: Callable[[], None]) -> None:
        """SIGINT / SIGTERM -> ``on_stop()`` (which should call :meth:`stop` and exit).

        A second signal while ``on_stop`` runs SIGKILLs the workers at once. Must be
        called from the main thread.
        """

        def handler(signum, frame):
            self._signals_seen += 1
            if self._signals_seen == 1:
                logger.warning("received %s: stopping %d workers", signal.Signals(signum).name,
                               len(self.live_workers()))
                on_stop()
            else:
                logger.warning("received %s again: killing workers now", signal.Signals(signum).name)
                self.kill()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)


async def supervise(launcher: Launcher, router, max_restarts: int, poll_s: float = MONITOR_S) -> None:
    """Watch the worker processes while serving: a worker that exits is marked dead
    in the router at once (its in-flight requests retry or migrate without waiting
    for the heartbeat timeout) and restarted, up to ``max_restarts`` times per
    instance; the restarted worker rejoins under the same instance id when it
    reports ready. A TP instance's other ranks die with its rank 0 (PDEATHSIG), and
    the new rank 0 starts them again. Runs until cancelled."""
    from epd import metrics

    m = metrics.get_metrics()
    restarts: dict[str, int] = {}
    while True:
        await asyncio.sleep(poll_s)
        try:
            dead = launcher.poll_dead()
            if not dead or launcher.stopping:
                continue
            for wp in dead:  # one process per instance
                inst = wp.instance_id
                print(f"epd: worker {wp.describe()}; its requests retry or migrate", file=sys.stderr, flush=True)
                router.mark_dead(inst)  # the router counts the failure (epd_worker_failures_total) once
                if restarts.get(inst, 0) >= max_restarts:
                    print(f"epd: not restarting {inst} (restarted {restarts.get(inst, 0)} times, "
                          f"--max-worker-restarts {max_restarts})", file=sys.stderr, flush=True)
                    continue
                restarts[inst] = restarts.get(inst, 0) + 1
                launcher.restart(wp)
                m.worker_restarts.labels(pool=wp.role, instance=inst).inc()
                print(f"epd: restarted {inst} ({restarts[inst]}/{max_restarts})", file=sys.stderr, flush=True)
        except Exception:  # supervision must outlive any one failure
            logger.exception("worker supervision")
