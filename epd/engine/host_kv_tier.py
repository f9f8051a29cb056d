"""The host tier of the prefix cache: full blocks evicted from the KV cache are kept in a
bounded host-memory pool, keyed by their block hash, and copied back on a later hit
instead of being recomputed.

This is SGLang HiCache's L2 (host) layer and vLLM's ``OffloadingConnector`` (CPU
offloading of evicted blocks), for one instance. The block manager calls
:meth:`HostKVTier.offload` when it evicts a hashed block (before the block is written
again) and :meth:`HostKVTier.lookup` / :meth:`HostKVTier.load` to extend a prefix-cache
hit past the blocks still on the device. On the CPU both pools are DRAM, so the tier adds
capacity bounded apart from the hot pool; on CUDA the copies are VRAM <-> host.
The copies are synchronous (a block is a few hundred KiB): see docs/architecture.md.
With a disk tier under it (``epd.engine.disk_kv_tier``), what the host tier evicts is
written there, and a lookup that misses the host reads the block back from disk into a
host slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from epd.engine.disk_kv_tier import DiskKVTier

__all__ = ["HostKVTier"]


class HostKVTier:
    """``num_host_blocks`` host slots, each one KV block of every layer (K and V).

    ``k_cache`` / ``v_cache``: the instance's KV cache, [num_layers, num_blocks,
    block_size, num_kv_heads, head_dim] of the storage dtype (a quantized cache's
    uint8 rows included); the host pool has the same layout with ``num_host_blocks``
    blocks. Slots are reused in LRU order: a hash stored when the tier is full evicts
    the least recently stored or hit one (counted in ``evictions``).

    ``disk``: the tier below (None: evicted entries are dropped).

    Raises:
        ValueError: ``num_host_blocks`` < 1.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_host_blocks: int,
                 disk: DiskKVTier | None = None) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_host_blocks}")
        self.k_cache, self.v_cache = k_cache, v_cache
        shape = (k_cache.shape[0], num_host_blocks, *k_cache.shape[2:])
        pin = k_cache.device.type == "cuda"
        self.host_k = torch.zeros(shape, dtype=k_cache.dtype, pin_memory=pin)
        self.host_v = torch.zeros(shape, dtype=v_cache.dtype, pin_memory=pin)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.free_slots = list(range(num_host_blocks - 1, -1, -1))
        self.offloads = 0  # blocks copied device -> host
        self.loads = 0  # blocks copied host -> device
        self.evictions = 0  # host entries dropped (or moved to disk) for newer ones
        self.disk = disk
        self.disk_hits = 0  # lookups served from the disk tier
        # Called with a hash this tier (or its disk tier) just moved down or dropped; the
        # block manager's KV cache event log (set when it is attached there).
        self.on_change: Callable[[bytes], None] | None = None
        if disk is not None:
            disk.on_drop = self._changed

    def _changed(self, block_hash: bytes) -> None:
        if self.on_change is not None:
            self.on_change(block_hash)

    @property
    def num_blocks(self) -> int:
        return self.host_k.shape[1]

    def __len__(self) -> int:
        return len(self.index)

    def offload(self, block_hash: bytes, block_id: int) -> None:
        """Keep device block ``block_id`` (holding ``block_hash``'s KV) in the tier. A hash
        already held is only marked recently used (its KV is the same)."""
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return
        slot = self._take_slot()
        self.host_k[:, slot].copy_(self.k_cache[:, block_id])
        self.host_v[:, slot].copy_(self.v_cache[:, block_id])
        self.index[block_hash] = slot
        self.offloads += 1

    def _take_slot(self) -> int:
        """A free slot; when none is, the least recently used entry's (moved to the disk
        tier when there is one)."""
        if self.free_slots:
            return self.free_slots.pop()
        block_hash, slot = self.index.popitem(last=False)
        self.evictions += 1
        if self.disk is not None:
            self.disk.store(block_hash, self.host_k[:, slot], self.host_v[:, slot])
        self._changed(block_hash)  # now on disk, or gone
        return slot

    def __contains__(self, block_hash: bytes) -> bool:
        """``block_hash`` is held here or on the disk tier."""
        return block_hash in self.index or (self.disk is not None and block_hash in self.disk)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (marked recently used), read back from the disk
        tier into a host slot when only the disk holds it; None when neither does."""
        slot = self.index.get(block_hash)
        if slot is not None:
            self.index.move_to_end(block_hash)
            return slot
        if self.disk is None or not self.disk.readable(block_hash):  # (a failed write: a miss)
            return None
        slot = self._take_slot()  # (the entry it moves down to disk does not displace this one: now MRU there)
        if not self.disk.load(block_hash, self.host_k[:, slot], self.host_v[:, slot]):
            self.free_slots.append(slot)  # a one-block disk tier just gave its slot to the entry moved down
            return None
        self.index[block_hash] = slot
        self.disk_hits += 1
        return slot

    def load(self, slot: int, block_id: int) -> None:
        """Copy host ``slot`` into device block ``block_id`` (the caller just took it)."""
        self.k_cache[:, block_id].copy_(self.host_k[:, slot])
        self.v_cache[:, block_id].copy_(self.host_v[:, slot])
        self.loads += 1

    def clear(self) -> None:
        """Forget every entry (the slots' bytes stay until overwritten)."""
        self.free_slots = list(range(self.num_blocks - 1, -1, -1))
        self.index.clear()
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, float]:
        return {"kv_host_blocks": self.num_blocks, "kv_host_used_blocks": len(self.index),
                "kv_host_offloaded_blocks": self.offloads, "kv_host_loaded_blocks": self.loads,
                "kv_host_evicted_blocks": self.evictions, **(self.disk.stats() if self.disk is not None else {})}
