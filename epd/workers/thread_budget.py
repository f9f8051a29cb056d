"""A CPU host's cores shared among its workers by who has work: the thread budget.

Every worker process on a host that runs without a fixed ``--threads`` takes a slot on
the host's board, a small shared-memory file (``/dev/shm/epd-threads-<uid>``; one
``(pid, busy)`` pair of int32 per slot). Before each step a worker marks itself busy and
sets its torch intra-op threads to ``max(1, cores // busy workers)``; when it runs out
of work it marks itself idle. So an aggregated worker alone with work uses every core,
an idle encode worker holds none, and when every worker is busy each gets its share
and the host is never oversubscribed (on 2 cores an OpenMP thread that loses its core
stalls the whole op it belongs to). A worker that becomes busy while another runs with
the whole budget oversubscribes only until that one's next step, when it reads the
board again. ``cores`` is the process's CPU affinity (what the container or taskset
allows). Slots of processes that died are reclaimed by the next worker to start, and a
dead worker's busy mark is ignored (its pid is checked about once a second).

Measured on a 2-core VM like CI's (benchmarks/README.md, "Ablations" of the serving run):
+20 / +44 / +38 % tok/s at 1 / 8 / 32 clients on ``e:1,p:1,d:1`` against one fixed thread
per worker; README.md's "Engine speed: dtype, batching, threads" tells users how to use it.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time

import numpy as np
import torch

from epd.launch.supervisor import host_cores

logger = logging.getLogger(__name__)

SLOTS = 256
_SLOT_BYTES = 8  # pid, busy: int32 each
LIVENESS_CHECK_S = 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ThreadBudget:
    """This process's slot on the host's board.

    Args:
        cores: cores to share (default :func:`host_cores`).
        path: the board file (default ``/dev/shm/epd-threads-<uid>``, else the temp dir).

    Raises:
        OSError: the board cannot be created or mapped.
        RuntimeError: every slot is held by a live process.
    """

    def __init__(self, cores: int | None = None, path: str | None = None) -> None:
        self.cores = cores or host_cores()
        if path is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
            path = os.path.join(base, f"epd-threads-{os.getuid()}")
        self.path = path
        self.pid = os.getpid()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < SLOTS * _SLOT_BYTES:
                os.ftruncate(fd, SLOTS * _SLOT_BYTES)
            self._mm = mmap.mmap(fd, SLOTS * _SLOT_BYTES)
            self._board = np.frombuffer(self._mm, dtype=np.int32).reshape(SLOTS, 2)
            free = next((i for i in range(SLOTS) if self._board[i, 0] in (0, self.pid)
                         or not _alive(int(self._board[i, 0]))), None)
            if free is None:
                raise RuntimeError(f"all {SLOTS} slots of the thread board {path} are held by live processes")
            self._board[free] = (self.pid, 0)
            self.slot = free
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.threads = 0
        self._busy = False
        self._dead: set[int] = set()
        self._checked = 0.0

    def busy_workers(self) -> int:
        """Workers on this host marked busy (this one included when it is), dead ones left out."""
        board = self._board
        rows = np.nonzero((board[:, 1] != 0) & (board[:, 0] != 0))[0]
        now = time.monotonic()
        if now - self._checked >= LIVENESS_CHECK_S:
            self._checked = now
            self._dead = {int(board[i, 0]) for i in rows if int(board[i, 0]) != self.pid
                          and not _alive(int(board[i, 0]))}
        if not self._dead:
            return len(rows)
        return sum(1 for i in rows if int(board[i, 0]) not in self._dead)

    def acquire(self) -> int:
        """Mark this worker busy and set torch's threads to its share; returns the share."""
        if not self._busy:
            self._board[self.slot, 1] = 1
            self._busy = True
        share = max(1, self.cores // max(1, self.busy_workers()))
        if share != self.threads:
            torch.set_num_threads(share)
            self.threads = share
        return share

    def release(self) -> None:
        """Mark this worker idle (it keeps its threads; they sleep while it waits)."""
        if self._busy:
            self._board[self.slot, 1] = 0
            self._busy = False

    def close(self) -> None:
        """Give the slot back."""
        try:
            if int(self._board[self.slot, 0]) == self.pid:
                self._board[self.slot] = (0, 0)
            del self._board
            self._mm.close()
        except (AttributeError, ValueError, BufferError):
            pass
