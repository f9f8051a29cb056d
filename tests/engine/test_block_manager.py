"""BlockManager: hash chain, prefix cache hits, ref counts, LRU eviction, allocation.

No model: sequences are built from small token-id lists and "computed" by setting
``num_computed_tokens`` by hand, as the scheduler's ``update`` does.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from epd.engine.block_manager import BlockManager, hash_block
from epd.multimodal import Placeholder
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

BS = 4
_TAKES_EMBEDDINGS = "mm_embeddings" in inspect.signature(Sequence.__init__).parameters


def make_seq(tokens, mm=None) -> Sequence:
    kw = {}
    if mm and _TAKES_EMBEDDINGS:  # one [length, hidden] tensor per placeholder; values unused here
        kw["mm_embeddings"] = [torch.zeros(p.length, 2) for p in mm]
    return Sequence("req", list(tokens), SamplingParams(), mm_placeholders=mm, **kw)


def compute_and_cache(bm: BlockManager, seq: Sequence, computed_blocks=None) -> None:
    """Allocate the whole sequence, mark every token computed, hash its full blocks."""
    hit = computed_blocks or []
    num_new = seq.num_tokens - len(hit) * BS
    assert bm.allocate_slots(seq, num_new, hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def free_ids(bm: BlockManager) -> list[int]:
    """Free block ids in eviction order (first = evicted first)."""
    return list(bm.free_blocks)


# ---- hash chain ------------------------------------------------------------

def test_same_prefix_gives_same_hashes_and_hashes_are_a_chain():
    bm = BlockManager(8, BS)
    a = make_seq(range(12))
    b = make_seq(list(range(12)) + [99, 98, 97, 96])
    ha = bm.block_hashes(a, 3)
    hb = bm.block_hashes(b, 4)
    assert ha == hb[:3]
    assert len(set(hb)) == 4  # every block of the chain has its own hash
    # The chain: block i hashes (hash of block i-1, tokens of block i).
    parent = None
    for i, h in enumerate(hb):
        parent = hash_block(parent, b.token_ids[i * BS:(i + 1) * BS])
        assert h == parent
    assert all(len(h) == 16 for h in hb)


def test_equal_block_tokens_after_different_prefix_hash_differently():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 9, 9, 9, 9])
    b = make_seq([5, 6, 7, 8, 9, 9, 9, 9])
    assert bm.block_hashes(a, 2)[1] != bm.block_hashes(b, 2)[1]


def test_token_change_in_block0_changes_every_later_hash():
    bm = BlockManager(8, BS)
    base = list(range(16))
    changed0 = list(base)
    changed0[1] = 1000
    changed2 = list(base)
    changed2[9] = 1000  # block 2
    h = bm.block_hashes(make_seq(base), 4)
    h0 = bm.block_hashes(make_seq(changed0), 4)
    h2 = bm.block_hashes(make_seq(changed2), 4)
    assert all(x != y for x, y in zip(h, h0))
    assert h2[:2] == h[:2]
    assert h2[2] != h[2] and h2[3] != h[3]


def test_media_extra_keys_change_exactly_overlapped_and_later_blocks():
    bm = BlockManager(8, BS)
    tokens = [7] * 20  # same placeholder token everywhere: only item hashes differ
    # Span [5, 7) lies in block 1 only.
    img_a = make_seq(tokens, [Placeholder(5, 2, "aa" * 32)])
    img_b = make_seq(tokens, [Placeholder(5, 2, "bb" * 32)])
    plain = make_seq(tokens)
    ha, hb, hp = (bm.block_hashes(s, 5) for s in (img_a, img_b, plain))
    assert ha[0] == hb[0] == hp[0]
    for i in range(1, 5):
        assert ha[i] != hb[i] and ha[i] != hp[i] and hb[i] != hp[i]
    # Only the overlapped block carries the key; later blocks differ through the chain.
    assert [img_a.block_extra_keys(i, BS) for i in range(5)] == [(), ("aa" * 32,), (), (), ()]

    # Span [3, 9) overlaps blocks 0, 1 and 2 (half-open ends: block 2 starts at 8).
    wide = make_seq(tokens, [Placeholder(3, 6, "cc")])
    assert [wide.block_extra_keys(i, BS) for i in range(5)] == [("cc",), ("cc",), ("cc",), (), ()]
    hw = bm.block_hashes(wide, 5)
    assert all(x != y for x, y in zip(hw, hp))
    # Span [4, 8) is exactly block 1: blocks 0 and 2 do not carry it.
    exact = make_seq(tokens, [Placeholder(4, 4, "dd")])
    assert [exact.block_extra_keys(i, BS) for i in range(3)] == [(), ("dd",), ()]
    assert bm.block_hashes(exact, 1) == hp[:1]


def test_different_image_gets_no_prefix_hit_past_the_image():
    bm = BlockManager(16, BS)
    tokens = [3] * 16
    a = make_seq(tokens, [Placeholder(6, 4, "aa")])  # blocks 1, 2
    compute_and_cache(bm, a)
    b = make_seq(tokens + [1], [Placeholder(6, 4, "bb")])
    assert bm.get_computed_blocks(b) == a.block_table[:1]
    same = make_seq(tokens + [1], [Placeholder(6, 4, "aa")])
    assert bm.get_computed_blocks(same) == a.block_table[:4]


# ---- prefix hits ---------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3])
def test_computed_blocks_never_cover_the_last_token(k):
    bm = BlockManager(16, BS)
    first = make_seq(range(k * BS + BS))  # caches k + 1 blocks
    compute_and_cache(bm, first)
    assert len(bm.cached_blocks) == k + 1
    exact = make_seq(range(k * BS))
    assert bm.get_computed_blocks(exact) == first.block_table[:k - 1]
    one_more = make_seq(range(k * BS + 1))
    assert bm.get_computed_blocks(one_more) == first.block_table[:k]


def test_freed_blocks_stay_cached_and_are_reused_by_an_equal_prompt():
    bm = BlockManager(8, BS)
    a = make_seq(range(10))  # 2 full blocks + 2 tokens
    compute_and_cache(bm, a)
    table_a = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 8
    assert set(bm.cached_blocks.values()) == set(table_a[:2])

    b = make_seq(range(10))
    hit = bm.get_computed_blocks(b)
    assert hit == table_a[:2]
    assert bm.allocate_slots(b, 2, hit)
    assert b.block_table[:2] == table_a[:2]
    assert len(b.block_table) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    assert all(i not in bm.free_blocks for i in b.block_table)


def test_two_live_sequences_share_blocks_with_ref_counts():
    bm = BlockManager(8, BS)
    a = make_seq(range(9))
    compute_and_cache(bm, a)
    b = make_seq(list(range(8)) + [50, 51])
    hit = bm.get_computed_blocks(b)
    assert hit == a.block_table[:2]
    assert bm.allocate_slots(b, 2, hit)
    free_before = bm.num_free_blocks
    assert free_before == 8 - 3 - 1  # shared blocks are not allocated twice
    for i in hit:
        assert bm.blocks[i].ref_count == 2

    bm.free(a)
    for i in hit:
        assert bm.blocks[i].ref_count == 1
        assert i not in bm.free_blocks  # still held by b
    assert bm.num_free_blocks == free_before + 1  # only a's own last block came back
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_duplicate_block_eviction_keeps_the_first_writers_cache_entry():
    bm = BlockManager(4, BS)
    a = make_seq(range(5))
    b = make_seq(range(5))
    # Both computed before either is cached (same step): two blocks, one hash.
    assert bm.allocate_slots(a, 5) and bm.allocate_slots(b, 5)
    a.num_computed_tokens = b.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    h = bm.blocks[a.block_table[0]].block_hash
    assert h == bm.blocks[b.block_table[0]].block_hash
    assert bm.cached_blocks[h] == a.block_table[0]
    bm.free(b)
    # Evict every free block (b's duplicate among them).
    filler = make_seq([90] * (bm.num_free_blocks * BS))
    assert bm.allocate_slots(filler, filler.num_tokens)
    assert bm.cached_blocks.get(h) == a.block_table[0]
    assert bm.get_computed_blocks(make_seq(range(5))) == a.block_table[:1]


# ---- eviction --------------------------------------------------------------

def test_lru_evicts_tail_of_a_freed_prompt_before_its_head():
    bm = BlockManager(6, BS)
    a = make_seq(range(12))  # 3 full blocks
    compute_and_cache(bm, a)
    head, mid, tail = a.block_table
    bm.free(a)
    # Never-used blocks first, then a's blocks tail first.
    assert free_ids(bm)[-3:] == [tail, mid, head]

    other = make_seq([100] * 16)  # needs 4 blocks: 3 never used + a's tail
    assert bm.allocate_slots(other, 16)
    assert tail in other.block_table and head not in other.block_table and mid not in other.block_table
    again = make_seq(list(range(12)) + [5])
    assert bm.get_computed_blocks(again) == [head, mid]


def test_unhashed_freed_blocks_are_reused_before_hashed_ones():
    bm = BlockManager(6, BS)
    cached = make_seq(range(8))
    compute_and_cache(bm, cached)
    # A sequence with a partial last block: block 0 hashed, block 1 not.
    partial = make_seq([40] * 6)
    compute_and_cache(bm, partial)
    # A sequence that never computed anything: no hashes at all.
    scratch = make_seq([60] * 8)
    assert bm.allocate_slots(scratch, 8)
    bm.free(cached)
    bm.free(partial)
    bm.free(scratch)
    hashed = {b for b in range(6) if bm.blocks[b].block_hash is not None}
    order = free_ids(bm)
    n_unhashed = 6 - len(hashed)
    assert n_unhashed == 3  # partial's last block + scratch's two blocks
    assert all(bm.blocks[b].block_hash is None for b in order[:n_unhashed])
    assert all(bm.blocks[b].block_hash is not None for b in order[n_unhashed:])

    # Reusing the three un-hashed blocks evicts nothing from the prefix cache.
    n_cached = len(bm.cached_blocks)
    new = make_seq([70] * 12)
    assert bm.allocate_slots(new, 12)
    assert len(bm.cached_blocks) == n_cached == 3


def test_evicted_block_leaves_cached_blocks_and_gets_a_new_hash():
    bm = BlockManager(2, BS)
    a = make_seq(range(8))
    compute_and_cache(bm, a)
    old_hashes = bm.block_hashes(a, 2)
    assert set(bm.cached_blocks) == set(old_hashes)
    bm.free(a)
    b = make_seq([200] * 8)
    compute_and_cache(bm, b)
    new_hashes = bm.block_hashes(b, 2)
    assert set(bm.cached_blocks) == set(new_hashes)
    for h in old_hashes:
        assert h not in bm.cached_blocks
    for i, blk in enumerate(b.block_table):
        assert bm.blocks[blk].block_hash == new_hashes[i]
        assert bm.cached_blocks[new_hashes[i]] == blk
    assert bm.get_computed_blocks(make_seq(range(9))) == []


# ---- allocation --------------------------------------------------------------

def test_allocate_slots_rounds_up_to_blocks_and_grows_incrementally():
    bm = BlockManager(8, BS)
    s = make_seq(range(5))
    assert bm.allocate_slots(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    s.num_computed_tokens = 5
    assert bm.allocate_slots(s, 3)  # positions 5..7 fit in block 1
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    assert bm.allocate_slots(s, 4)  # positions 5..8 need block 2
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert len(set(s.block_table)) == 3


def test_allocate_slots_false_changes_nothing():
    bm = BlockManager(3, BS)
    s = make_seq(range(13))
    assert not bm.allocate_slots(s, 13)
    assert s.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(s, 12)
    s.num_computed_tokens = 12
    table = list(s.block_table)
    assert not bm.allocate_slots(s, 1)
    assert s.block_table == table and bm.num_free_blocks == 0


def test_allocate_slots_false_with_prefix_hit_touches_no_cached_block():
    bm = BlockManager(4, BS)
    a = make_seq(range(8))
    compute_and_cache(bm, a)
    table_a = list(a.block_table)
    bm.free(a)
    lru = free_ids(bm)
    cached = dict(bm.cached_blocks)
    # Hits a's 2 blocks but needs 3 more: 2 (hit, free) + 3 > 4 free.
    b = make_seq(list(range(8)) + [1] * 12)
    hit = bm.get_computed_blocks(b)
    assert hit == table_a
    assert not bm.allocate_slots(b, 12, hit)
    assert b.block_table == []
    assert free_ids(bm) == lru
    assert bm.cached_blocks == cached
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    # Needing exactly what is left succeeds: 2 hit blocks + 2 new.
    c = make_seq(list(range(8)) + [1] * 8)
    hit = bm.get_computed_blocks(c)
    assert bm.allocate_slots(c, 8, hit)
    assert bm.num_free_blocks == 0 and c.block_table[:2] == hit


def test_freeing_everything_returns_all_blocks():
    bm = BlockManager(10, BS)
    seqs = [make_seq(range(n)) for n in (3, 9, 9, 14)]
    for s in seqs:
        hit = bm.get_computed_blocks(s)
        compute_and_cache(bm, s, hit)
    assert bm.num_free_blocks < 10 and bm.usage() > 0
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks == 10
    assert bm.usage() == 0.0
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert sorted(free_ids(bm)) == list(range(10))


# ---- counters and switches -------------------------------------------------

def test_prefix_cache_counters_count_tokens():
    """Counters move only when a lookup is recorded (on admission), in tokens."""
    bm = BlockManager(16, BS)
    a = make_seq(range(10))
    assert bm.get_computed_blocks(a) == []
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)  # lookups alone count nothing
    bm.record_prefix_lookup(a.num_tokens, 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    compute_and_cache(bm, a)
    b = make_seq(list(range(8)) + [77] * 5)
    hit = bm.get_computed_blocks(b)
    assert len(hit) == 2
    bm.record_prefix_lookup(b.num_tokens, len(hit) * BS)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (23, 8)
    c = make_seq(range(4))  # one block but the last token is never a hit
    assert bm.get_computed_blocks(c) == []
    off = BlockManager(4, BS, enable_prefix_caching=False)
    off.record_prefix_lookup(10, 0)
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


def test_disabled_prefix_caching_never_hashes_or_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(range(12))
    compute_and_cache(bm, a)
    assert bm.cached_blocks == {}
    assert all(blk.block_hash is None for blk in bm.blocks)
    bm.free(a)
    assert bm.get_computed_blocks(make_seq(range(13))) == []
    assert bm.prefix_cache_queries == 0


def test_reset_prefix_cache_forgets_hits():
    bm = BlockManager(8, BS)
    a = make_seq(range(8))
    compute_and_cache(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.cached_blocks == {}
    assert bm.get_computed_blocks(make_seq(range(9))) == []


def test_pinned_blocks_survive_eviction_and_come_back_cached():
    """Remote prefix reads: ``pin`` holds cached blocks against eviction until ``release``;
    ``allocate_blocks`` / ``commit_remote`` cache read blocks (a hash cached meanwhile wins)."""
    from epd.block_hash import iter_block_hashes

    bm = BlockManager(num_blocks=6, block_size=4)
    s = Sequence("a", list(range(12)), SamplingParams())
    assert bm.allocate_slots(s, 12)
    s.num_computed_tokens = 12
    bm.cache_full_blocks(s)
    bm.free(s)
    hashes = list(iter_block_hashes(list(range(12)), 4, [], 3))
    pinned = bm.pin(hashes[:2] + [b"x" * 16] + hashes[2:])  # stops at the first hash it lacks
    assert pinned == [bm.cached_blocks[h] for h in hashes[:2]] and bm.num_free_blocks == 4
    assert bm.allocate_blocks(5) is None and bm.num_free_blocks == 4  # nothing taken
    taken = bm.allocate_blocks(4)  # evicts everything but the pinned blocks
    assert hashes[2] not in bm.cached_blocks and all(h in bm.cached_blocks for h in hashes[:2])
    bm.release(pinned)
    assert bm.num_free_blocks == 2 and all(h in bm.cached_blocks for h in hashes[:2])
    bm.commit_remote(taken[:2], [hashes[0], hashes[2]])  # hashes[0] is still cached in its own block
    assert bm.cached_blocks[hashes[0]] == pinned[0] and bm.cached_blocks[hashes[2]] == taken[1]
    assert bm.blocks[taken[0]].block_hash is None and bm.prefix_cache_remote_hits == 4
    bm.release(taken[2:])
    assert bm.num_free_blocks == 6
