"""Post each layer's KV sends once the device has finished that layer, without blocking the forward.

On a GPU the forward only *enqueues* kernels: when the per-layer hook runs for layer
``l``, the store (and staging pack) of layer ``l`` may not have run yet, and a NIXL
write posted then would read stale memory. vLLM's NixlConnector and Dynamo wait on a
CUDA event recorded after the layer's store before they post its transfer. ``LayerGate``
does the same: ``push`` records an event on the current stream and queues the layer's
sends; every later ``push`` (the next layers' hooks) posts those whose event has
completed (``Event.query``: a poll, never a wait); ``flush`` after the forward waits for
the rest. On the CPU the work is done when the hook runs, so sends are posted at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LayerGate"]


class LayerGate:
    """Args:
        device: the forward's device; on "cuda" sends wait for their layer's event.
        new_event: makes a recorded event (``torch.cuda.Event`` recorded on the current
            stream by default); anything with ``query() -> bool`` and ``synchronize()``.

    Sends run in layer order, each exactly once; an exception from a send propagates
    from the ``push`` / ``flush`` that ran it (the sends queued after it stay queued).
    """

    def __init__(self, device: torch.device | str, new_event: Callable[[], Any] | None = None) -> None:
        self.on_device = torch.device(device).type == "cuda" or new_event is not None
        self._new_event = new_event or _recorded_cuda_event
        self._pending: deque[tuple[Any, int, Callable[[int], None]]] = deque()
        self.posted_early = 0  # sends posted from a later layer's hook (overlapped with the forward)
        self.posted_at_flush = 0  # sends that waited for the end of the forward

    def push(self, layer: int, send: Callable[[int], None]) -> None:
        """Queue ``send(layer)`` behind the device work enqueued so far; post what is ready."""
        if not self.on_device:
            send(layer)
            return
        self._pending.append((self._new_event(), layer, send))
        self.poll()

    def poll(self) -> None:
        """Post, in order, every queued send whose layer has finished on the device."""
        while self._pending and self._pending[0][0].query():
            _, layer, send = self._pending.popleft()
            self.posted_early += 1
            send(layer)

    def flush(self) -> None:
        """Wait for the queued layers (the end of the forward) and post their sends."""
        while self._pending:
            event, layer, send = self._pending.popleft()
            event.synchronize()
            self.posted_at_flush += 1
            send(layer)


    def discard(self) -> None:
        """Drop queued sends unposted (after a failed forward)."""
        self._pending.clear()


def _recorded_cuda_event() -> Any:
    event = torch.cuda.Event()
    event.record()
    return event
