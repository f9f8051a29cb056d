"""KV cache blocks: allocation, reference counts and the prefix cache.

Design follows vLLM v1 (``core/block_pool.py`` + ``core/kv_cache_manager.py``)
and nano-vllm's ``BlockManager``: a full block's hash chains its parent's hash,
its token ids and any extra keys (media item hashes), so two sequences share a
block only when everything before and inside it is equal. Freed blocks keep
their hash and stay reusable until evicted in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict

from epd.block_hash import hash_block, iter_block_hashes
from epd.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens.

    Invariants: a block is in ``free_blocks`` iff its ref_count is 0; a hashed
    block is in ``cached_blocks`` under its hash (first writer wins).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order: the first entry is evicted first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.prefix_cache_host_hits = 0  # of the blocks found, tokens loaded back from the host tier
        self.prefix_cache_disk_hits = 0  # ... of which the host tier read back from its disk tier
        self.prefix_cache_remote_hits = 0  # tokens read from another instance's KV cache (commit_remote)
        # The host tier (epd.engine.host_kv_tier.HostKVTier; None: off): evicted hashed
        # blocks are kept there, and a lookup continues there past the device's hits.
        self._host_tier = None
        # KV cache event log (off unless ``enable_kv_events``): hash -> the tier holding it
        # after its last change since the previous drain ("device", "host", "disk"; None:
        # gone); ``_kv_cleared``: reset in between.
        self._kv_events: dict[bytes, str | None] | None = None
        self._kv_cleared = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def host_tier(self):
        """The host tier (``HostKVTier``; None: off); setting it subscribes the KV cache
        event log to the hashes it (and its disk tier) keep or drop."""
        return self._host_tier

    @host_tier.setter
    def host_tier(self, tier) -> None:
        self._host_tier = tier
        if tier is not None:
            tier.on_change = self._tier_changed

    @property
    def num_tier_blocks(self) -> int:
        """Blocks the host and disk tiers hold beyond the KV cache."""
        t = self._host_tier
        return 0 if t is None else t.num_blocks + (t.disk.num_blocks if t.disk is not None else 0)

    def tier_of(self, block_hash: bytes) -> str | None:
        """Where this instance holds ``block_hash``'s KV, nearest first: "device" (the KV
        cache), "host", "disk", or None."""
        if block_hash in self.cached_blocks:
            return "device"
        t = self._host_tier
        if t is not None:
            if block_hash in t.index:
                return "host"
            if t.disk is not None and block_hash in t.disk:
                return "disk"
        return None

    def _tier_changed(self, block_hash: bytes) -> None:
        self._record_kv_event(block_hash, self.tier_of(block_hash))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- prefix cache -------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hash chain of the first ``num_blocks`` full blocks of ``seq``."""
        return list(iter_block_hashes(seq.token_ids, self.block_size, seq.mm_placeholders, num_blocks))

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (full blocks only).

        At least one token is always left to compute so the step yields logits.
        Past the blocks on the device, the host tier's blocks are loaded back into
        free blocks (which then count as device cache hits: cached and free until the
        caller's ``allocate_slots`` takes them), while free blocks other than the hit
        ones remain. The caller records admitted lookups with ``record_prefix_lookup``.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        protected = 0  # (host tier) hit blocks that are free, moved to the MRU end: no load takes them
        for block_hash in iter_block_hashes(seq.token_ids, self.block_size, seq.mm_placeholders, max_blocks):
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None and self.host_tier is not None:
                block_id = self._load_from_host(block_hash, protected)
            if block_id is None:
                break
            if self.host_tier is not None and block_id in self.free_blocks:
                self.free_blocks.move_to_end(block_id)
                protected += 1
            hit.append(block_id)
        return hit

    def _load_from_host(self, block_hash: bytes, protected: int) -> int | None:
        """Load ``block_hash``'s block from the host tier into a free block, now cached
        and free (most recently used); None when the tier lacks it or no free block is
        left but the ``protected`` ones at the MRU end (the lookup's hits: a load never
        takes one)."""
        if block_hash not in self.host_tier:
            return None
        if len(self.free_blocks) <= protected:
            return None
        block_id = self._pop_free_block()  # (it may offload the block it evicts: looked up again below)
        block = self.blocks[block_id]
        block.ref_count = 0
        from_disk = self.host_tier.disk_hits
        slot = self.host_tier.lookup(block_hash)  # (read back from the disk tier if only it holds it)
        if slot is None:  # a one-block tier just gave its slot to the evicted block, or a disk write failed
            self.free_blocks[block_id] = None
            self.free_blocks.move_to_end(block_id, last=False)  # unhashed: taken first
            return None
        self.host_tier.load(slot, block_id)
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block_id
        self._record_kv_event(block_hash, "device")
        self.free_blocks[block_id] = None
        self.prefix_cache_host_hits += self.block_size
        if self.host_tier.disk_hits > from_disk:
            self.prefix_cache_disk_hits += self.block_size
        return block_id

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (tokens)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``.

        ``computed_blocks`` (first schedule only) are prefix-cache hits that
        become the head of the block table. Returns False, changing nothing,
        when not enough free blocks exist.
        """
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = needed - len(seq.block_table) - len(computed_blocks)
        # Cached blocks that are currently free stop being free once touched.
        num_touched_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_touched_free > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(max(0, num_new_blocks)):
            seq.block_table.append(self._pop_free_block())
        return True

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                if self.host_tier is not None:  # evicted: its KV goes to the host tier before it is overwritten
                    self.host_tier.offload(block.block_hash, block_id)
                del self.cached_blocks[block.block_hash]
                self._record_kv_event(block.block_hash, self.tier_of(block.block_hash))  # host, or gone
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Give a hash to every block of ``seq`` whose tokens are all computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        parent = None
        bs = self.block_size
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                parent = block.block_hash
                continue
            parent = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.block_extra_keys(i, bs))
            block.block_hash = parent
            if self.cached_blocks.setdefault(parent, block.block_id) == block.block_id:
                self._record_kv_event(parent, "device")

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; hashed blocks stay cached until evicted.

        Blocks are released tail first, so the end of a prompt is evicted before
        its (more shareable) beginning.
        """
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference of each of ``block_ids``, last first; a block left unreferenced
        is free (a hashed one stays cached, evicted last; an unhashed one is taken first)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)

    # ---- remote prefix reads (epd.transfer.remote_prefix) -------------------------
    def pin(self, block_hashes: list[bytes]) -> list[int]:
        """Holder side: take a reference on the blocks of the leading ``block_hashes`` that
        the KV cache holds (not the tiers), so no allocation evicts or reuses them while
        another instance reads them; returns their ids, in order (``release`` unpins)."""
        ids: list[int] = []
        for h in block_hashes:
            block_id = self.cached_blocks.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        for block_id in ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        return ids

    def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Reader side: ``num_blocks`` free blocks, referenced and unhashed, for KV that a
        remote read writes; None (nothing taken) when fewer are free."""
        if num_blocks > self.num_free_blocks:
            return None
        return [self._pop_free_block() for _ in range(num_blocks)]

    def commit_remote(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Reader side: ``block_ids`` (from ``allocate_blocks``) now hold the KV of
        ``block_hashes``: cache them under those hashes (a hash cached meanwhile keeps
        its block; the read copy stays unhashed) and release them, so the next lookup of
        the prompt hits them."""
        for block_id, h in zip(block_ids, block_hashes):
            if h in self.cached_blocks:
                continue
            self.blocks[block_id].block_hash = h
            self.cached_blocks[h] = block_id
            self._record_kv_event(h, "device")
            self.prefix_cache_remote_hits += self.block_size
        self.release(block_ids)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        if self._kv_events is not None:
            self._kv_events.clear()
            self._kv_cleared = True

    # ---- KV cache events (for KV-aware routing) --------------------------------
    def enable_kv_events(self) -> None:
        """Start logging which block hashes enter and leave the prefix cache (workers
        whose router routes by KV overlap turn this on; the first drain reports the
        hashes already cached)."""
        if self._kv_events is None:
            self._kv_events = dict.fromkeys(self.cached_blocks, "device")
            t = self._host_tier
            if t is not None:
                for h in (*(t.disk.index if t.disk is not None else ()), *t.index):
                    self._kv_events.setdefault(h, self.tier_of(h))

    def _record_kv_event(self, block_hash: bytes, tier: str | None) -> None:
        if self._kv_events is not None:
            self._kv_events.pop(block_hash, None)  # keep the order of last changes
            self._kv_events[block_hash] = tier

    def drain_kv_events(self) -> tuple[bool, list[bytes], list[bytes], list[bytes], list[bytes]]:
        """Net prefix-cache changes since the previous drain: ``(cleared, stored, removed,
        stored_host, stored_disk)``, as ``KVEvents`` carries them.

        ``stored``: hashes now in the KV cache; ``stored_host`` / ``stored_disk``: now
        only in the host / disk tier; ``removed``: now held nowhere. Applying them
        (forget everything if ``cleared``, drop ``removed``, set the rest) turns the
        previous state into the current one: each hash appears once, with its last
        change. Hashes are 16-byte ``iter_block_hashes`` digests. Returns
        ``(False, [], [], [], [])`` when nothing changed or events are off. The log
        holds at most the hashes touched between two drains.
        """
        if not self._kv_events and not self._kv_cleared:
            return False, [], [], [], []
        events, cleared = self._kv_events, self._kv_cleared
        self._kv_events, self._kv_cleared = {}, False
        by_tier: dict[str | None, list[bytes]] = {"device": [], None: [], "host": [], "disk": []}
        for h, tier in events.items():
            by_tier[tier].append(h)
        return cleared, by_tier["device"], by_tier[None], by_tier["host"], by_tier["disk"]
