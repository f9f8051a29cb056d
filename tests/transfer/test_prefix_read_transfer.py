"""Remote prefix reads (epd.transfer.remote_prefix) between two real NIXL agents in one
process: a holder's KV cache and block manager, a reader's, the notifications between
them, and the READ that moves the blocks. Checks the bytes that land, what each side
pins, caches and frees, and every fallback (forged answers, stale answers, a dead
holder, an abort, the pin budget)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl")

from epd.block_hash import iter_block_hashes
from epd.engine.block_manager import BlockManager
from epd.messages import PeerInfo, PrefillRequest, PrefixPinned
from epd.sampling_params import SamplingParams
from epd.sequence import Sequence
from epd.transfer import NixlTransport
from epd.transfer.kv_connector import kv_layout
from epd.transfer.remote_prefix import PrefixPins, RemotePrefixReader, serve_notifications

L, NB, BS, H, D = 2, 16, 4, 2, 8  # layers, blocks, block size, KV heads, head dim
PROMPT = list(range(100, 125))  # 6 full blocks + 1 token


class Side:
    """One prefill instance's KV cache, block manager, NIXL agent and both roles."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.k = torch.zeros(L, NB, BS, H, D)
        self.v = torch.zeros(L, NB, BS, H, D)
        self.bm = BlockManager(NB, BS)
        self.t = NixlTransport(name)
        self.regions = self.t.register([self.k, self.v])
        self.layout = kv_layout(self.k, self.v, BS, 1, None)
        self.peers: dict[str, PeerInfo] = {}
        self.reader = RemotePrefixReader(self.t, self.bm, self.layout, self.peers, name, timeout_s=30)
        self.pins = PrefixPins(self.t, self.bm, name)

    def meet(self, other: Side) -> None:
        self.t.add_peer(other.t.metadata(), other.regions, other.name)
        self.peers[other.name] = PeerInfo(other.name, other.t.metadata(), other.regions, other.layout, 1)

    def compute(self, tokens: list[int]) -> list[int]:
        """Cache ``tokens``' full blocks, with KV values that name the block position."""
        s = Sequence("c", list(tokens), SamplingParams())
        assert self.bm.allocate_slots(s, s.num_tokens)
        for i, b in enumerate(s.block_table):
            self.k[:, b] = 1000 + i
            self.v[:, b] = -1000 - i
        s.num_computed_tokens = s.num_tokens
        self.bm.cache_full_blocks(s)
        ids = list(s.block_table)
        self.bm.free(s)
        return ids

    def serve(self) -> None:
        serve_notifications(self.t, self.reader, self.pins)


@pytest.fixture
def pair():
    holder, reader = Side("holder"), Side("reader")
    holder.meet(reader)
    reader.meet(holder)
    yield holder, reader
    holder.t.close()
    reader.t.close()


def request(rid: str = "r1", holder: str = "holder") -> PrefillRequest:
    return PrefillRequest(rid, PROMPT, SamplingParams(), "decode-0", [], prefix_holder=holder)


def run(holder: Side, reader: Side, until, timeout_s: float = 10.0) -> list:
    """Serve both sides' notifications and poll the reader until ``until(ready)``."""
    ready: list = []
    deadline = time.monotonic() + timeout_s
    while not until(ready):
        assert time.monotonic() < deadline, "the read never ended"
        holder.serve()
        reader.serve()
        ready += reader.reader.poll()
        time.sleep(0.01)
    return ready


def chain(n: int) -> list[bytes]:
    return list(iter_block_hashes(PROMPT, BS, [], n))


def test_read_lands_the_holders_blocks_cached_under_their_hashes(pair):
    holder, reader = pair
    src = holder.compute(PROMPT)
    assert reader.reader.start(request(), 0.0)
    ready = run(holder, reader, lambda r: r)
    assert [m.request_id for m, _ in ready] == ["r1"]
    hashes = chain(6)
    got = [reader.bm.cached_blocks[h] for h in hashes]  # every full block, cached on the reader
    for i, b in enumerate(got):
        assert torch.equal(reader.k[:, b], holder.k[:, src[i]]) and torch.equal(reader.v[:, b], holder.v[:, src[i]])
    assert reader.bm.num_free_blocks == NB  # cached and free: the request's lookup takes them
    run(holder, reader, lambda _: not holder.pins.pins)  # the unpin reached the holder
    assert holder.bm.num_free_blocks == NB
    stats = reader.reader.stats()
    assert stats["remote_prefix_reads_ok"] == 1 and stats["remote_prefix_read_blocks"] == 6
    assert reader.bm.prefix_cache_remote_hits == 6 * BS


def test_reader_asks_only_for_the_blocks_it_lacks_and_holder_pins_what_it_has(pair):
    holder, reader = pair
    holder.compute(PROMPT[:17])  # 4 blocks
    reader.compute(PROMPT[:9])  # 2 blocks
    assert reader.reader.start(request(), 0.0)
    run(holder, reader, lambda r: r)
    assert reader.reader.stats()["remote_prefix_read_blocks"] == 2  # blocks 2 and 3
    assert all(h in reader.bm.cached_blocks for h in chain(4)) and chain(6)[4] not in reader.bm.cached_blocks


def test_nothing_to_read_admits_at_once(pair):
    holder, reader = pair
    reader.compute(PROMPT)
    assert not reader.reader.start(request(), 0.0)  # it holds every block itself
    assert not reader.reader.start(request(holder="nobody"), 0.0)  # not a peer
    assert not reader.reader.start(request(holder="reader"), 0.0)  # itself


@pytest.mark.parametrize("ids", [[NB + 3], [0, 0], list(range(7))], ids=["out-of-range", "repeated", "too-many"])
def test_a_forged_answer_falls_back_and_caches_nothing(pair, ids):
    holder, reader = pair
    assert reader.reader.start(request(), 0.0)
    gen = reader.reader.reads["r1"].generation
    reader.reader.on_pinned("holder", PrefixPinned("r1", gen, ids))
    ready = reader.reader.poll()
    assert [m.request_id for m, _ in ready] == ["r1"]
    assert reader.reader.stats()["remote_prefix_reads_fallback"] == 1
    assert not reader.bm.cached_blocks and reader.bm.num_free_blocks == NB


def test_a_stale_answer_is_unpinned_at_the_holder(pair):
    holder, reader = pair
    holder.compute(PROMPT)
    assert reader.reader.start(request(), 0.0)
    assert reader.reader.abort("r1")  # the client left before the holder answered
    run(holder, reader, lambda _: holder.pins.stats()["remote_prefix_served_blocks"] == 6)
    run(holder, reader, lambda _: not holder.pins.pins)  # the late answer was unpinned
    assert holder.bm.num_free_blocks == NB and not reader.bm.cached_blocks
    assert reader.reader.stats()["remote_prefix_reads_aborted"] == 1


def test_holder_gone_before_answering_falls_back(pair):
    holder, reader = pair
    assert reader.reader.start(request(), 0.0)
    reader.reader.holder_gone("holder")
    assert [m.request_id for m, _ in reader.reader.poll()] == ["r1"]
    assert reader.reader.stats()["remote_prefix_reads_fallback"] == 1


def test_pins_end_when_the_reader_is_gone_and_stay_within_budget(pair):
    holder, reader = pair
    holder.compute(PROMPT)
    from epd.messages import PrefixPin

    holder.pins.on_pin("reader", PrefixPin("a", 1, chain(6), reader_pid=77))
    assert holder.pins.num_pinned_blocks == 6 and holder.bm.num_free_blocks == NB - 6
    # the budget is half the cache: a second read of the same blocks pins 2 more at most
    holder.pins.on_pin("reader", PrefixPin("b", 2, chain(6), reader_pid=77))
    assert holder.pins.num_pinned_blocks == NB // 2
    holder.pins.reader_gone("reader", 78)  # another process of it: not these pins
    assert holder.pins.num_pinned_blocks == NB // 2
    holder.pins.reader_gone("reader", 77)
    assert holder.pins.num_pinned_blocks == 0 and holder.bm.num_free_blocks == NB
    assert all(holder.bm.cached_blocks.get(h) is not None for h in chain(6))  # still cached


def test_a_second_request_for_the_same_blocks_waits_for_the_first_read(pair):
    holder, reader = pair
    holder.compute(PROMPT)
    assert reader.reader.start(request("r1"), 0.0) and reader.reader.start(request("r2"), 0.0)
    ready = run(holder, reader, lambda r: len(r) == 2)
    assert [m.request_id for m, _ in ready] == ["r1", "r2"]
    assert holder.pins.num_served_blocks == 6  # one pin, one read
    assert reader.reader.stats()["remote_prefix_reads_ok"] == 1 and reader.bm.prefix_cache_remote_hits == 6 * BS
    assert reader.reader.start(request("r3"), 0.0) is False  # now it holds them itself


def test_reader_asks_only_for_what_the_router_says_the_holder_holds(pair):
    holder, reader = pair
    holder.compute(PROMPT)
    msg = PrefillRequest("r1", PROMPT, SamplingParams(), "decode-0", [], prefix_holder="holder",
                         prefix_holder_blocks=3)
    assert reader.reader.start(msg, 0.0)
    assert reader.reader.reads["r1"].hashes == chain(3)
    run(holder, reader, lambda r: r)
    assert reader.reader.stats()["remote_prefix_read_blocks"] == 3
    reader.compute(PROMPT[:13])  # (it now holds 3 blocks): nothing left to ask for
    assert not reader.reader.start(msg, 0.0)
