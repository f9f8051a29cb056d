"""The API process's bounded executor for CPU work: chat templates, tokenization, media
decoding and resampling, the realtime history render.

Every stream, ``/health`` and the router's receive loop (worker heartbeats included)
share the API process's one asyncio loop (docs/architecture.md, "Processes"), so a
long job on it stalls them all. ``CpuPool.run`` runs the job in a few threads instead:
HF fast tokenizers and torch's resampler release the GIL, and pure-Python work (Jinja)
yields it every switch interval, so the loop keeps serving. Jobs past the bound are
refused at once, not queued without limit. The HTTP routes and ``/v1/realtime`` share
one pool per process (``shared_pool``): the threads compete for the same cores.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from epd.errors import CapacityError

T = TypeVar("T")

#: threads of the API's CPU pool
CPU_WORKERS = 4
#: jobs (running plus queued) the pool takes at once; one more gets ``CapacityError``. Each
#: request in flight holds at most one job at a time, so at the default
#: ``--max-pending-requests`` (256) only requests past that limit could be refused here.
MAX_CPU_JOBS = 256


class CpuPool:
    """A thread pool of ``workers`` threads holding at most ``max_jobs`` jobs at once
    (running plus waiting for a thread).

    A job counts until it has finished in its thread, even when the coroutine awaiting
    it was cancelled (a job that had not started yet is dropped).

    Raises:
        ValueError: ``workers`` < 1 or ``max_jobs`` < ``workers``.
    """

    def __init__(self, workers: int = CPU_WORKERS, max_jobs: int = MAX_CPU_JOBS) -> None:
        if workers < 1 or max_jobs < workers:
            raise ValueError(f"a CPU pool needs workers >= 1 and max_jobs >= workers, got {workers} and {max_jobs}")
        self.max_jobs = max_jobs
        self._slots = threading.BoundedSemaphore(max_jobs)  # released in the job's thread
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="epd-api-cpu")

    async def run(self, fn: Callable[..., T], /, *args) -> T:
        """``fn(*args)`` run in the pool: its result, or the exception it raised.

        Raises:
            CapacityError: ``max_jobs`` jobs are in the pool already (HTTP 503 with
                ``Retry-After``); ``fn`` did not run.
        """
        if not self._slots.acquire(blocking=False):
            raise CapacityError(f"the API process has {self.max_jobs} CPU jobs (chat templates, tokenization, "
                                f"media decoding) in flight, its limit; retry later")
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(job)


_shared: CpuPool | None = None


def shared_pool() -> CpuPool:
    """The process's pool (``CPU_WORKERS`` threads, ``MAX_CPU_JOBS`` jobs), made on first use."""
    global _shared
    if _shared is None:
        _shared = CpuPool()
    return _shared
