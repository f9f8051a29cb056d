"""One ``/v1/realtime`` socket's two directions (``EventChannel``): a bounded outbound
queue with its writer, and inbound messages. The protocol is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

#: seconds a flushed session waits for its last events to go out
FLUSH_S = 1.0
#: seconds the policy close (1008) of a client that stopped reading waits for the socket to take it
POLICY_CLOSE_S = 10.0
#: what ``EventChannel.receive`` returns when no message came in time
IDLE = {"type": "epd.idle"}


class EventChannel:
    """Outbound and inbound messages of one accepted socket ``ws``.

    Outbound: ``send`` queues a server event (JSON text) for the writer task
    (``write``), so event handlers and response tasks never block on the socket and
    events keep their order. The queue is bounded: when an event would take it past
    ``max_bytes`` (the client stopped reading and the socket's buffers are full), all
    that is queued is dropped, nothing more is queued, and ``closing`` is set.
    Inbound: ``receive`` is the next ASGI message, or None once ``closing`` (a
    ``receive`` waiting then returns None at once), or ``IDLE`` once no message came
    for ``idle_timeout_s`` seconds (None: never) while not ``busy()`` (work the client
    started runs; its end calls ``touch``, restarting the clock). ``finish`` ends the socket.
    """

    def __init__(self, ws, max_bytes: int, idle_timeout_s: float | None = None,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self.ws, self.max_bytes = ws, max_bytes
        self.idle_timeout_s, self.busy = idle_timeout_s, busy
        self.active_s = time.monotonic()  # when the idle clock was last restarted (``touch``)
        self.out: asyncio.Queue[str | None] = asyncio.Queue()
        self.out_bytes = 0  # characters queued or being sent (the JSON is ASCII: bytes)
        self.closing = False
        self._recv: asyncio.Future | None = None

    def send(self, data: str) -> None:
        """Queue ``data``; an event alone over ``max_bytes`` still goes when nothing waits."""
        if self.closing:
            return
        if self.out_bytes and self.out_bytes + len(data) > self.max_bytes:
            self.closing = True
            while not self.out.empty():
                self.out.get_nowait()
            self.out_bytes = 0
            if self._recv is not None:
                self._recv.cancel()
            return
        self.out_bytes += len(data)
        self.out.put_nowait(data)

    async def write(self) -> None:
        """The writer task: send queued events until ``None`` is queued."""
        while (data := await self.out.get()) is not None:
            await self.ws.send_text(data)
            if not self.closing:
                self.out_bytes -= len(data)

    def touch(self) -> None:
        """Restart the idle clock (a message came in, or work the client started ended)."""
        self.active_s = time.monotonic()

    def _idle_left_s(self) -> float | None:
        """Seconds until the socket is idle (0: it is; None: no idle timeout). While
        ``busy()`` it is not: the wait is a whole timeout, then this is asked again."""
        if self.idle_timeout_s is None or self.busy():
            return self.idle_timeout_s
        return max(0.0, self.active_s + self.idle_timeout_s - time.monotonic())

    async def receive(self) -> dict | None:
        """The next ASGI message of the socket; None once ``closing``; ``IDLE`` once the
        socket is idle."""
        while (msg := await self._next(self._idle_left_s())) is IDLE:
            if self._idle_left_s() == 0.0:
                return IDLE
        if msg is not None:
            self.touch()
        return msg

    async def _next(self, timeout_s: float | None) -> dict | None:
        """The next ASGI message; None once ``closing``; ``IDLE`` when none came within
        ``timeout_s`` seconds (the next call goes on waiting for the same message)."""
        if self.closing:
            return None
        if self._recv is None:
            self._recv = asyncio.ensure_future(self.ws.receive())
        recv = self._recv
        try:
            await asyncio.wait([recv], timeout=timeout_s)
        except asyncio.CancelledError:
            self._drop_receive()
            raise
        if not recv.done():
            return IDLE
        self._recv = None
        if self.closing or recv.cancelled():
            return None
        return recv.result()

    def _drop_receive(self) -> None:
        if self._recv is not None:
            self._recv.cancel()
            self._recv = None

    async def finish(self, writer: asyncio.Task, close_code: int | None = None, reason: str = "") -> None:
        """End the socket: flush what is queued (for up to ``FLUSH_S``), then close it with
        ``close_code`` and ``reason`` when given; when ``closing``, drop what is queued and
        close with code 1008 instead. A close the client does not take is given up after
        ``POLICY_CLOSE_S`` (its socket is then dropped)."""
        self._drop_receive()
        if not self.closing:
            self.out.put_nowait(None)
            try:
                await asyncio.wait_for(writer, FLUSH_S)
            except Exception:  # the client is gone: nothing more can be sent
                writer.cancel()
            if close_code is None:
                return
        else:
            writer.cancel()
            close_code, reason = 1008, "the client does not read its events"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=close_code, reason=reason), POLICY_CLOSE_S)
