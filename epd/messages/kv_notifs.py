"""NIXL notifications between workers (encoded with ``epd.messages.control.encode``).

Prefill -> decode: the KV of a request arrived (``KVReady``), or will never be written
(``KVWriterDone``, ``KVWriterFenced``). Prefill <-> prefill, a remote prefix read
(``epd.transfer.remote_prefix``): the reader asks the holder to pin blocks
(``PrefixPin``), the holder answers with the pinned block ids (``PrefixPinned``), the
reader releases them once its read ended (``PrefixUnpin``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

#: most blocks one remote prefix read asks for (a 16-token block: 64k tokens)
MAX_PREFIX_PIN_BLOCKS = 4096


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


class PrefixPin(msgspec.Struct, tag="prefix_pin", frozen=True):
    """Reader -> holder NIXL notification: pin the leading blocks of ``block_hashes`` (16-byte
    ``iter_block_hashes`` digests of the reader's own prompt, from its first block it lacks)
    that your KV cache holds, and say which (``PrefixPinned``). ``generation``: the reader's
    random id of this read, echoed back; ``reader_pid``: the reader's process (its pins are
    dropped when that process is gone)."""

    request_id: Annotated[str, msgspec.Meta(max_length=256)]
    generation: int
    block_hashes: Annotated[list[Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]],
                            msgspec.Meta(max_length=MAX_PREFIX_PIN_BLOCKS)]
    reader_pid: int = 0


class PrefixPinned(msgspec.Struct, tag="prefix_pinned", frozen=True):
    """Holder -> reader NIXL notification: ``block_ids`` (of the holder's KV cache) hold the
    first ``len(block_ids)`` blocks of the ``PrefixPin``'s hashes and stay unused until
    its ``PrefixUnpin``; empty: none are held any more."""

    request_id: Annotated[str, msgspec.Meta(max_length=256)]
    generation: int
    block_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_PREFIX_PIN_BLOCKS)]


class PrefixUnpin(msgspec.Struct, tag="prefix_unpin", frozen=True):
    """Reader -> holder NIXL notification: the read of ``PrefixPinned`` ``generation``
    ended (done, failed or dropped): its blocks are the holder's again."""

    request_id: Annotated[str, msgspec.Meta(max_length=256)]
    generation: int
