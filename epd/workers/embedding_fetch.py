"""The prefill side's reads of embeddings from encode workers, polled from the worker's
loop (never waited on inside it).

A fetch posts one READ per encode instance for its refs' data; once they are done it
reads each span's generation word back (``epd.workers.embedding_buffer``), the READ that
carries ``ReleaseEmbeddings`` to the encoder. The data is used only if every word still
holds the generation its ``EmbeddingRef`` gave: the encoder zeroes a span's word before
it can reuse the span, and the word was read after the data, so a match means no other
request's data was there while it was read.

A fetch that fails, times out or is aborted releases its reads; reads NIXL could not
cancel keep their receive-buffer slots fenced until they terminate (the process exiting
ends them too), counted once in ``num_unterminated`` when still in flight ``timeout_s``
after their release.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from epd.messages import EmbeddingRef, PeerInfo, ReleaseEmbeddings, encode, typed_view
from epd.multimodal import Placeholder
from epd.transfer.nixl_transport import NixlTransport, Transfer, TransferError, TransferTimeout
from epd.workers.embedding_buffer import GENERATION_BYTES, EmbeddingBuffer, generation_offset
from epd.workers.embedding_chunks import EmbeddingChunkError, join_chunks

logger = logging.getLogger(__name__)

__all__ = ["EmbeddingFetcher", "StaleEmbeddingsError"]


class StaleEmbeddingsError(TransferError):
    """An embedding span no longer held the generation its ref named when it was read:
    the encoder had reclaimed it (the request was ended there). The data is not used;
    the request fails with a retryable 500."""


@dataclass(slots=True)
class _Fetch:
    request_id: str
    payload: Any  # what the worker admits once the embeddings are here (its request message)
    refs: list[EmbeddingRef]
    placeholders: list[Placeholder] | None
    owner: str  # the receive-buffer owner of its slots
    by_instance: dict[str, list[int]]
    offsets: list[int]
    words: int  # receive-buffer offset of its generation words (8 bytes per ref)
    deadline: float
    start: float
    reads: list[Transfer] = field(default_factory=list)
    checks: list[Transfer] = field(default_factory=list)  # the generation-word reads, once posted


class EmbeddingFetcher:
    """Reads requests' embeddings into ``buffer`` over ``transport``.

    Args:
        transport: this worker's NIXL agent (``buffer`` registered with it).
        buffer: the receive buffer; ``peers``: the router's ``PeerInfo`` by instance id
            (read at use); ``timeout_s``: a fetch not done this long after its start fails.
    """

    def __init__(self, transport: NixlTransport, buffer: EmbeddingBuffer, peers: dict[str, PeerInfo],
                 timeout_s: float) -> None:
        self.transport, self.buffer, self.peers, self.timeout_s = transport, buffer, peers, timeout_s
        self.fetches: dict[str, _Fetch] = {}
        self.fenced: dict[str, tuple[list[Transfer], float]] = {}  # buffer owner -> (released reads, when)
        self._late: set[str] = set()
        self.num_unterminated = 0
        self._ids = itertools.count()

    def start(self, request_id: str, encode_instance: str | None, refs: list[EmbeddingRef],
              placeholders: list[Placeholder] | None, payload: Any) -> None:
        """Post the data reads of ``refs`` (one per encode instance: a ref's ``instance_id``,
        else ``encode_instance``); ``poll`` reports the fetch later.

        Raises (nothing is left held or posted):
            KeyError: an unknown encode instance. EmbeddingChunkError: a ref without a
            generation. BufferFullError: no receive-buffer room. TransferError / ValueError:
            a read could not be posted.
        """
        by_instance: dict[str, list[int]] = {}
        for k, ref in enumerate(refs):
            if not ref.generation:
                raise EmbeddingChunkError(f"the embedding ref of item {ref.item_hash[:12]} carries no generation")
            by_instance.setdefault(ref.instance_id or encode_instance, []).append(k)
        peers = {inst: self.peers[inst] for inst in by_instance}  # KeyError before anything is posted
        now = time.monotonic()
        owner = f"{request_id}#{next(self._ids)}"
        f = _Fetch(request_id, payload, refs, placeholders or None, owner, by_instance, [0] * len(refs), 0,
                   now + self.timeout_s, now)
        try:
            f.words = self.buffer.alloc(owner, GENERATION_BYTES * len(refs))
            for inst, ks in by_instance.items():
                local = []
                for k in ks:
                    f.offsets[k] = self.buffer.alloc(owner, refs[k].region[1])
                    local.append(self.buffer.region(f.offsets[k], refs[k].region[1]))
                f.reads.append(self.transport.read(peers[inst].instance_id, local, [refs[k].region for k in ks]))
        except Exception:
            self._end(f, release=True)
            raise
        self.fetches[request_id] = f

    def poll(self) -> tuple[list[tuple[Any, list[torch.Tensor], float]], list[tuple[Any, Exception]]]:
        """Advance every fetch: ``(done, failed)``: ``(payload, one [rows, hidden] tensor
        per item, seconds the fetch took)`` and ``(payload, error)``; both are forgotten."""
        if self.fenced:
            self._settle()
        done, failed = [], []
        for rid, f in list(self.fetches.items()):
            try:
                tensors = self._advance(f)
            except Exception as e:
                del self.fetches[rid]
                self._end(f, release=True)
                failed.append((f.payload, e))
                continue
            if tensors is not None:
                del self.fetches[rid]
                self._end(f, release=False)
                done.append((f.payload, tensors, time.monotonic() - f.start))
        return done, failed

    def _advance(self, f: _Fetch) -> list[torch.Tensor] | None:
        stage = f.checks or f.reads
        if not all(t.poll() for t in stage):
            if time.monotonic() > f.deadline:
                raise TransferTimeout(f"the embeddings of {f.request_id} did not arrive within {self.timeout_s:g} s")
            return None
        if not f.checks:  # the data is here: read the generation words back, telling the encoder it may go
            for inst, ks in f.by_instance.items():
                local = [self.buffer.region(f.words + GENERATION_BYTES * k, GENERATION_BYTES) for k in ks]
                remote = [(f.refs[k].region[0] + generation_offset(f.refs[k].region[1]), GENERATION_BYTES,
                           f.refs[k].region[2]) for k in ks]
                f.checks.append(self.transport.read(inst, local, remote,
                                                    notif=encode(ReleaseEmbeddings(f.request_id))))
            return self._advance(f)
        words = self.buffer.view(f.words, GENERATION_BYTES * len(f.refs)).cpu().view(torch.int64).tolist()
        for ref, word in zip(f.refs, words):
            if word != ref.generation:
                raise StaleEmbeddingsError(
                    f"the embedding of item {ref.item_hash[:12]} was reclaimed by {ref.instance_id or 'its encoder'} "
                    f"before it was read (generation {word:#x}, expected {ref.generation:#x}); not used")
        out = [typed_view(self.buffer.view(off, ref.region[1]), ref.dtype, list(ref.shape)).clone()
               for ref, off in zip(f.refs, f.offsets)]  # checked as any tensor off the wire
        return join_chunks(f.refs, out, f.placeholders)

    def abort(self, request_id: str) -> bool:
        """Drop a fetch (its reads released, its slots fenced until they terminate). False: none."""
        f = self.fetches.pop(request_id, None)
        if f is None:
            return False
        self._end(f, release=True)
        return True

    def _end(self, f: _Fetch, release: bool) -> None:
        """Release ``f``'s reads; free its slots now, or once its reads terminate. With
        ``release``: its data may not have been read back, so tell each encoder to let
        the embeddings go (the generation-word read did not)."""
        live = [t for t in (*f.reads, *f.checks) if not t.release()]
        if live:
            self.fenced[f.owner] = (live, time.monotonic())
        else:
            self.buffer.free(f.owner)
        if release:
            for inst in f.by_instance:
                try:
                    self.transport.send_notif(inst, encode(ReleaseEmbeddings(f.request_id)))
                except TransferError as e:  # the encoder is gone: it holds nothing any more
                    logger.debug("release of %s's embeddings on %s: %s", f.request_id, inst, e)

    def _settle(self) -> None:
        now = time.monotonic()
        for owner, (reads, since) in list(self.fenced.items()):
            if all(t.terminated for t in reads):
                del self.fenced[owner]
                self._late.discard(owner)
                self.buffer.free(owner)
            elif now - since > self.timeout_s and owner not in self._late:
                self._late.add(owner)
                self.num_unterminated += 1
                logger.error("%s: embedding reads of %s did not terminate %.0f s after their release: their "
                             "receive-buffer slots stay fenced", self.transport.name, owner, self.timeout_s)

    def in_flight(self) -> set[str]:
        return set(self.fetches)

    def stats(self) -> dict[str, float]:
        return {"num_fetching_embeddings": len(self.fetches), "num_fenced_embedding_reads": len(self.fenced),
                "embedding_reads_unterminated": self.num_unterminated}
