"""Helpers shared by the benchmark scripts (imported as ``_common``: scripts run as
``python benchmarks/NAME.py``, which puts this folder first on ``sys.path``).

Machine noise (:func:`machine_busy_s`, :func:`self_cpu_s`, :func:`timed`), percentiles,
the git commit measured, free ports, and starting / stopping ``epd launch`` or any other
server.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

#: the repository root
ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str | None:
    """The short hash of the repository's HEAD, or None when git cannot tell."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_busy_s() -> float:
    """CPU seconds all processes on this machine have used (from /proc/stat: everything but
    idle and iowait), NaN if unknown."""
    try:
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def self_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def timed(fn):
    """Call ``fn()``; return (its result, wall seconds, cores other processes kept busy meanwhile)."""
    m0, s0 = machine_busy_s(), self_cpu_s()
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    other = max(0.0, (machine_busy_s() - m0) - (self_cpu_s() - s0))
    return out, wall, other / wall if wall > 0 else float("nan")


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs`` by nearest rank; NaN for no values."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def fmt_ms(v: float | None) -> str:
    """Seconds as whole milliseconds for a table; ``-`` for None."""
    return "-" if v is None else f"{v * 1000:.0f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x`` for a table; ``-`` when either is missing or zero."""
    return "-" if not a or not b else f"{a / b:.2f}x"


# --------------------------------------------------------------------------- servers


def launch(pools: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """``python -m epd.cli launch --port PORT --pools POOLS *extra`` on a free port.

    Returns (process, base URL) once it prints that it is serving; its output keeps being
    read (and dropped) so it never blocks on a full pipe. Stop it with :func:`stop_launched`.
    Raises RuntimeError when it exits first.
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "epd.cli", "launch", "--port", str(port), "--pools", pools,
                             *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if "serving" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep draining
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"epd launch exited (rc={proc.wait()}) before serving")


def stop_launched(proc: subprocess.Popen) -> None:
    """SIGINT to a :func:`launch` process; SIGKILL when it has not exited 60 s later."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def log_tail(log: Path, n: int = 6) -> str:
    """The last ``n`` non-blank lines of ``log`` (each cut to 300 characters), joined by `` | ``."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(ln.strip()[:300] for ln in lines[-n:])


def start_server(cmd: list[str], url: str, log: Path, timeout_s: float, *, env: dict[str, str] | None = None,
                 cwd: Path | None = None, health_path: str = "/health") -> subprocess.Popen:
    """Start ``cmd`` in a new session (its own process group), environment ``os.environ``
    updated with ``env``, output to ``log`` (after a ``$ cmd`` line); return it once
    ``GET url + health_path`` answers 200.

    Raises RuntimeError (after :func:`stop_server`) when it exits or is not healthy within
    ``timeout_s`` seconds; the message ends with the log's last lines.
    """
    import httpx

    with open(log, "w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=cwd, env={**os.environ, **(env or {})})
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + health_path, timeout=5).status_code == 200:
                return proc
        time.sleep(1.0)
    rc = proc.poll()
    stop_server(proc)
    why = f"exited with code {rc}" if rc is not None else f"not healthy after {timeout_s:.0f} s"
    raise RuntimeError(f"server {why}: " + log_tail(log))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Stop a :func:`start_server` process: SIGINT, then SIGKILL to its process group after
    ``timeout_s``; returns once every process of the group is gone (its memory freed)."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 15
    while _group_alive(pgid) and time.monotonic() < deadline:  # workers finishing their own shutdown
        time.sleep(0.5)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    deadline = time.monotonic() + 30
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)


@contextlib.contextmanager
def serve_epd(model: str | None, pools: str, cores: str, threads: int, log: Path, attempts: int = 3,
              extra: tuple[str, ...] = ()):
    """``taskset -c CORES epd launch --pools POOLS --threads-per-worker THREADS *EXTRA``
    (output to ``log``) until ``GET /health`` answers 200; yields the base URL; SIGINT
    (then SIGKILL of the process group) after. A start that fails (e.g. a worker killed
    for memory on this shared machine) is tried again, ``attempts`` times in all."""
    port = free_port()
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "epd.cli", "launch", "--pools", pools, "--port", str(port),
           "--threads-per-worker", str(threads), "--kv-cache-memory-gb", "1", *extra]
    if model is not None:
        cmd += ["--model", model]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    for attempt in range(1, attempts + 1):
        try:
            proc = start_server(cmd, url, log, 600.0, env={"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
            break
        except RuntimeError as e:
            if attempt == attempts:
                raise
            print(f"  start {attempt} of {pools} failed ({str(e).strip().splitlines()[-1]}); trying again",
                  flush=True)
            time.sleep(10)
    print(f"  serving {pools} on {url} (ready in {time.monotonic() - t0:.0f} s; log {log})", flush=True)
    try:
        yield url
    finally:
        stop_server(proc)
