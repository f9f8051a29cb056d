"""The prefix cache's host tier (``epd.engine.host_kv_tier``): evicted full blocks are
kept in host memory and loaded back on a later hit, bytes intact, in LRU order; greedy
output after a load equals transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch

from epd import LLM, SamplingParams
from epd.engine.block_manager import BlockManager
from epd.engine.host_kv_tier import HostKVTier
from epd.sampling_params import SamplingParams as Params
from epd.sequence import Sequence
from tests.conftest import hf_greedy

BS = 4
NUM_BLOCKS = 6


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    """[layers 2, blocks, BS, heads 1, dim 2] with every block's K distinct."""
    k = torch.arange(2 * NUM_BLOCKS * BS * 2, dtype=torch.float32).reshape(2, NUM_BLOCKS, BS, 1, 2)
    return k, -k


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, Params(max_tokens=1))


def _run(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` (prefix hits first), compute its prompt, cache and free it; its hits."""
    hit = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hit) * BS, hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    bm.free(seq)
    return hit


def test_evicted_blocks_come_back_from_host_intact():
    k, v = _caches()
    bm = BlockManager(NUM_BLOCKS, BS)
    bm.host_tier = tier = HostKVTier(k, v, 8)
    a = list(range(100, 113))  # 3 full blocks + 1 token
    _run(bm, _seq("a", a))
    a_blocks = [bm.cached_blocks[h] for h in bm.block_hashes(_seq("x", a), 3)]
    a_kv = k[:, a_blocks].clone()
    _run(bm, _seq("b", list(range(200, 217))))  # 4 full blocks + 1: evicts some of a's
    _run(bm, _seq("c", list(range(300, 317))))  # ... and the rest
    hashes = bm.block_hashes(_seq("x", a), 3)
    assert not any(h in bm.cached_blocks for h in hashes) and all(h in tier.index for h in hashes)
    assert tier.offloads >= 3
    k[:, :] = 0  # the device blocks are overwritten by now in any case
    hit = bm.get_computed_blocks(_seq("a2", a))
    assert len(hit) == 3 and bm.prefix_cache_host_hits == 3 * BS
    assert torch.equal(k[:, hit], a_kv) and torch.equal(v[:, hit], -a_kv)
    assert all(bm.blocks[b].ref_count == 0 and b in bm.free_blocks for b in hit)  # cached, free, taken on admission


def test_full_tier_drops_least_recently_used():
    k, v = _caches()
    tier = HostKVTier(k, v, 2)
    for i, h in enumerate((b"a", b"b")):
        tier.offload(h, i)
    assert tier.lookup(b"a") is not None  # a is now the most recently used
    tier.offload(b"c", 2)
    assert set(tier.index) == {b"a", b"c"} and tier.evictions == 1
    tier.offload(b"a", 3)  # already held: no copy
    assert tier.offloads == 3
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(k, v, 0)


def test_loads_never_take_a_hit_block():
    """Every free block but the hit ones is taken by loads; then the lookup stops short."""
    k, v = _caches()
    bm = BlockManager(NUM_BLOCKS, BS)
    bm.host_tier = HostKVTier(k, v, 16)
    long = list(range(100, 121))  # 5 full blocks + 1
    _run(bm, _seq("long", long))
    hashes = bm.block_hashes(_seq("x", long), 5)
    for rid, base in (("o1", 300), ("o2", 400)):  # evict all of long's blocks to the host tier
        _run(bm, _seq(rid, list(range(base, base + 21))))
    assert not any(h in bm.cached_blocks for h in hashes)
    held = _seq("held", list(range(500, 509)))  # 2 full blocks + 1, kept running: 3 blocks in use
    assert bm.allocate_slots(held, held.num_tokens)
    hit = bm.get_computed_blocks(_seq("again", long))
    assert len(hit) == NUM_BLOCKS - 3 and len(set(hit)) == len(hit)  # the free blocks, each once
    assert [bm.cached_blocks[h] for h in hashes[:len(hit)]] == hit


def test_one_slot_tier_never_loads_the_wrong_block():
    k, v = _caches()
    bm = BlockManager(2, BS)
    bm.host_tier = HostKVTier(k[:, :2], v[:, :2], 1)
    a = list(range(100, 105))  # 1 full block + 1
    _run(bm, _seq("a", a))
    _run(bm, _seq("b", list(range(200, 205))))  # 2 blocks: a's full one is evicted to the slot
    _run(bm, _seq("c", list(range(300, 305))))  # b's evicted block takes the only slot
    assert bm.get_computed_blocks(_seq("a2", a)) == []


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return tiny_model_dirs["llama"]


def test_greedy_parity_after_eviction_to_host_and_back(llama):
    """A 12-block cache holds one 41-token conversation at a time: prompt A, then B and C
    evict A's blocks to the host tier; A again loads them back (host hits) and answers as
    transformers does, and as the same engine without the tier."""
    prompts = [list(range(20, 61)), [7 + (k * 37) % 300 for k in range(41)], [9 + (k * 53) % 400 for k in range(41)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = hf_greedy(llama, prompts[:1], 8)[0]
    llm = LLM(llama, dtype="float32", block_size=8, num_kv_blocks=12, kv_host_cache_gb=0.01)
    try:
        for p in prompts:
            llm.generate([p], params)
        s = llm.engine.stats()
        assert s["kv_host_offloaded_blocks"] >= 5 and s["prefix_cache_host_hit_tokens"] == 0
        out = llm.generate([prompts[0]], params)[0].outputs[0]
        s = llm.engine.stats()
        assert s["prefix_cache_host_hit_tokens"] == 5 * 8 and s["kv_host_loaded_blocks"] == 5
        assert list(out.token_ids) == want
        assert s["num_free_blocks"] == 12
    finally:
        llm.shutdown()


def test_host_tier_needs_tp1_and_prefix_caching(llama):
    from epd.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="needs prefix caching"):
        EngineConfig(llama, kv_host_cache_gb=1.0, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="finite number >= 0"):
        EngineConfig(llama, kv_host_cache_gb=-1.0)
