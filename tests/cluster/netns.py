"""Hosts on one machine: network namespaces joined by veth pairs on a bridge.

Each *host* is a network namespace with its own loopback and one interface
``eth0`` (address ``10.77.0.N/24``) whose veth peer sits on a bridge in a
*switch* namespace. Nothing is added to the namespace the tests run in: the
addresses exist only inside namespaces this module creates and deletes. UCX
(NIXL's data plane) runs over tcp on ``eth0`` (``UCX_TLS=tcp``), never shared
memory or cma, so the hosts really only talk through the network. Cutting a
host's link (``cut``) downs its port on the bridge.

Processes start in a host with ``ip netns exec``; the test's own clients reach a
host through :meth:`Cluster.run_in`, which runs a function on a thread that
joined the host's namespace (``setns(2)`` is per thread for the network).
Needs root (CI runs as root); :func:`netns_available` says why not otherwise.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    name = f"epdprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is missing"
    if r.returncode:
        return f"this kernel or container forbids network namespaces: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Cluster:
    """Namespaced hosts and the processes started in them; ``close`` removes everything."""

    def __init__(self, log_dir: Path) -> None:
        self.tag = f"{os.getpid() % 100000}"
        self.switch = f"epd{self.tag}sw"
        self.log_dir = log_dir
        self.hosts: dict[str, tuple[str, str, str]] = {}  # name -> (netns, address, bridge port)
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, name: str) -> str:
        """A new host; returns its address."""
        n = len(self.hosts) + 1
        ns, port, addr = f"epd{self.tag}{name}", f"p{n}", f"{SUBNET}.{n}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        self.hosts[name] = (ns, addr, port)
        return addr

    def addr(self, host: str) -> str:
        return self.hosts[host][1]

    def cut(self, host: str) -> None:
        """Unplug ``host``'s cable: its bridge port goes down (its processes keep running)."""
        _ip("-n", self.switch, "link", "set", self.hosts[host][2], "down")

    def spawn(self, host: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` in ``host`` (own process group), output to ``<log_dir>/<name>.log``.
        ``env`` adds variables (a None value removes one, e.g. ``UCX_TLS``)."""
        ns = self.hosts[host][0]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN",
                    **(env or {})}
        full_env = {k: v for k, v in full_env.items() if v is not None}
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
        log.close()
        self.procs.append((host, proc))
        return proc

    def epd(self, host: str, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``epd ARGS`` in ``host``."""
        return self.spawn(host, name, [sys.executable, "-m", "epd.cli", *args], env)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_host(self, host: str, sig: int = signal.SIGKILL) -> None:
        """Signal every process started in ``host`` (and its children)."""
        for h, proc in self.procs:
            if h == host and proc.poll() is None:
                _killpg(proc, sig)

    def run_in(self, host: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on a thread inside ``host``'s network namespace."""
        return self.submit_in(host, fn, *args, **kwargs).result()

    def submit_in(self, host: str, fn, *args, **kwargs) -> concurrent.futures.Future:
        if host not in self._pools:
            ns = self.hosts[host][0]
            self._pools[host] = concurrent.futures.ThreadPoolExecutor(
                16, thread_name_prefix=f"netns-{host}", initializer=_enter_netns, initargs=(ns,))
        return self._pools[host].submit(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for _, proc in self.procs:
            if proc.poll() is None:
                _killpg(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(proc, signal.SIGKILL)
                proc.wait(5)
        for ns, _, _ in self.hosts.values():
            _ip("netns", "del", ns, check=False)
        _ip("netns", "del", self.switch, check=False)


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _enter_netns(ns: str) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
    finally:
        os.close(fd)
