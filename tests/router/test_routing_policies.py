"""Routing policies (epd.router.policies) on hand-built pools, and the Router wiring them up.

Workers are ``WorkerHandle``s with real ``WorkerReady`` / ``Heartbeat`` messages and
no socket (policies never send); the last tests build a real ``Router`` and feed
it ``KVEvents`` through its message dispatch.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from epd.engine.block_manager import BlockManager
from epd.messages import Heartbeat, KVEvents, KVLayout, WorkerReady
from epd.multimodal import Placeholder
from epd.router.kv_index import KVIndex, request_block_hashes
from epd.router.policies import (
    POLICIES,
    FreeKVDecode,
    KVAwarePrefill,
    LeastLoaded,
    MediaAffinity,
    NoInstanceError,
    RoundRobin,
    build_policy,
    prefix_holder,
)
from epd.router.registry import WorkerHandle
from epd.router.router import Router, RouterRequest
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence

BS = 4


def layout(num_blocks: int = 64) -> KVLayout:
    return KVLayout(2, num_blocks, BS, 2, 16, "float32", [], [])


def ready(inst: str, role: str = "prefill", pid: int | None = None, num_blocks: int = 64) -> WorkerReady:
    return WorkerReady(role, inst, pid if pid is not None else 1000 + int(inst[-1]), "tcp://127.0.0.1:1", b"", [],
                       layout(num_blocks) if role != "encode" else None)


def worker(inst: str, role: str = "prefill", *, inflight: int = 0, running: int = 0, waiting: int = 0,
           free: int = 64, pid: int | None = None) -> WorkerHandle:
    w = WorkerHandle(ready(inst, role, pid), None)  # type: ignore[arg-type]
    w.inflight = inflight
    w.load = Heartbeat(inst, running, waiting, free, 64)
    return w


def request(tokens, items=()) -> RouterRequest:
    return RouterRequest("r", list(tokens), SamplingParams(), list(items))


class Item:
    def __init__(self, item_hash: str) -> None:
        self.item_hash = item_hash


def cache(index: KVIndex, w: WorkerHandle, tokens) -> None:
    """``w``'s engine caches ``tokens``' full blocks (reported through a real BlockManager)."""
    bm = BlockManager(64, BS)
    bm.enable_kv_events()
    s = Sequence("c", list(tokens), SamplingParams())
    assert bm.allocate_slots(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    cleared, stored, removed, *_ = bm.drain_kv_events()
    assert index.apply(KVEvents(w.instance_id, w.info.pid, stored, removed, cleared), w.info.pid)


# ---- round-robin / least-loaded ------------------------------------------------------
def test_round_robin_takes_live_instances_in_turn_and_skips_dead_ones():
    rr = RoundRobin()
    a, b, c = worker("prefill-0"), worker("prefill-1"), worker("prefill-2")
    assert [rr.select([c, a, b]).instance_id for _ in range(4)] == ["prefill-0", "prefill-1", "prefill-2",
                                                                    "prefill-0"]
    assert rr.select([a, c]).instance_id in ("prefill-0", "prefill-2")  # b dead: never picked
    with pytest.raises(NoInstanceError):
        rr.select([])


def test_least_loaded_prefers_fewest_open_requests_then_busy_then_free_blocks():
    ll = LeastLoaded()
    assert ll.select([worker("d-0", inflight=2), worker("d-1", inflight=1)]).instance_id == "d-1"
    assert ll.select([worker("d-0", running=3), worker("d-1", running=1)]).instance_id == "d-1"
    assert ll.select([worker("d-0", free=10), worker("d-1", free=30)]).instance_id == "d-1"
    assert ll.select([worker("d-1"), worker("d-0")]).instance_id == "d-0"  # ties: instance id


# ---- KV-aware prefill ---------------------------------------------------------------
SYSTEM = list(range(1, 41))  # 10 blocks


def test_kv_policy_sends_a_shared_prefix_to_the_instance_that_caches_it():
    index = KVIndex()
    kv = KVAwarePrefill(index, remote_reads=False)  # (local cost; remote reads: below)
    p0, p1 = worker("prefill-0"), worker("prefill-1")
    cache(index, p1, SYSTEM + [90, 91, 92, 93])
    req = request(SYSTEM + [7, 8, 9])  # 11 blocks, the first 10 cached on p1
    costs = kv.costs([p0, p1], req)
    assert costs["prefill-0"] == (11.0, 11, 0) and costs["prefill-1"] == (1.0, 11, 10)
    assert kv.select([p0, p1], req) is p1
    # Prompts sharing nothing tie on cost; ties go to the instance given fewer requests so far.
    assert kv.select([p0, p1], request([500, 501, 502] * 8)) is p0
    assert [kv.select([p0, p1], request([700 + i] * 8)) for i in range(4)] == [p0, p1, p0, p1]


def test_kv_policy_weighs_open_blocks_against_the_overlap():
    index = KVIndex(prediction_ttl_s=0)  # reported blocks only: routing decisions predict nothing here
    kv = KVAwarePrefill(index, overlap_weight=1.0, remote_reads=False)
    p0, p1 = worker("prefill-0"), worker("prefill-1")
    cache(index, p1, SYSTEM + [0])
    # Route three long unrelated prompts to p1 (they stay open: the router counts them in inflight).
    for i in range(3):
        long_prompt = [1000 + i] * 40  # 10 blocks each, nothing cached
        w = kv.select([p1], request(long_prompt))
        w.inflight += 1
    assert kv.open_blocks(p1) == 30
    req = request(SYSTEM + [7])  # 11 blocks, 10 cached on p1: cost p1 = 1 + 30 > p0 = 11 + 0
    assert kv.select([p0, p1], req) is p0
    # With a heavier overlap weight the cached prefix wins again: p1 = 4 x 1 + 30 < p0 = 4 x 11.
    kv3 = KVAwarePrefill(index, overlap_weight=4.0, remote_reads=False)
    kv3._open = {"prefill-1": kv._open["prefill-1"]}
    assert kv3.select([p0, p1], req) is p1
    # Requests that finished (inflight back down) no longer count as load.
    p1.inflight = 0
    assert kv.open_blocks(p1) == 0
    assert kv.select([p0, p1], req) is p1


def test_kv_policy_predicts_a_routed_prefix_until_the_report_arrives():
    index = KVIndex(prediction_ttl_s=5.0)
    kv = KVAwarePrefill(index, remote_reads=False)  # (local cost; remote reads: below)
    p0, p1 = worker("prefill-0"), worker("prefill-1")
    first = kv.select([p0, p1], request(SYSTEM + [1]))
    # Before any report: the same prefix follows the first request (predicted overlap 10 blocks).
    assert kv.select([p0, p1], request(SYSTEM + [2])) is first
    chain = request_block_hashes(SYSTEM + [1], BS)
    assert index.overlap(chain, ["prefill-0", "prefill-1"])[first.instance_id] == 10
    # Predictions expire...
    assert index.overlap(chain, [first.instance_id], now=time.monotonic() + 6)[first.instance_id] == 0
    # ... and the instance's report replaces them: here it evicted the prefix at once.
    index.predict(first.instance_id, chain)
    assert index.apply(KVEvents(first.instance_id, first.info.pid, [], chain[:3]), first.info.pid)
    assert index.overlap(chain, [first.instance_id])[first.instance_id] == 0
    index.predict("prefill-9", chain)
    index.drop_instance("prefill-9")  # a dead worker's predictions go with it
    assert index.predicted and not any("prefill-9" in insts for insts in index.predicted.values())


def test_kv_policy_ignores_the_cache_of_a_restarted_worker():
    index = KVIndex(prediction_ttl_s=0)
    kv = KVAwarePrefill(index, remote_reads=False)  # (local cost; remote reads: below)
    p0, p1 = worker("prefill-0"), worker("prefill-1", pid=11)
    cache(index, p1, SYSTEM + [0])
    assert kv.select([p0, p1], request(SYSTEM + [1])) is p1
    restarted = worker("prefill-1", pid=12)  # same instance id, new process (new WorkerReady)
    assert kv.costs([p0, restarted], request(SYSTEM + [1]))["prefill-1"][2] == 0
    assert index.num_blocks("prefill-1") == 0


def test_kv_policy_hashes_media_items_like_the_engine():
    index = KVIndex()
    kv = KVAwarePrefill(index, remote_reads=False)  # (local cost; remote reads: below)
    _p0, p1 = worker("prefill-0"), worker("prefill-1")
    tokens = SYSTEM + [5] * 8
    ph_a = [Placeholder(8, 8, "a" * 64)]
    chain = request_block_hashes(tokens, BS, ph_a)
    index.apply(KVEvents("prefill-1", p1.info.pid, chain), p1.info.pid)
    same_image = RouterRequest("r", tokens, SamplingParams(), [], ph_a)
    other_image = RouterRequest("r", tokens, SamplingParams(), [], [Placeholder(8, 8, "b" * 64)])
    assert kv.costs([p1], same_image)["prefill-1"][2] == len(chain)
    assert kv.costs([p1], other_image)["prefill-1"][2] == 2  # only the blocks before the image match


def test_prefix_holder_is_the_instance_whose_kv_cache_holds_more_of_the_prompt():
    index = KVIndex(prediction_ttl_s=0)
    p0, p1, p2 = worker("prefill-0"), worker("prefill-1"), worker("prefill-2")
    cache(index, p0, SYSTEM + [0])  # 10 blocks
    cache(index, p2, SYSTEM[:24])  # 6 of them
    chain = request_block_hashes(SYSTEM + [7], BS)
    assert prefix_holder(index, chain, p1, [p0, p1, p2]) == ("prefill-0", 10, 10)
    assert prefix_holder(index, chain, p2, [p0, p1, p2]) == ("prefill-0", 10, 4)  # it holds 6 itself
    assert prefix_holder(index, chain, p0, [p0, p1, p2]) == ("", 0, 0)  # none holds more than p0
    cache(index, p1, SYSTEM[:28])  # 7 blocks: 3 more is below REMOTE_READ_MIN_BLOCKS
    assert prefix_holder(index, chain, p1, [p0, p1, p2]) == ("", 0, 0)
    # a block only in the holder's host tier is not read remotely (the holder would load it first)
    index.apply(KVEvents("prefill-0", p0.info.pid, [], [], stored_host=chain[:1]), p0.info.pid)
    assert prefix_holder(index, chain, p2, [p0, p1, p2]) == ("", 0, 0)


def test_prefix_holder_needs_blocks_that_move_as_they_are():
    index = KVIndex(prediction_ttl_s=0)
    p0 = worker("prefill-0")
    cache(index, p0, SYSTEM + [0])
    chain = request_block_hashes(SYSTEM + [7], BS)
    tp2 = WorkerHandle(WorkerReady("prefill", "prefill-1", 1001, "tcp://127.0.0.1:1", b"", [],
                                   KVLayout(2, 64, BS, 1, 16, "float32", [], [], tp=2)), None)  # type: ignore[arg-type]
    other_dtype = WorkerHandle(WorkerReady("prefill", "prefill-2", 1002, "tcp://127.0.0.1:1", b"", [],
                                           KVLayout(2, 64, BS, 2, 16, "bfloat16", [], [])), None)  # type: ignore
    assert prefix_holder(index, chain, tp2, [p0, tp2]) == ("", 0, 0)
    assert prefix_holder(index, chain, other_dtype, [p0, other_dtype]) == ("", 0, 0)


def test_kv_policy_counts_a_prefix_held_elsewhere_as_read_not_prefilled():
    """A busy holder's prefix still lowers the other instances' cost: with remote reads
    the request goes to the idle instance, which reads the 10 blocks from the holder."""
    from epd.router.policies import REMOTE_BLOCK_COST

    index = KVIndex(prediction_ttl_s=0)
    p0, p1 = worker("prefill-0"), worker("prefill-1")
    cache(index, p0, SYSTEM + [0])
    req = request(SYSTEM + [7])  # 11 blocks, 10 cached on p0
    for remote_reads, want in ((False, p0), (True, p1)):
        kv = KVAwarePrefill(index, remote_reads=remote_reads)
        for i in range(2):  # 2 requests of 4 blocks open on p0: its cost 1 + 8 < 11, but > 1 + 10 x 0.025
            kv.select([p0], request([2000 + i] * 16))
            p0.inflight += 1
        costs = kv.costs([p0, p1], req)
        assert costs["prefill-0"] == (9.0, 11, 10)
        assert costs["prefill-1"] == ((1 + 10 * REMOTE_BLOCK_COST, 11, 10) if remote_reads else (11.0, 11, 0))
        assert kv.select([p0, p1], req) is want
        p0.inflight = 0
    assert build_policy("prefill", "kv", index, remote_prefix_reads=False).remote_reads is False
    assert build_policy("pd", "kv", index).remote_reads is False  # a pd pool reads no prefixes


def test_kv_overlap_weight_must_not_be_negative():
    with pytest.raises(ValueError, match=">= 0"):
        KVAwarePrefill(KVIndex(), -1.0)


# ---- free-KV decode -------------------------------------------------------------------
def test_free_kv_prefers_most_free_blocks_after_reservations_then_smaller_batch():
    fk = FreeKVDecode()
    d0, d1 = worker("decode-0", "decode", free=40), worker("decode-1", "decode", free=30)
    big = request(range(60))  # 15 blocks
    assert fk.select([d0, d1], big) is d0  # 40 free vs 30
    # d0's heartbeat has not caught up: 40 - 15 = 25 < 30, so the next one goes to d1.
    assert fk.free_after_reservations(d0) == 25
    assert fk.select([d0, d1], big) is d1
    # A heartbeat from d0 that does not reflect the reservation yet keeps it pending ...
    d0.load = Heartbeat("decode-0", 0, 0, 41, 64)
    assert fk.free_after_reservations(d0) == 26
    # ... one made after its KVReserved replaces the estimate with what it reports.
    fk.reserved(d0, "r")
    fk.reserved(d1, "r")
    d0.load = Heartbeat("decode-0", 1, 0, 25, 64)
    assert fk.free_after_reservations(d0) == 25
    d1.load = Heartbeat("decode-1", 1, 0, 15, 64)
    assert fk.select([d0, d1], request(range(4))) is d0
    # Equal free blocks: the smaller running batch wins.
    e0, e1 = worker("decode-0", "decode", free=20, running=5), worker("decode-1", "decode", free=20, running=2)
    assert FreeKVDecode().select([e0, e1], request(range(4))) is e1


# ---- media affinity -------------------------------------------------------------------
def test_media_affinity_is_sticky_spread_and_stable_when_an_encoder_leaves():
    ma = MediaAffinity()
    es = [worker(f"encode-{i}", "encode") for i in range(3)]
    picks = {h: ma.select(es, request([1], [Item(h)])).instance_id for h in (f"{i:064x}" for i in range(60))}
    assert set(picks.values()) == {"encode-0", "encode-1", "encode-2"}  # items spread over the pool
    for h, inst in picks.items():  # the same item always meets the same encoder
        assert ma.select(list(reversed(es)), request([1], [Item(h)])).instance_id == inst
    # encode-2 leaves: items that were on encode-0/1 stay where they were (rendezvous hashing).
    for h, inst in picks.items():
        if inst != "encode-2":
            assert ma.select(es[:2], request([1], [Item(h)])).instance_id == inst


def test_media_affinity_falls_back_to_least_loaded_when_overloaded_or_without_items():
    ma = MediaAffinity(overload_slack=2)
    e0, e1 = worker("encode-0", "encode"), worker("encode-1", "encode")
    item = next(f"{i:064x}" for i in range(100)
                if ma.select([e0, e1], request([1], [Item(f"{i:064x}")])) is e0)
    e0.inflight = 1
    assert ma.select([e0, e1], request([1], [Item(item)])) is e0  # 1 more open request: still sticky
    e0.inflight = 2
    assert ma.select([e0, e1], request([1], [Item(item)])) is e1  # 2 more: overloaded
    assert ma.select([e0, e1], request([1])) is e1  # no items: least-loaded


# ---- selection by name, the CLI's choices -----------------------------------------------
def test_build_policy_defaults_and_rejects_what_a_pool_cannot_take():
    assert build_policy("prefill", None).name == "kv"
    assert build_policy("pd", None).name == "kv"
    assert build_policy("decode", None).name == "free-kv"
    assert build_policy("encode", None).name == "media-affinity"
    assert build_policy("decode", "round-robin").name == "round-robin"
    with pytest.raises(ValueError, match="decode routing 'kv'"):
        build_policy("decode", "kv")
    with pytest.raises(ValueError, match="unknown pool"):
        build_policy("gpu", None)


def test_cli_routing_choices_match_the_policies():
    from epd.cli import build_parser
    from epd.launch.config import ROUTING_POLICIES

    for role, names in ROUTING_POLICIES.items():
        assert names == POLICIES[role]
    args = build_parser().parse_args(["launch", "--prefill-routing", "round-robin", "--kv-overlap-weight", "2"])
    assert (args.prefill_routing, args.decode_routing, args.encode_routing, args.kv_overlap_weight) == (
        "round-robin", "free-kv", "media-affinity", 2.0)
    for bad in (["--prefill-routing", "free-kv"], ["--kv-overlap-weight", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["launch", *bad])


# ---- the Router: KVEvents dispatch, policy choice, decision counter -----------------------
def test_router_routes_by_reported_kv_events_and_counts_decisions():
    from epd import metrics

    async def main():
        router = Router(prefill_routing="kv", decode_routing="round-robin")
        try:
            for i in range(2):
                router._dispatch(ready(f"prefill-{i}"))
                router._dispatch(Heartbeat(f"prefill-{i}", 0, 0, 64, 64))
            chain = request_block_hashes(SYSTEM + [1], BS)
            router._dispatch(KVEvents("prefill-1", 1001, chain))
            router._dispatch(KVEvents("prefill-0", 999, chain))  # not prefill-0's process: ignored
            assert router.kv_index.num_blocks("prefill-1") == 10 and router.kv_index.num_blocks("prefill-0") == 0
            picks = [router._pick("prefill", request(SYSTEM + [i])).instance_id for i in range(3)]
            assert picks == ["prefill-1"] * 3
            # prefill-1 restarts under the same id (the launcher marks the old process dead first:
            # a live instance's id is never taken over): its cache is gone, the choice follows.
            router.mark_dead("prefill-1")
            router._dispatch(ready("prefill-1", pid=2001))
            router._dispatch(KVEvents("prefill-0", 1000, chain[:4]))
            assert router._pick("prefill", request(SYSTEM + [9])).instance_id == "prefill-0"
            assert router.kv_index.num_blocks("prefill-1") == 0
            assert router.policies["decode"].name == "round-robin" and router.policies["pd"].name == "kv"
        finally:
            await router.stop(shutdown_workers=False)

    asyncio.run(main())
    text = metrics.render_latest()[0].decode()

    def count(inst: str) -> float:
        pat = (r'^epd_routing_decisions_total\{(?=[^}]*instance="%s")(?=[^}]*policy="kv")(?=[^}]*pool="prefill")'
               r'[^}]*\} ([0-9.e+]+)$' % inst)
        m = re.search(pat, text, re.M)
        return float(m.group(1)) if m else 0.0

    assert count("prefill-1") >= 3 and count("prefill-0") >= 1


def test_kv_policy_weighs_a_tier_hit_by_what_loading_it_costs():
    """Same prefix on two instances, one in its KV cache, one only in its host tier: the
    device copy wins, the host copy still beats recomputing it by far."""
    from epd.router.policies import TIER_BLOCK_COST

    index = KVIndex(prediction_ttl_s=0)
    kv = KVAwarePrefill(index, remote_reads=False)  # (local cost; remote reads: below)
    p0, p1, p2 = worker("prefill-0"), worker("prefill-1"), worker("prefill-2")
    chain = request_block_hashes(SYSTEM + [1], BS)
    assert index.apply(KVEvents("prefill-0", p0.info.pid, stored_host=chain), p0.info.pid)
    assert index.apply(KVEvents("prefill-1", p1.info.pid, chain), p1.info.pid)
    costs = kv.costs([p0, p1, p2], request(SYSTEM + [1]))
    total = costs["prefill-2"][0]
    assert costs["prefill-0"][2] == costs["prefill-1"][2] == len(chain)
    assert costs["prefill-1"][0] < costs["prefill-0"][0] < total
    assert costs["prefill-0"][0] == pytest.approx(costs["prefill-1"][0] + TIER_BLOCK_COST[1] * len(chain))
    assert kv.select([p0, p1, p2], request(SYSTEM + [1])) is p1
    assert kv.select([p0, p2], request(SYSTEM + [2])) is p0


def test_free_kv_counts_the_blocks_a_decode_instance_would_reuse_as_free():
    """decode-0 holds a conversation's last turn (10 blocks) and has 3 free blocks fewer:
    the next turn goes there (it receives 10 blocks fewer), unless decode-1 has more
    free blocks than that saves; without an index (or a prefix) it is plain free-kv."""
    index = KVIndex(prediction_ttl_s=0)
    fk = FreeKVDecode(index)
    d0, d1 = worker("decode-0", "decode", free=61), worker("decode-1", "decode", free=64)
    turn = SYSTEM + [1, 2, 3, 4]
    assert index.apply(KVEvents("decode-0", d0.info.pid, request_block_hashes(turn, BS)), d0.info.pid)
    assert fk.reused_blocks(d0, request(turn + [5] * 8), {}) == 10
    assert fk.select([d0, d1], request(turn + [5] * 8)) is d0
    assert fk.select([d0, d1], request([7] * 48)) is d1  # no prefix anywhere: most free blocks
    assert FreeKVDecode().select([d0, d1], request(turn + [5] * 8)) is d1
    roomy = worker("decode-1", "decode", free=64 + 12)
    assert FreeKVDecode(index).select([d0, roomy], request(turn + [5] * 8)) is roomy
    # Held only in the host tier: worth its blocks less their load cost.
    assert index.apply(KVEvents("decode-0", d0.info.pid, stored_host=request_block_hashes(turn, BS)), d0.info.pid)
    assert 9.9 < fk.reused_blocks(d0, request(turn + [5] * 8), {}) < 10
