"""NixlTransport between real processes (spawned peers, UCX over loopback/cma; no mocks)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import statistics
import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

import _nixl_peer as peer_mod  # tests/transfer is on sys.path under pytest

from epd.errors import error_status
from epd.transfer import NixlTransport, TransferError, TransferTimeout
from epd.transfer.regions import block_regions, tensor_region
from epd.transfer.regions import coalesce as _coalesce

NB, BS, H, D = 64, 16, 4, 32  # fake KV cache [num_blocks, block_size, heads, dim] fp32
KV_SHAPE = (NB, BS, H, D)
BLOCK = BS * H * D * 4  # 8 KiB
BIG_SHAPE = (4096, 4096)  # 4096 blocks of 16 KiB = 64 MiB
BIG_BLOCK = 4096 * 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # spawns peer processes


class Peer:
    """A spawned process running _nixl_peer.serve."""

    def __init__(self, name: str, buffers: dict, options: dict | None = None):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_mod.serve, args=(child, name, buffers, options or {}), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._recv(60)
        self.name = name

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise AssertionError(f"peer {self.proc.pid} did not answer within {timeout}s")
        return self.conn.recv()

    def send(self, *cmd) -> None:
        self.conn.send(cmd)

    def call(self, *cmd, timeout: float = 10.0):
        self.send(*cmd)
        return self._recv(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=10)
            except (AssertionError, EOFError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def peer_a():
    p = Peer("a", {"kv": KV_SHAPE, "big": BIG_SHAPE, "secret": (4, 1024)}, {"progress_thread_us": 1000})
    yield p
    p.stop()


@pytest.fixture(scope="module")
def side_b(peer_a):
    """The test process's agent 'b': source KV blocks (seed 1), a read target, a big source."""
    t = NixlTransport("b")
    bufs = {
        "src": peer_mod.pattern(KV_SHAPE, 1),
        "dst": torch.zeros(KV_SHAPE),
        "big": torch.full(BIG_SHAPE, 1.5),
    }
    regions = dict(zip(bufs, t.register(list(bufs.values()))))
    a_regions = peer_a.info["regions"]
    # Advertise only kv and big: "secret" is registered with NIXL on A but not offered to B.
    assert t.add_peer(peer_a.info["metadata"], [a_regions["kv"], a_regions["big"]]) == "a"
    yield t, bufs, regions
    t.close()


def kv_blocks(region, ids):
    return block_regions(region, BLOCK, ids)


def test_write_scattered_blocks_with_notif(peer_a, side_b):
    b, _, regions = side_b
    assert peer_a.call("zero", "kv")
    src_ids = [3, 7, 8, 9, 20, 41, 63]
    dst_ids = [50, 2, 3, 4, 33, 10, 0]  # 7,8,9 -> 2,3,4 is one contiguous run on both sides
    local = kv_blocks(regions["src"], src_ids)
    remote = kv_blocks(peer_a.info["regions"]["kv"], dst_ids)
    t = b.write("a", local, remote, notif=b"req-1:layer-0")
    t.wait(timeout_s=10)
    assert t.done and t.released and t.nbytes == len(src_ids) * BLOCK
    assert t.num_descs == 5  # the 3-block run was coalesced
    assert peer_a.call("wait_notif", "b", b"req-1:layer-0", 10.0)
    assert peer_a.call("check_blocks", "kv", list(zip(dst_ids, src_ids)), 1)


def test_read_from_peer(peer_a, side_b):
    b, bufs, regions = side_b
    assert peer_a.call("fill", "kv", 2)
    bufs["dst"].zero_()
    remote_ids, local_ids = [5, 6, 30, 31, 62], [0, 1, 2, 10, 11]
    t = b.read(
        "a", kv_blocks(regions["dst"], local_ids), kv_blocks(peer_a.info["regions"]["kv"], remote_ids),
        notif=b"emb-read-done",
    )
    t.wait(timeout_s=10)
    expected = peer_mod.pattern(KV_SHAPE, 2)
    for lo, re_ in zip(local_ids, remote_ids):
        assert torch.equal(bufs["dst"][lo], expected[re_])
    assert peer_a.call("wait_notif", "b", b"emb-read-done", 10.0)  # READ notifs go to the data's owner


def _assert_nothing_sent(peer_a, b, before):
    assert b.num_requests == before
    assert peer_a.call("is_zero", "secret")
    time.sleep(0.05)
    assert peer_a.call("notifs") == {}


def test_remote_region_outside_advertised_rejected(peer_a, side_b):
    b, _, regions = side_b
    assert peer_a.call("notifs") is not None  # drain
    kv_a = peer_a.info["regions"]["kv"]
    secret = peer_a.info["regions"]["secret"]  # registered on A, never advertised to B
    one = [(regions["src"][0], BLOCK, 0)]
    before = b.num_requests
    bad_remotes = [
        (secret[0], BLOCK, 0),  # NIXL would accept this one: only the advertised list stops it
        (kv_a[0] + kv_a[1] - BLOCK + 4, BLOCK, 0),  # straddles the end of kv
        (kv_a[0] - 4, BLOCK, 0),  # starts before kv
        (kv_a[0], BLOCK, 1),  # wrong device id
        (kv_a[0] + kv_a[1] + (1 << 20), BLOCK, 0),  # far outside
    ]
    for bad in bad_remotes:  # a stale or bad ref from a peer: the server's fault (500) and retryable, not a 400
        with pytest.raises(TransferError, match="remote") as err:
            b.write("a", one, [bad], notif=b"must-not-arrive")
        assert error_status(err.value) == 500
        with pytest.raises(TransferError, match="remote"):
            b.read("a", one, [bad], notif=b"must-not-arrive")
    # Local ranges must lie in our own registrations.
    stray = torch.zeros(2048)
    with pytest.raises(ValueError, match="local"):
        b.write("a", [tensor_region(stray)[:1] + (BLOCK, 0)], [(kv_a[0], BLOCK, 0)])
    with pytest.raises(ValueError, match="local"):
        b.write("a", [(regions["src"][0] + regions["src"][1] - 8, BLOCK, 0)], [(kv_a[0], BLOCK, 0)])
    # Overlapping destinations in one WRITE are refused.
    with pytest.raises(ValueError, match="overlap"):
        b.write("a", kv_blocks(regions["src"], [0, 1]), kv_blocks(kv_a, [5, 5]))
    with pytest.raises(TransferError, match="unknown peer"):
        b.write("nobody", one, [(kv_a[0], BLOCK, 0)])
    _assert_nothing_sent(peer_a, b, before)


def test_mismatched_regions_rejected(peer_a, side_b):
    b, _, regions = side_b
    kv_a = peer_a.info["regions"]["kv"]
    src = regions["src"][0]
    before = b.num_requests
    with pytest.raises(ValueError, match="length mismatch"):
        b.write("a", [(src, BLOCK, 0)], [(kv_a[0], BLOCK // 2, 0)])
    with pytest.raises(ValueError, match="length mismatch"):
        b.read("a", [(src, BLOCK, 0), (src + BLOCK, 64, 0)], [(kv_a[0], BLOCK, 0), (kv_a[0] + BLOCK, 128, 0)])
    with pytest.raises(ValueError, match="local regions vs"):
        b.write("a", kv_blocks(regions["src"], [0, 1]), kv_blocks(kv_a, [0]))
    for junk in ([], [(src, 0, 0)], [(src, -8, 0)], [(src, 8.0, 0)], [("x", 8, 0)], [(src, 8)], [(-1, 8, 0)]):
        with pytest.raises(ValueError):
            b.write("a", junk, [(kv_a[0], 8, 0)])
    with pytest.raises(ValueError):
        b.write("a", [(src, 8, 0)], [(1 << 64, 8, 0)])
    with pytest.raises(TypeError):
        b.write("a", [(src, 8, 0)], [(kv_a[0], 8, 0)], notif="not-bytes")
    _assert_nothing_sent(peer_a, b, before)


def test_counters(peer_a, side_b):
    b, _, regions = side_b
    kv_a = peer_a.info["regions"]["kv"]
    req0, bytes0 = b.num_requests, b.bytes_moved
    b.write("a", kv_blocks(regions["src"], [1, 4, 9]), kv_blocks(kv_a, [11, 14, 19])).wait(10)
    b.read("a", kv_blocks(regions["dst"], [0]), kv_blocks(kv_a, [1])).wait(10)
    b.write("a", [regions["src"]], [kv_a]).wait(10)  # whole cache, one region
    assert b.num_requests - req0 == 3
    assert b.bytes_moved - bytes0 == 3 * BLOCK + BLOCK + NB * BLOCK
    with pytest.raises(ValueError):
        b.write("a", [(regions["src"][0], BLOCK, 0)], [(kv_a[0], BLOCK + 1, 0)])
    assert b.num_requests - req0 == 3


def test_coalescing(peer_a, side_b):
    b, _, regions = side_b
    kv_a = peer_a.info["regions"]["kv"]
    assert peer_a.call("zero", "kv")
    # 16 blocks contiguous on both sides (given in reverse order): one descriptor.
    t = b.write("a", kv_blocks(regions["src"], range(31, 15, -1)), kv_blocks(kv_a, range(47, 31, -1)), b"run")
    t.wait(10)
    assert t.num_descs == 1 and t.nbytes == 16 * BLOCK
    assert peer_a.call("wait_notif", "b", b"run", 10.0)
    assert peer_a.call("check_blocks", "kv", [(32 + i, 16 + i) for i in range(16)], 1)
    # Contiguous locally, scattered remotely: nothing to merge.
    t = b.write("a", kv_blocks(regions["src"], range(8)), kv_blocks(kv_a, range(0, 16, 2)))
    t.wait(10)
    assert t.num_descs == 8

    # The merge rule itself: adjacent on both sides *and* inside one region on both sides.
    local = np.array([[1000, 10, 0], [1010, 10, 0], [1020, 10, 0], [1030, 10, 0], [2000, 10, 0]])
    remote = np.array([[500, 10, 0], [510, 10, 0], [600, 10, 0], [610, 10, 0], [620, 10, 0]])
    same = np.zeros(5, dtype=np.int64)
    out_l, out_r = _coalesce(local, remote, same, same)
    assert out_l.tolist() == [[1000, 20, 0], [1020, 20, 0], [2000, 10, 0]]
    assert out_r.tolist() == [[500, 20, 0], [600, 20, 0], [620, 10, 0]]
    # Adjacent addresses in two different registrations are never merged.
    out_l, _ = _coalesce(local[:2], remote[:2], np.array([0, 1]), np.array([0, 0]))
    assert len(out_l) == 2


def test_malformed_metadata(peer_a, side_b):
    b, _, _ = side_b
    good = peer_a.info["metadata"]
    kv_a = peer_a.info["regions"]["kv"]
    bad_blobs = [
        b"garbage",
        good[: len(good) // 2],
        good[:20],
        b"nixlSerDes|",
        pickle.dumps({"name": "evil"}),
        b"\x00" * 4096,
    ]
    for blob in bad_blobs:
        with pytest.raises(TransferError, match="add_peer"):
            b.add_peer(blob, [kv_a])
    with pytest.raises(TransferError):
        b.add_peer(b"", [kv_a])
    with pytest.raises(TransferError):  # our own metadata: NIXL refuses to load itself
        b.add_peer(b.metadata(), [kv_a])
    with pytest.raises(TypeError):
        b.add_peer("text", [kv_a])
    with pytest.raises(ValueError):
        b.add_peer(good, [(kv_a[0], kv_a[1])])
    with pytest.raises(ValueError, match="overlap"):
        b.add_peer(good, [kv_a, (kv_a[0] + 8, 8, 0)])
    assert b.peers == ["a"]


def test_busy_target_needs_progress(peer_a, side_b):
    """A target that does not drive NIXL (busy computing, no progress thread) cannot
    complete a new connection: transfers into it wait. NIXL's progress thread
    (progress_thread_us) completes them while the target's main thread computes."""
    b, _, regions = side_b
    one_src = kv_blocks(regions["src"], [0])
    with NixlTransport("b-busy") as fresh:
        (fresh_src,) = fresh.register([torch.ones(BLOCK // 4)])
        peer_a.send("busy", 1.5)
        time.sleep(0.1)
        try:
            # New connections made while A sleeps: to A's plain agent and to its -pt agent.
            fresh.add_peer(peer_a.info["metadata"], [peer_a.info["regions"]["kv"]])
            stuck = fresh.write("a", [fresh_src], kv_blocks(peer_a.info["regions"]["kv"], [1]), b"late")
            pt = b.add_peer(peer_a.info["pt_metadata"], [peer_a.info["pt_regions"]["kv"]])
            t0 = time.monotonic()
            b.write(pt, one_src, kv_blocks(peer_a.info["pt_regions"]["kv"], [1]), b"pt").wait(1.0)
            assert time.monotonic() - t0 < 1.0
            time.sleep(0.2)
            assert not stuck.poll()  # A is still asleep: nothing answers the handshake
        finally:
            assert peer_a._recv(10) is True  # busy over; A polls again
        stuck.wait(10)
        assert peer_a.call("wait_notif", "b-busy", b"late", 10.0)
        assert peer_a.call("pt_notifs").get("b") == [b"pt"]
        b.remove_peer(pt)


def test_notification_on_a_new_connection_leaves_as_the_sender_progresses(peer_a):
    """A notification is the first thing sent to a peer just added (a prefill worker's
    KVWriterDone for a write that failed before it was posted): UCX wires the endpoint
    up, and the notification leaves, only while the sender is progressed too. The sender
    only calls ``progress`` (as a worker's loop does every turn); A receives it."""
    with NixlTransport("b-notif") as fresh:
        fresh.register([torch.ones(BLOCK // 4)])
        fresh.add_peer(peer_a.info["metadata"], [peer_a.info["regions"]["kv"]])
        fresh.send_notif("a", b"first words")
        peer_a.send("wait_notif", "b-notif", b"first words", 10.0)
        while not peer_a.conn.poll(0.002):
            fresh.progress()
        assert peer_a.conn.recv() is True


def test_unread_notifications_are_bounded(monkeypatch):
    """A process that reads no notifications (a prefill worker) keeps at most
    _MAX_BUFFERED_NOTIFS of them, however many its peers send; get_notifs empties it."""
    from epd.transfer import nixl_transport

    monkeypatch.setattr(nixl_transport, "_MAX_BUFFERED_NOTIFS", 3)
    with NixlTransport("flooder") as src, NixlTransport("flooded") as dst:
        regions = {t: t.register([torch.ones(BLOCK // 4)]) for t in (src, dst)}
        src.add_peer(dst.metadata(), regions[dst])
        for i in range(5):
            src.send_notif("flooded", b"n%d" % i)
        deadline = time.monotonic() + 10
        while dst._num_buffered < 3 and time.monotonic() < deadline:
            src.progress()
            dst.progress()
        for _ in range(50):  # the rest arrive and are dropped
            src.progress()
            dst.progress()
        assert dst.get_notifs() == {"flooder": [b"n0", b"n1", b"n2"]}
        src.send_notif("flooded", b"again")
        deadline = time.monotonic() + 10
        while not dst._num_buffered and time.monotonic() < deadline:
            src.progress()
            dst.progress()
        assert dst.get_notifs() == {"flooder": [b"again"]}


def test_sigstopped_peer_times_out(peer_a):
    """A hung peer: wait() gives up at the deadline and releases the handle."""
    with NixlTransport("b-stop") as b2:
        src = torch.ones(BLOCK // 4)
        (src_region,) = b2.register([src])
        os.kill(peer_a.proc.pid, signal.SIGSTOP)
        try:
            b2.add_peer(peer_a.info["metadata"], [peer_a.info["regions"]["kv"]])
            t = b2.write("a", [src_region], kv_blocks(peer_a.info["regions"]["kv"], [7]), b"stopped")
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="WRITE to peer 'a'"):
                t.wait(timeout_s=1.0)
            elapsed = time.monotonic() - t0
            assert 0.9 < elapsed < 1.6, elapsed
            assert t.released and not t.done
            with pytest.raises(TransferError, match="released"):
                t.poll()
        finally:
            os.kill(peer_a.proc.pid, signal.SIGCONT)
        # The peer is back: the same agent can talk to it again.
        t = b2.write("a", [src_region], kv_blocks(peer_a.info["regions"]["kv"], [8]), b"resumed")
        t.wait(10)
        assert peer_a.call("wait_notif", "b-stop", b"resumed", 10.0)
        assert b2.bytes_moved == BLOCK and b2.num_requests == 2
        # Re-adding a known peer (e.g. after it restarted) replaces it cleanly.
        assert b2.add_peer(peer_a.info["metadata"], [peer_a.info["regions"]["kv"]]) == "a"
        b2.write("a", [src_region], kv_blocks(peer_a.info["regions"]["kv"], [9])).wait(10)
        assert b2.peers == ["a"]


def test_sigkilled_peer_raises():
    victim = Peer("victim", {"kv": KV_SHAPE})
    kv_v = victim.info["regions"]["kv"]
    try:
        with NixlTransport("b-kill") as warm, NixlTransport("b-kill-cold") as cold:
            src = peer_mod.pattern((4, BLOCK // 4), 3)
            (sw,) = warm.register([src])
            (sc,) = cold.register([src.clone()])
            warm.add_peer(victim.info["metadata"], [kv_v])
            warm.write("victim", kv_blocks(sw, range(4)), kv_blocks(kv_v, range(4)), b"warm").wait(10)
            assert victim.call("wait_notif", "b-kill", b"warm", 10.0)

            os.kill(victim.proc.pid, signal.SIGSTOP)
            cold.add_peer(victim.info["metadata"], [kv_v])  # connection never completes
            in_flight_cold = cold.write("victim", kv_blocks(sc, range(4)), kv_blocks(kv_v, range(4, 8)), b"cold")
            maybe_done = warm.write("victim", kv_blocks(sw, range(4)), kv_blocks(kv_v, range(8, 12)), b"pending")
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.join(10)

            t0 = time.monotonic()
            with pytest.raises(TransferError, match="WRITE to peer 'victim'") as err:
                in_flight_cold.wait(timeout_s=5.0)
            assert not isinstance(err.value, TransferTimeout)
            assert time.monotonic() - t0 < 2.0
            try:  # a warm connection may have finished this one before the kill
                maybe_done.wait(timeout_s=5.0)
            except TransferError as e:
                assert not isinstance(e, TransferTimeout)
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="victim") as err:
                warm.write("victim", kv_blocks(sw, range(4)), kv_blocks(kv_v, range(4)), b"after").wait(timeout_s=5.0)
            assert not isinstance(err.value, TransferTimeout)
            assert time.monotonic() - t0 < 2.0
            with pytest.raises(TransferError, match="victim"):
                warm.send_notif("victim", b"hello?")
            warm.remove_peer("victim")
            assert warm.peers == []
            with pytest.raises(TransferError, match="unknown peer"):
                warm.write("victim", kv_blocks(sw, range(4)), kv_blocks(kv_v, range(4)))
        # close() after a dead peer must not abort the process (UCX teardown assertion).
    finally:
        victim.stop()


def test_restarted_peer_under_the_same_name_replaces_the_old():
    """A peer restarted under its old agent name (a decode rank's agent after the launcher
    restarts its instance) advertises new metadata: add_peer, told the advertised name,
    drops the dead agent and loads the new one, and writes land in the new process. NIXL
    itself refuses a second agent under a known name (NIXL_ERR_NOT_ALLOWED), which left
    per-rank agents unable to reach a restarted decode instance. Metadata naming another
    agent than advertised is refused."""
    old = Peer("phoenix", {"kv": KV_SHAPE})
    new = None
    try:
        with NixlTransport("b-restart") as b:
            src = peer_mod.pattern(KV_SHAPE, 1)
            (sr,) = b.register([src])
            assert b.add_peer(old.info["metadata"], [old.info["regions"]["kv"]], "phoenix") == "phoenix"
            b.write("phoenix", kv_blocks(sr, [0]), kv_blocks(old.info["regions"]["kv"], [0]), b"one").wait(10)
            assert old.call("wait_notif", "b-restart", b"one", 10.0)
            old.proc.kill()
            old.proc.join(10)
            new = Peer("phoenix", {"kv": KV_SHAPE})
            kv_new = new.info["regions"]["kv"]
            assert b.add_peer(new.info["metadata"], [kv_new], "phoenix") == "phoenix"
            assert b.peers == ["phoenix"]
            with pytest.raises(TransferError, match="names agent 'phoenix', advertised as 'other'"):
                b.add_peer(new.info["metadata"], [kv_new], "other")
            assert b.peers == ["phoenix"]
            b.write("phoenix", kv_blocks(sr, [3, 4]), kv_blocks(kv_new, [5, 6]), b"two").wait(10)
            assert new.call("wait_notif", "b-restart", b"two", 10.0)
            assert new.call("check_blocks", "kv", [(5, 3), (6, 4)], 1)
    finally:
        old.stop()
        if new is not None:
            new.stop()


def test_closed_transport():
    t = NixlTransport("b-closed")
    (r,) = t.register([torch.zeros(16)])
    t.close()
    t.close()
    with pytest.raises(TransferError, match="closed"):
        t.get_notifs()
    with pytest.raises(TransferError, match="closed"):
        t.write("x", [r], [r])


def _rate(nbytes: int, seconds: list[float]) -> str:
    return f"best {nbytes / min(seconds) / 1e9:5.2f} GB/s, median {nbytes / statistics.median(seconds) / 1e9:5.2f} GB/s"


def test_bandwidth_report(peer_a, side_b):
    """Effective GB/s, printed (run with -s): 64 MiB as one descriptor vs 4096 x 16 KiB."""
    b, _, regions = side_b
    big_a, big_b = peer_a.info["regions"]["big"], regions["big"]
    total = big_b[1]
    rng = np.random.default_rng(0)
    scattered_l = block_regions(big_b, BIG_BLOCK, rng.permutation(4096))
    scattered_r = block_regions(big_a, BIG_BLOCK, rng.permutation(4096))
    lines = []
    for op in ("write", "read"):
        fn = getattr(b, op)
        cases = (("1 x 64 MiB", [big_b], [big_a]), ("4096 x 16 KiB scattered", scattered_l, scattered_r))
        for label, loc, rem in cases:
            times, post = [], []
            for _ in range(6):
                t0 = time.perf_counter()
                t = fn("a", loc, rem)
                t1 = time.perf_counter()
                t.wait(30)
                times.append(time.perf_counter() - t0)
                post.append(t1 - t0)
            assert t.num_descs == 1 if len(loc) == 1 else t.num_descs > 4000  # random runs may merge
            lines.append(f"{op:5s} {label:24s}: {_rate(total, times[1:])} (validate+post {min(post) * 1e3:.2f} ms)")
    print("\nNIXL CPU bandwidth (UCX, 2 processes):\n  " + "\n  ".join(lines))


def test_released_write_that_nixl_cannot_cancel_is_not_terminated(peer_a, side_b):
    """Releasing an unfinished transfer only starts its abort: a write held in flight
    (the hold seam) is released, yet it is not terminated and still lands once the hold
    ends; only then does ``terminated`` turn True. Memory it writes is not free before."""
    b, _, regions = side_b
    assert peer_a.call("zero", "kv")
    b.hold = True
    try:
        t = b.write("a", kv_blocks(regions["src"], [5]), kv_blocks(peer_a.info["regions"]["kv"], [12]))
        assert not t.poll()
        assert t.release() is False
        assert t.released and not t.terminated and b.num_cancelling == 1
        time.sleep(0.1)
        assert peer_a.call("is_zero", "kv")  # nothing moved yet
    finally:
        b.hold = False
    deadline = time.monotonic() + 10
    while not t.terminated:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert b.num_cancelling == 0
    assert peer_a.call("check_blocks", "kv", [(12, 5)], 1)  # the released write landed
