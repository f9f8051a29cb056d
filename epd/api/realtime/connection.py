"""One ``/v1/realtime`` socket's two directions (``EventChannel``): a bounded outbound
queue with its writer, and inbound messages. The protocol is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import contextlib

#: seconds a flushed session waits for its last events to go out
FLUSH_S = 1.0
#: seconds the policy close (1008) of a client that stopped reading waits for the socket to take it
POLICY_CLOSE_S = 10.0


class EventChannel:
    """Outbound and inbound messages of one accepted socket ``ws``.

    Outbound: ``send`` queues a server event (JSON text) for the writer task
    (``write``), so event handlers and response tasks never block on the socket and
    events keep their order. The queue is bounded: when an event would take it past
    ``max_bytes`` (the client stopped reading and the socket's buffers are full), all
    that is queued is dropped, nothing more is queued, and ``closing`` is set.
    Inbound: ``receive`` is the next ASGI message, or None once ``closing`` (a
    ``receive`` waiting then returns None at once). ``finish`` ends the socket.
    """

    def __init__(self, ws, max_bytes: int) -> None:
        self.ws, self.max_bytes = ws, max_bytes
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

    async def receive(self) -> dict | None:
        """The next ASGI message of the socket; None once ``closing``."""
        if self.closing:
            return None
        self._recv = asyncio.ensure_future(self.ws.receive())
        try:
            return await self._recv
        except asyncio.CancelledError:
            if self.closing and not asyncio.current_task().cancelling():
                return None
            raise
        finally:
            self._recv = None

    async def finish(self, writer: asyncio.Task) -> None:
        """End the socket: flush what is queued (for up to ``FLUSH_S``); when ``closing``,
        drop it and close with code 1008 instead (given up after ``POLICY_CLOSE_S`` if the
        client still does not read: its socket is then dropped)."""
        if not self.closing:
            self.out.put_nowait(None)
            try:
                await asyncio.wait_for(writer, FLUSH_S)
            except Exception:  # the client is gone: nothing more can be sent
                writer.cancel()
            return
        writer.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=1008, reason="the client does not read its events"),
                                   POLICY_CLOSE_S)
