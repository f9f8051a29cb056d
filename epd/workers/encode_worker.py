"""Encode worker: towers (or the speech front end), embeddings held in a NIXL-registered buffer."""

from __future__ import annotations

import logging
import time
from collections import deque

import torch
from transformers import AutoConfig

from epd.encoders.encoder_runner import EncoderRunner
from epd.messages import EmbeddingRef, EncodeDone, EncodeRequest, Message, ReleaseEmbeddings
from epd.models.checkpoints import resolve_model
from epd.roles import Role
from epd.transfer.notifications import decoded_notifs
from epd.workers.base import BaseWorker
from epd.workers.embedding_buffer import EmbeddingBuffer

logger = logging.getLogger(__name__)


class EncodeWorker(BaseWorker):
    """EncodeRequest -> embeddings copied into the registered buffer -> EncodeDone
    with their regions and generations (or transcripts, for text-only LMs). A span is
    freed only by its reader's ``ReleaseEmbeddings`` (a NIXL notification after the
    read), or ``embedding_ttl_s`` after the router ended its request (``Abort``: the
    reader is done or gone; a lost router ends them all): never while a reader may
    still come for it. Freeing zeroes the span's generation word, so a reader that
    comes late reads a mismatch and never uses what is there.
    An item with a temporal range is a chunk of a long video split across encoders
    (``epd.router.encode_split``): only its temporal patches are encoded."""

    role = Role.ENCODE

    def __init__(self, args) -> None:
        super().__init__(args)
        path = resolve_model(args.model)
        self.runner = EncoderRunner(str(path), AutoConfig.from_pretrained(str(path)),
                                    audio_mode=args.engine_kwargs.get("audio_mode", "auto"))
        self.buffer = EmbeddingBuffer(args.embedding_buffer_mb * 2**20, device=self.runner.device)
        self.regions = self.transport.register([self.buffer.tensor])
        self.num_encoded = 0
        self.num_video_chunks = 0  # video chunks (temporal ranges) encoded or found in the cache
        self.queue: deque[tuple[EncodeRequest, float]] = deque()  # (request, arrival), in arrival order
        self.announce(self.regions)

    def handle_role(self, msg: Message) -> None:
        if not isinstance(msg, EncodeRequest):
            return super().handle_role(msg)
        self.queue.append((msg, time.monotonic()))  # encoded one per loop turn: commands stay responsive

    def has_work(self) -> bool:
        return bool(self.queue)

    def step(self) -> None:
        msg, arrival = self.queue.popleft()
        t0 = time.monotonic()
        self.observe("encode_queue", t0 - arrival)
        rid = msg.request_id
        try:
            items = list(msg.items)  # tensors already checked on decode (epd.messages)
            if any("audio" in it.data for it in items):
                self.send(EncodeDone(rid, self.instance_id, transcripts=self.runner.transcribe(items),
                                     encode_s=time.monotonic() - t0))
                return
            ranges = list(msg.temporal_ranges) or [None] * len(items)
            embs = self.runner.encode(items, ranges)  # checks the ranges (MessageError)
            refs = []
            for it, emb, rng in zip(items, embs, ranges):
                emb = emb.contiguous()
                raw = emb.view(-1).view(torch.uint8)
                off, generation = self.buffer.alloc_span(rid, raw.numel())
                self.buffer.view(off, raw.numel()).copy_(raw)
                refs.append(EmbeddingRef(it.item_hash, self.buffer.region(off, raw.numel()), list(emb.shape),
                                         str(emb.dtype).removeprefix("torch."), self.instance_id,
                                         None if rng is None else tuple(rng), generation))
            self.num_encoded += len(items)
            self.num_video_chunks += sum(r is not None for r in ranges)
        except Exception as e:  # every failure is reported, saying who failed
            self.buffer.free(rid)
            self.fail(rid, e, prefix="encode failed: ")
            return
        self.observe("encode", time.monotonic() - t0)
        self.send(EncodeDone(rid, self.instance_id, refs, encode_s=time.monotonic() - t0))

    def poll(self) -> None:
        for _peer, msg in decoded_notifs(self.transport):
            if isinstance(msg, ReleaseEmbeddings):
                self.buffer.free(msg.request_id)
        for owner in self.buffer.expire(self.args.embedding_ttl_s):
            logger.info("encode %s: embeddings of ended request %s reclaimed", self.instance_id, owner)

    def abort(self, request_id: str) -> None:
        """The router ended the request: drop it from the queue; its embeddings are
        reclaimed ``embedding_ttl_s`` later (unless its reader releases them first)."""
        self.queue = deque(q for q in self.queue if q[0].request_id != request_id)
        self.buffer.end(request_id)

    def in_flight(self) -> set[str]:
        return set(self.buffer.owners()) | {q[0].request_id for q in self.queue}

    def update_metrics(self, stats: dict[str, float]) -> None:
        self.metrics.queue_depth.labels(**self.labels).set(stats["num_waiting"])
        self.count_total("encoder_cache_queries", stats["encoder_cache_hits"] + stats["encoder_cache_misses"])
        self.count_total("encoder_cache_hits", stats["encoder_cache_hits"])
        self.count_total("encode_video_chunks", stats["num_video_chunks"])

    def stats(self) -> dict[str, float]:
        c = self.runner.cache
        return {"embedding_buffer_used_bytes": self.buffer.used_bytes, "num_held_requests": len(self.buffer.owners()),
                "num_waiting": len(self.queue),
                "encoder_cache_hits": c.hits, "encoder_cache_misses": c.misses, "num_encoded": self.num_encoded,
                "num_video_chunks": self.num_video_chunks}
