"""The router's prefix index (epd.router.kv_index) against the engine's real prefix cache.

The engine side is a real ``BlockManager`` with its KV event log on; the index is
fed only by the events it drains, exactly as a prefill worker reports them, and
must then predict, for any prompt, as many leading cached blocks as the engine's
own ``get_computed_blocks`` finds.
"""

from __future__ import annotations

import random

import pytest

from epd.engine.block_manager import BlockManager
from epd.messages import KVEvents
from epd.multimodal import Placeholder
from epd.router.kv_index import KVIndex, request_block_hashes
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

BS = 4
PID = 4242


def seq(tokens, mm=None) -> Sequence:
    kw = {}
    if mm:
        import torch

        kw = {"mm_placeholders": mm, "mm_embeddings": [torch.zeros(p.length, 2) for p in mm]}
    return Sequence("r", list(tokens), SamplingParams(), **kw)


def run(bm: BlockManager, s: Sequence) -> None:
    """Admit ``s`` as the scheduler does (prefix hits first), compute it, cache its blocks."""
    hit = bm.get_computed_blocks(s)
    assert bm.allocate_slots(s, s.num_tokens - len(hit) * BS, hit)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def report(bm: BlockManager, index: KVIndex, inst: str = "prefill-0", pid: int = PID) -> KVEvents:
    cleared, stored, removed, *_ = bm.drain_kv_events()
    ev = KVEvents(inst, pid, stored, removed, cleared)
    assert index.apply(ev, registered_pid=pid, max_hashes=bm.num_blocks)
    return ev


def overlap(index: KVIndex, tokens, inst: str = "prefill-0", placeholders=()) -> int:
    return index.overlap(request_block_hashes(list(tokens), BS, placeholders), [inst])[inst]


def test_router_hashes_equal_engine_hashes_including_media_items():
    tokens = list(range(30))
    mm = [Placeholder(5, 6, "aa" * 32)]
    engine = BlockManager(16, BS).block_hashes(seq(tokens, mm), (len(tokens) - 1) // BS)
    wire = [Placeholder(5, 6, "aa" * 32)]  # what the router holds
    assert request_block_hashes(tokens, BS, wire) == engine
    # Block 0 (tokens 0-3) has no item; blocks 1-2 overlap it, so another image changes them and all after.
    other = request_block_hashes(tokens, BS, [Placeholder(5, 6, "bb" * 32)])
    assert other[0] == engine[0] and all(a != b for a, b in zip(other[1:], engine[1:]))
    assert request_block_hashes(tokens, BS) != engine  # text-only hashes differ where the image sits


def test_stored_removed_and_cleared_events_track_the_engine_cache():
    bm = BlockManager(8, BS)
    bm.enable_kv_events()
    index = KVIndex()
    a = seq(range(13))  # 3 full blocks + 1 token
    run(bm, a)
    ev = report(bm, index)
    assert len(ev.stored) == 3 and not ev.removed and not ev.cleared
    assert overlap(index, range(20)) == 3  # the probe's first 3 blocks are cached
    assert overlap(index, [99] + list(range(1, 20))) == 0  # first block differs: nothing shared
    bm.free(a)  # freed blocks stay cached: no event
    assert bm.drain_kv_events() == (False, [], [], [], [])
    # A different prompt needing all 8 blocks evicts a's 3 cached blocks.
    b = seq(range(100, 132))
    run(bm, b)
    ev = report(bm, index)
    assert len(ev.removed) == 3 and len(ev.stored) == 8
    assert overlap(index, range(20)) == 0
    assert overlap(index, range(100, 140)) == 8
    bm.free(b)
    bm.reset_prefix_cache()
    ev = report(bm, index)
    assert ev.cleared and not ev.stored
    assert len(index) == 0 and index.num_blocks("prefill-0") == 0


def test_index_matches_get_computed_blocks_under_random_traffic():
    rng = random.Random(0)
    bm = BlockManager(24, BS)
    bm.enable_kv_events()
    index = KVIndex()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    running: list[Sequence] = []
    removed = hits = 0
    for step in range(120):
        if running and (rng.random() < 0.5 or len(running) > 3):
            bm.free(running.pop(rng.randrange(len(running))))
        else:
            s = seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
            hit = bm.get_computed_blocks(s)
            if bm.allocate_slots(s, s.num_tokens - len(hit) * BS, hit):  # False when full: skip it
                s.num_computed_tokens = s.num_tokens
                bm.cache_full_blocks(s)
                running.append(s)
        if step % 3 == 0:  # reports are batched: several changes per report
            removed += len(report(bm, index).removed)
            for p in prefixes:
                probe = seq(p + [7] * 9)
                n = overlap(index, probe.token_ids)
                assert n == len(bm.get_computed_blocks(probe)), step
                hits += n
    assert removed > 20 and hits > 20  # evictions and prefix hits both happened
    assert bm.prefix_cache_queries == 0  # (lookups above were not admissions)
    report(bm, index)
    assert index.num_blocks("prefill-0") == len(bm.cached_blocks)


def test_reports_from_another_process_are_refused_and_a_restart_drops_entries():
    bm = BlockManager(8, BS)
    bm.enable_kv_events()
    index = KVIndex()
    run(bm, seq(range(13)))
    cleared, stored, removed, *_ = bm.drain_kv_events()
    # Unknown instance (never registered) or a pid that is not the registered one: ignored.
    assert not index.apply(KVEvents("prefill-0", PID, stored), registered_pid=None)
    assert not index.apply(KVEvents("prefill-0", PID + 1, stored), registered_pid=PID)
    assert len(index) == 0
    assert index.apply(KVEvents("prefill-0", PID, stored), registered_pid=PID)
    assert index.apply(KVEvents("prefill-1", 77, stored[:2]), registered_pid=77)
    assert index.overlap(request_block_hashes(list(range(20)), BS), ["prefill-0", "prefill-1"]) == {
        "prefill-0": 3, "prefill-1": 2}
    # prefill-0 restarts: same instance id, new process. Its old entries go; prefill-1's stay.
    index.sync_pid("prefill-0", PID + 1)
    assert index.num_blocks("prefill-0") == 0
    assert index.overlap(request_block_hashes(list(range(20)), BS), ["prefill-0", "prefill-1"]) == {
        "prefill-0": 0, "prefill-1": 2}
    index.drop_instance("prefill-1")
    assert len(index) == 0 and not index.holders


@pytest.mark.parametrize("bad", [b"short", b"x" * 17])
def test_malformed_hashes_are_refused(bad):
    index = KVIndex()
    good = request_block_hashes(list(range(9)), BS)
    assert not index.apply(KVEvents("prefill-0", PID, good + [bad]), registered_pid=PID)
    assert not index.apply(KVEvents("prefill-0", PID, [], [bad]), registered_pid=PID)
    assert len(index) == 0


def test_more_hashes_than_kv_blocks_drops_the_instance():
    index = KVIndex()
    chain = request_block_hashes(list(range(41)), BS)  # 10 hashes
    assert index.apply(KVEvents("prefill-0", PID, chain[:4]), registered_pid=PID, max_hashes=8)
    assert index.num_blocks("prefill-0") == 4
    assert index.apply(KVEvents("prefill-0", PID, chain[4:]), registered_pid=PID, max_hashes=8)
    assert index.num_blocks("prefill-0") == 0 and len(index) == 0


def test_drain_reports_each_hash_once_with_its_last_change():
    bm = BlockManager(4, BS)
    bm.enable_kv_events()
    a = seq(range(9))  # 2 full blocks
    run(bm, a)
    bm.free(a)
    b = seq(range(50, 66))  # 4 blocks: evicts a's 2 within the same report window
    run(bm, b)
    cleared, stored, removed, *_ = bm.drain_kv_events()
    a_hashes = request_block_hashes(list(range(9)), BS)
    assert set(a_hashes) <= set(removed) and not set(a_hashes) & set(stored)
    assert len(stored) == 4 and len(set(stored)) == 4
    assert bm.drain_kv_events() == (False, [], [], [], [])


def test_event_log_is_off_unless_enabled():
    bm = BlockManager(4, BS)
    run(bm, seq(range(9)))
    bm.reset_prefix_cache()
    assert bm.drain_kv_events() == (False, [], [], [], [])


def _tiered_manager(tmp_path, num_blocks: int = 4, host_blocks: int = 2, disk_blocks: int = 2) -> BlockManager:
    """A KV cache of ``num_blocks`` with a host tier and a disk tier under it."""
    import torch

    from epd.engine.disk_kv_tier import DiskKVTier
    from epd.engine.host_kv_tier import HostKVTier

    k = torch.zeros(1, num_blocks, BS, 1, 2)
    bm = BlockManager(num_blocks, BS)
    bm.host_tier = HostKVTier(k, k.clone(), host_blocks, disk=DiskKVTier(tmp_path, (1, BS, 1, 2), k.dtype,
                                                                             disk_blocks))
    return bm


def test_events_say_which_tier_holds_each_block(tmp_path):
    """A block evicted from the KV cache is reported as held in the host tier, then on
    disk, then gone: the index follows, and its tier counts match the engine's
    ``tier_of`` for every block of the chains."""
    bm = _tiered_manager(tmp_path)
    bm.enable_kv_events()
    index = KVIndex(prediction_ttl_s=0)

    def step(tokens) -> tuple:
        s = seq(tokens)
        run(bm, s)
        bm.free(s)
        ev = bm.drain_kv_events()
        cleared, stored, removed, host, disk = ev
        assert index.apply(KVEvents("prefill-0", PID, stored, removed, cleared, host, disk), registered_pid=PID,
                           max_hashes=bm.num_blocks + bm.num_tier_blocks)
        return ev

    prompts = [list(range(100 * i, 100 * i + 8)) for i in range(4)]  # 2 full blocks each, no partial one
    chains = [request_block_hashes(p + [0], BS) for p in prompts]  # a probe with one more token hits both
    for p in prompts:
        step(p)
    # 4 prompts x 2 blocks in a 4-block cache: the last 2 on the device, the second in the
    # host tier, the first on disk
    assert [[bm.tier_of(h) for h in c] for c in chains] == [["disk"] * 2, ["host"] * 2, ["device"] * 2,
                                                             ["device"] * 2]
    for p, chain in zip(prompts, chains):
        assert overlap(index, p + [0]) == 2
        assert index.tier_counts(chain, "prefill-0", 2) == [sum(bm.tier_of(h) == t for h in chain)
                                                            for t in ("device", "host", "disk")]
    # One more prompt pushes the first one off the disk: gone everywhere.
    _, _, removed, host, disk = step(list(range(900, 908)))
    assert set(chains[0]) == set(removed) and set(chains[1]) == set(disk) and set(chains[2]) == set(host)
    assert overlap(index, prompts[0] + [0]) == 0 and index.tier_counts(chains[1], "prefill-0", 2) == [0, 0, 2]
    bm.host_tier.close()


def test_enabling_events_reports_what_the_tiers_already_hold(tmp_path):
    bm = _tiered_manager(tmp_path)
    for i in range(3):
        s = seq(range(100 * i, 100 * i + 8))
        run(bm, s)
        bm.free(s)
    bm.enable_kv_events()
    cleared, stored, removed, host, disk = bm.drain_kv_events()
    assert (len(stored), len(host), len(disk), removed) == (4, 2, 0, [])
    assert all(bm.tier_of(h) == "host" for h in host)
    bm.host_tier.close()
