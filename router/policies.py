"""Routing policies: which instance of a pool gets a request."""

from __future__ import annotations

from epd.router.registry import WorkerHandle


class NoInstanceError(RuntimeError):
    """No live instance in a pool: requests fail fast (HTTP 503) instead of waiting."""


def least_loaded(workers: list[WorkerHandle]) -> WorkerHandle:
    """The instance with the fewest requests routed to it and still open, then
    the fewest running+waiting sequences in its last heartbeat, then most free blocks."""
    if not workers:
        raise NoInstanceError("no live instance")

    def key(w: WorkerHandle):
        load = w.load
        busy = (load.num_running + load.num_waiting) if load else 0
        free = load.num_free_blocks if load else 0
        return (w.inflight, busy, -free, w.instance_id)

    return min(workers, key=key)
