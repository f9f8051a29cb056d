"""Prefill -> decode NIXL notifications (encoded with ``epd.messages.control.encode``):
the KV of a request arrived (``KVReady``), or will never be written (``KVWriterDone``,
``KVWriterFenced``)."""

from __future__ import annotations

import msgspec


class KVReady(msgspec.Struct, tag="kv_ready", frozen=True):
    """P -> D NIXL notification: all KV of the request is in D's blocks (or, when
    staged, in D's staging range, laid out by ``src_tp`` prefill ranks)."""

    request_id: str
    first_token: int
    src_tp: int = 1
    generation: int = 0  # KVReserved.generation


class KVWriterDone(msgspec.Struct, tag="kv_writer_done", frozen=True):
    """P -> D NIXL notification: this prefill worker will never write the reservation's
    blocks (its send was aborted or failed, and every write of it has ended), sent
    instead of ``KVReady``. ``generation``: ``KVReserved.generation``."""

    request_id: str
    generation: int


class KVWriterFenced(msgspec.Struct, tag="kv_writer_fenced", frozen=True):
    """P -> D NIXL notification, sent when the prefill worker lost its router: every send
    it had is dropped and none of its earlier instructions will ever write again, so
    the reservations that named it as writer before now are free on the decode side."""
