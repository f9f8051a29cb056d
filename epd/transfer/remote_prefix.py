"""Remote prefix reads: a prefill instance reads the prompt blocks another prefill
instance's KV cache holds over NIXL, instead of prefilling them again.

The router names the holder in ``PrefillRequest.prefix_holder`` when its KV index says
another instance holds more of the prompt's prefix in its KV cache than the chosen one
(``epd.router.policies.prefix_holder``). The rest is between the two workers, over NIXL
notifications (``epd.messages.kv_notifs``):

1. The reader hashes its own prompt (``iter_block_hashes``), keeps the leading blocks it
   holds itself (KV cache or tiers), and sends the holder the hashes of the rest
   (``PrefixPin``, with a random ``generation``).
2. The holder pins the leading blocks of those hashes its KV cache holds
   (``BlockManager.pin``: referenced, so never evicted or reused) and answers their ids
   (``PrefixPinned``). What it pins is what it advertises: the hashes are the
   reader's, computed from the reader's prompt, so a hash match means the same tokens and
   media before and inside the block.
3. The reader takes as many free blocks, posts one NIXL READ of every layer's K and V
   of them (block ids checked against the holder's advertised KV regions), and, once it
   completed, caches them under their hashes (``BlockManager.commit_remote``), unpins
   (``PrefixUnpin``) and admits the request: its prefix lookup hits them.

The holder serves these notifications between two layers of its current engine step
too (``NixlKVSender.between_layers``), so a busy holder answers within a layer's
compute, not after its step: pinning a block takes no block the step uses (its blocks
were allocated before the forward; a block is hashed only once computed). The reader
only queues answers there, and handles them between steps.

Requests that need the same blocks from the same holder while a read of them is in
flight wait for that read (its ``leader``) instead of reading them again. The reader asks
only for the blocks the router's index says the holder holds
(``PrefillRequest.prefix_holder_blocks``).

Safety: a pinned block is never evicted or reused, so it is never read stale; pins end
only with the reader's ``PrefixUnpin`` or the reader's process gone (``PeerGone``). A
read that fails, passes ``timeout_s``, or whose holder dies falls back to prefilling
the whole prompt: its blocks are never cached, and stay held until the read terminated
(a late landing can only write blocks nobody uses). A holder's answer that does not
match a pending read (stale, or for an aborted read) is unpinned at once.

Both sides must run TP 1 with the same KV layout (block to block, as the P->D path
without staging); otherwise the reader prefills. Source: Mooncake's KVCache-centric
store (FAST'25) and NVIDIA Dynamo's KV router with remote reuse.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from epd.block_hash import iter_block_hashes
from epd.messages import (
    KVLayout,
    PeerInfo,
    PrefillRequest,
    PrefixPin,
    PrefixPinned,
    PrefixUnpin,
    encode,
)
from epd.messages.kv_notifs import MAX_PREFIX_PIN_BLOCKS
from epd.transfer.nixl_transport import NixlTransport, Transfer, TransferError
from epd.transfer.notifications import decoded_notifs
from epd.transfer.regions import block_regions

logger = logging.getLogger(__name__)

__all__ = ["PrefixPins", "RemotePrefixReader", "serve_notifications"]

#: share of a holder's KV cache that remote reads may pin at once
MAX_PINNED_SHARE = 0.5


@dataclass(slots=True)
class _Read:
    """One request's remote prefix read, from ``PrefixPin`` to its end."""

    msg: PrefillRequest
    arrival: float
    holder: str
    generation: int
    hashes: list[bytes]  # asked for: the prompt's blocks from the first one this instance lacks
    started: float
    blocks: list[int] = field(default_factory=list)  # ours, allocated once the holder answered
    transfer: Transfer | None = None
    pinned: bool = False  # the holder pinned blocks for it (it is owed a PrefixUnpin)
    ended: bool = False  # done, or given up: its request is admitted at the next poll
    leader: str = ""  # another request's read of the same blocks, which this one waits for (no read of its own)


class RemotePrefixReader:
    """Reader side of remote prefix reads on a prefill worker (see the module docstring).

    Args:
        transport: this worker's NIXL agent (its KV cache registered).
        block_manager: the engine's ``BlockManager`` (TP 1: block ids index the regions).
        layout: this worker's ``KVLayout``; ``peers``: the router's ``PeerInfo`` by
            instance id (read at use).
        timeout_s: a read not complete this long after its ``PrefixPin`` falls back.
    """

    def __init__(self, transport: NixlTransport, block_manager, layout: KVLayout, peers: dict[str, PeerInfo],
                 instance_id: str, timeout_s: float) -> None:
        self.transport, self.bm, self.layout, self.peers = transport, block_manager, layout, peers
        self.instance_id, self.timeout_s = instance_id, timeout_s
        self.reads: dict[str, _Read] = {}
        self._answers: list[tuple[str, PrefixPinned]] = []  # holders' answers not handled yet
        self.draining: list[tuple[Transfer, list[int]]] = []  # given up reads still in flight, and their blocks
        self.num_reads = {"ok": 0, "fallback": 0, "aborted": 0}  # ended reads, by outcome
        self.num_read_blocks = 0
        self.num_read_bytes = 0

    def start(self, msg: PrefillRequest, arrival: float) -> bool:
        """Begin reading ``msg``'s prefix from ``msg.prefix_holder``; False when there is
        nothing to read (no holder, another layout, this instance holds it all): admit it now."""
        holder = self.peers.get(msg.prefix_holder)
        if (holder is None or msg.prefix_holder == self.instance_id or not self.bm.enable_prefix_caching
                or not self.layout.same_blocks(holder.kv_layout)):
            return False
        bs = self.layout.block_size
        chain = list(iter_block_hashes(msg.prompt_token_ids, bs, msg.placeholders,
                                       (len(msg.prompt_token_ids) - 1) // bs))
        have = 0
        while have < len(chain) and self.bm.tier_of(chain[have]) is not None:
            have += 1
        held = msg.prefix_holder_blocks or len(chain)  # what the router's index says the holder holds
        hashes = chain[have:min(held, have + MAX_PREFIX_PIN_BLOCKS)]
        if not hashes:
            return False
        read = _Read(msg, arrival, msg.prefix_holder, secrets.randbits(63), hashes, time.monotonic())
        leader = next((r for r in self.reads.values() if not r.ended and not r.leader and r.holder == read.holder
                       and r.hashes[0] == hashes[0]), None)
        if leader is not None:  # the same blocks are on their way: wait for them rather than read them twice
            read.leader = leader.msg.request_id
            self.reads[msg.request_id] = read
            return True
        try:
            self.transport.send_notif(read.holder, encode(PrefixPin(msg.request_id, read.generation, hashes,
                                                                    os.getpid())))
        except TransferError as e:
            logger.warning("prefill %s: no remote prefix read of %s from %s: %s", self.instance_id,
                           msg.request_id, read.holder, e)
            return False
        self.reads[msg.request_id] = read
        return True

    def on_pinned(self, sender: str, msg: PrefixPinned) -> None:
        """The holder's answer, kept for the next ``poll`` (this may run inside an engine
        step, between two layers: nothing is allocated here)."""
        self._answers.append((sender, msg))

    def _answer(self, sender: str, msg: PrefixPinned) -> None:
        """Read the pinned blocks into free blocks of ours."""
        read = self.reads.get(msg.request_id)
        if (read is None or read.generation != msg.generation or read.holder != sender or read.ended
                or read.transfer is not None):
            if msg.block_ids:  # stale (the read was given up) or not ours: the holder may unpin
                self._unpin(sender, msg.request_id, msg.generation)
            return
        read.pinned = bool(msg.block_ids)
        n = len(msg.block_ids)
        if n == 0 or n > len(read.hashes) or len(set(msg.block_ids)) != n:  # none held there any more, or bogus
            self._end(read, "fallback", f"the holder answered {n} block ids for {len(read.hashes)} hashes" if n
                      else "the holder no longer holds the blocks")
            return
        blocks = self.bm.allocate_blocks(n)
        if blocks is None:
            self._end(read, "fallback", f"no {n} free KV blocks to read into")
            return
        read.blocks = blocks
        try:
            local, remote = self._regions(blocks, list(msg.block_ids), self.peers[read.holder].kv_layout)
            read.transfer = self.transport.read(read.holder, local, remote)
        except (TransferError, ValueError, KeyError) as e:
            self._end(read, "fallback", f"read not posted: {e}")

    def _regions(self, ours: list[int], theirs: list[int], layout: KVLayout) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) descriptors of every layer's K and V of the blocks.

        Raises:
            ValueError: a block id outside the holder's advertised KV cache.
        """
        bb, me = self.layout.block_bytes, self.layout
        local = np.concatenate([block_regions(r[layer], bb, ours) for layer in range(me.num_layers)
                                for r in (me.k_regions, me.v_regions)])
        remote = np.concatenate([block_regions(r[layer], bb, theirs) for layer in range(layout.num_layers)
                                 for r in (layout.k_regions, layout.v_regions)])
        return local, remote

    def poll(self) -> list[tuple[PrefillRequest, float]]:
        """Requests whose read ended (their prefix cached here, or falling back to prefill),
        to admit now, with their arrival times."""
        answers, self._answers = self._answers, []
        for sender, msg in answers:
            self._answer(sender, msg)
        now = time.monotonic()
        for t, blocks in [d for d in self.draining if d[0].terminated]:
            self.draining.remove((t, blocks))
            self.bm.release(blocks)
        ready = []
        for rid, read in list(self.reads.items()):
            try:
                if read.leader:
                    leader = self.reads.get(read.leader)
                    if leader is not None and not leader.ended:
                        continue  # (a leader ended in this poll was removed above: dicts keep insertion order)
                    read.ended = True
                elif read.ended:
                    pass
                elif read.transfer is not None and read.transfer.poll():
                    self.bm.commit_remote(read.blocks, read.hashes[:len(read.blocks)])
                    self.num_read_blocks += len(read.blocks)
                    self.num_read_bytes += read.transfer.nbytes
                    read.blocks = []
                    self._end(read, "ok")
                elif now - read.started > self.timeout_s:
                    raise TransferError(f"not done after {self.timeout_s:g} s")
                else:
                    continue
            except TransferError as e:
                self._end(read, "fallback", str(e))
            ready.append((read.msg, read.arrival))
            del self.reads[rid]
        return ready

    def _end(self, read: _Read, outcome: str, why: str = "") -> None:
        """Close ``read``: unpin at the holder, give its blocks back (held while the read
        may still land), count its ``outcome``. Its request stays in ``reads`` for ``poll``."""
        if why:
            logger.warning("prefill %s: remote prefix read of %s from %s falls back to prefill: %s",
                           self.instance_id, read.msg.request_id, read.holder, why)
        if read.blocks:
            if read.transfer is None or read.transfer.release():
                self.bm.release(read.blocks)
            else:
                self.draining.append((read.transfer, read.blocks))
            read.blocks = []
        if read.pinned:
            read.pinned = False
            self._unpin(read.holder, read.msg.request_id, read.generation)
        self.num_reads[outcome] += 1
        read.ended = True

    def _unpin(self, holder: str, request_id: str, generation: int) -> None:
        try:
            self.transport.send_notif(holder, encode(PrefixUnpin(request_id, generation)))
        except TransferError as e:  # the holder is gone: nothing is pinned there any more
            logger.warning("prefill %s: could not unpin %s at %s: %s", self.instance_id, request_id, holder, e)

    def abort(self, request_id: str) -> bool:
        """Drop ``request_id``'s read (False: none); it is not handed back by ``poll``."""
        read = self.reads.pop(request_id, None)
        if read is None:
            return False
        if not read.ended and not read.leader:
            self._end(read, "aborted")
        return True

    def holder_gone(self, instance_id: str) -> None:
        """The holder's process exited: its reads fall back to prefill (``poll`` hands them back)."""
        for read in self.reads.values():
            if read.holder == instance_id and not read.ended and not read.leader:
                read.pinned = False  # nothing is pinned on a dead holder
                self._end(read, "fallback", "the holder is gone")

    def in_flight(self) -> set[str]:
        return set(self.reads)

    def stats(self) -> dict[str, float]:
        return {**{f"remote_prefix_reads_{k}": v for k, v in self.num_reads.items()},
                "remote_prefix_read_blocks": self.num_read_blocks, "remote_prefix_read_bytes": self.num_read_bytes,
                "num_remote_prefix_reads": len(self.reads),
                "num_remote_prefix_draining_blocks": sum(len(b) for _, b in self.draining)}


class PrefixPins:
    """Holder side: the blocks pinned for other instances' reads (see the module docstring).

    A reader's pins are kept under (reader instance, its pid, request id, generation) and
    end with its ``PrefixUnpin`` or its process gone (``reader_gone``); at most
    ``MAX_PINNED_SHARE`` of the KV cache is pinned at once (a ``PrefixPin`` past that
    pins nothing).
    """

    def __init__(self, transport: NixlTransport, block_manager, instance_id: str) -> None:
        self.transport, self.bm, self.instance_id = transport, block_manager, instance_id
        self.pins: dict[tuple[str, int, str, int], list[int]] = {}
        self.num_served_blocks = 0

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(b) for b in self.pins.values())

    def on_pin(self, reader: str, msg: PrefixPin) -> None:
        budget = int(self.bm.num_blocks * MAX_PINNED_SHARE) - self.num_pinned_blocks
        key = (reader, msg.reader_pid, msg.request_id, msg.generation)
        ids = self.bm.pin(list(msg.block_hashes[:max(0, budget)])) if key not in self.pins else []
        if ids:
            self.pins[key] = ids
            self.num_served_blocks += len(ids)
        try:
            self.transport.send_notif(reader, encode(PrefixPinned(msg.request_id, msg.generation, ids)))
        except TransferError as e:
            logger.warning("prefill %s: could not answer %s's prefix pin: %s", self.instance_id, reader, e)
            self._unpin(key)

    def on_unpin(self, reader: str, msg: PrefixUnpin) -> None:
        for key in [k for k in self.pins if k[0] == reader and k[2:] == (msg.request_id, msg.generation)]:
            self._unpin(key)

    def _unpin(self, key) -> None:
        ids = self.pins.pop(key, None)
        if ids:
            self.bm.release(ids)

    def reader_gone(self, instance_id: str, pid: int) -> None:
        """Process ``pid`` of ``instance_id`` exited: its reads ended."""
        for key in [k for k in self.pins if k[0] == instance_id and k[1] in (pid, 0)]:
            self._unpin(key)

    def stats(self) -> dict[str, float]:
        return {"num_pinned_blocks": self.num_pinned_blocks, "remote_prefix_served_blocks": self.num_served_blocks}


def serve_notifications(transport: NixlTransport, reader: RemotePrefixReader, pins: PrefixPins) -> None:
    """Hand this worker's NIXL notifications to the two sides: other instances' pins and
    unpins of our blocks to ``pins``, the answers to our reads to ``reader``. Others
    (e.g. a peer prefill worker's ``KVWriterFenced``, sent to every peer) are not theirs."""
    for peer, msg in decoded_notifs(transport):
        if isinstance(msg, PrefixPin):
            pins.on_pin(peer, msg)
        elif isinstance(msg, PrefixUnpin):
            pins.on_unpin(peer, msg)
        elif isinstance(msg, PrefixPinned):
            reader.on_pinned(peer, msg)
