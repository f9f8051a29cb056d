"""What the router remembers about failed workers: death counts, pending KV
reservations, the prefix index.

A real ``Router`` with no worker processes: the tests register workers, play
their messages through the router's dispatch, and run the watch loop's check
(``Mailbox.check_deaths``) themselves, so nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from epd import metrics
from epd.messages import Heartbeat, KVEvents, KVLayout, KVReserved, PrefillDone, TokenOutput, WorkerReady
from epd.router.kv_index import request_block_hashes
from epd.router.router import Router, RouterRequest
from epd.sampling_params import SamplingParams

BS = 4  # tokens per KV block


def ready(inst: str, role: str, pid: int) -> WorkerReady:
    return WorkerReady(role, inst, pid, "tcp://127.0.0.1:1", b"", [], KVLayout(2, 64, BS, 2, 16, "float32", [], []))


def failures(inst: str) -> float:
    """``epd_worker_failures_total`` of ``inst`` in this process."""
    text = metrics.render_latest()[0].decode()
    m = re.search(r'^epd_worker_failures_total\{(?=[^}]*instance="%s")[^}]*\} ([0-9.e+-]+)$' % inst, text, re.M)
    return float(m.group(1)) if m else 0.0


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(body) -> None:
    async def main():
        router = Router()
        try:
            await body(router)
        finally:
            await router.stop(shutdown_workers=False)

    asyncio.run(main())


# ---- worker deaths --------------------------------------------------------------------
def test_a_death_counts_once_per_outage_of_each_process():
    """Frozen (counted once however long), thawed, then killed: a second death.
    Restarted (new pid) and dead again: a third; a later restart that happens to get
    the same pid again, dead again: a fourth."""
    inst = "decode-acct"

    async def body(router: Router) -> None:
        base = failures(inst)
        router._dispatch(ready(inst, "decode", 4100))
        w = router.registry.get(inst)
        router.mailbox.check_deaths()
        assert failures(inst) - base == 0
        w.last_seen -= 10 * router.registry.heartbeat_timeout_s  # frozen: silent past the timeout
        router.mailbox.check_deaths()
        router.mailbox.check_deaths()
        assert failures(inst) - base == 1
        router._dispatch(Heartbeat(inst, 0, 0, 64, 64))  # thawed
        router.mailbox.check_deaths()
        router.mark_dead(inst)  # then killed: the launcher saw it exit
        router.mailbox.check_deaths()
        assert failures(inst) - base == 2
        for pid, total in ((4200, 3), (4200, 4)):  # restarted, died again (twice, the same pid)
            router._dispatch(ready(inst, "decode", pid))
            router.mailbox.check_deaths()
            assert failures(inst) - base == total - 1
            router.mark_dead(inst)
            router.mailbox.check_deaths()
            assert failures(inst) - base == total
        assert len(router.mailbox._dead_seen) == 1  # only the current incarnation is remembered

    run(body)


# ---- pending reservations of the free-kv policy -----------------------------------------------
def test_reservations_stay_pending_until_a_heartbeat_reflects_them():
    """A decode worker's load reports are numbered (``Heartbeat.seq``); the heartbeat
    thread repeats the latest, and a repeat may arrive late. A reservation counts
    against its free blocks until a report made after its ``KVReserved`` arrives,
    whatever other reports (changed, repeated or stale) come before."""

    async def body(router: Router) -> None:
        router._dispatch(ready("prefill-0", "prefill", 5000))
        router._dispatch(ready("decode-0", "decode", 5001))
        fk, d = router.policies["decode"], router.registry.get("decode-0")

        def beat(seq: int, free: int, running: int = 0) -> int:
            router._dispatch(Heartbeat("decode-0", running, 0, free, 64, seq=seq))
            return fk.free_after_reservations(d)

        assert beat(1, 40) == 40
        gen = router.generate(RouterRequest("r1", list(range(60)), SamplingParams(max_tokens=3)))  # 15 blocks
        first = asyncio.ensure_future(gen.__anext__())
        await settle()
        assert fk.free_after_reservations(d) == 25
        assert beat(2, 42) == 27  # a report made before the worker took the reservation
        assert beat(1, 40) == 27  # a late repeat of an older report: ignored
        assert beat(2, 42) == 27  # the heartbeat thread repeats the latest report
        router._dispatch(KVReserved("r1", "decode-0", list(range(15))))
        await settle()
        assert beat(2, 42) == 27  # made before the reservation: it is still pending
        assert beat(3, 27, running=1) == 27  # made after: it reflects the reservation
        assert beat(4, 27, running=1) == 27  # and a report with the same values changes nothing
        router._dispatch(PrefillDone("r1", "prefill-0", 7, 0, 64, 0.0, 0.0, 0.0, 1))
        assert (await first).token_ids == [7]
        router._dispatch(TokenOutput("r1", [8, 9], True, "length"))
        assert (await gen.__anext__()).finished
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        assert fk.free_after_reservations(d) == 27 and not fk.pending(d)

    run(body)


def test_unnumbered_heartbeats_keep_a_reservation_until_it_is_acknowledged():
    """Without report numbers (``seq`` 0), a reservation is pending until its
    ``KVReserved``, then until a report with other values; an attempt that ends
    (here: the client left before the reply) drops it."""

    async def body(router: Router) -> None:
        router._dispatch(ready("prefill-0", "prefill", 5100))
        router._dispatch(ready("decode-0", "decode", 5101))
        fk, d = router.policies["decode"], router.registry.get("decode-0")
        router._dispatch(Heartbeat("decode-0", 0, 0, 40, 64))
        gen = router.generate(RouterRequest("r2", list(range(60)), SamplingParams(max_tokens=3)))
        first = asyncio.ensure_future(gen.__anext__())
        await settle()
        for free in (40, 44, 40):  # repeated or changed: not acknowledged yet
            router._dispatch(Heartbeat("decode-0", 0, 0, free, 64))
            assert fk.free_after_reservations(d) == free - 15
        router._dispatch(KVReserved("r2", "decode-0", list(range(15))))
        await settle()
        router._dispatch(Heartbeat("decode-0", 0, 0, 40, 64))  # the same values as at the reply
        assert fk.free_after_reservations(d) == 25
        router._dispatch(Heartbeat("decode-0", 1, 0, 25, 64))
        assert fk.free_after_reservations(d) == 25 and not fk.pending(d)

        gen2 = router.generate(RouterRequest("r3", list(range(8)), SamplingParams(max_tokens=3)))  # 2 blocks
        second = asyncio.ensure_future(gen2.__anext__())
        await settle()
        assert fk.free_after_reservations(d) == 23
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert fk.free_after_reservations(d) == 25
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    run(body)


# ---- the prefix index ---------------------------------------------------------------------
def test_a_dead_or_reregistered_worker_leaves_the_prefix_index():
    """The registry declares prefill-1 dead: its reported prefixes leave the index.
    prefill-0 re-registers (a restart, here with the same pid): it starts empty."""

    async def body(router: Router) -> None:
        chain = request_block_hashes(list(range(41)), BS)  # 10 blocks
        for i in range(2):
            router._dispatch(ready(f"prefill-{i}", "prefill", 6000 + i))
            router._dispatch(KVEvents(f"prefill-{i}", 6000 + i, chain))
        assert router.kv_index.num_blocks("prefill-1") == 10
        router.mark_dead("prefill-1")
        router.mailbox.check_deaths()
        assert router.kv_index.num_blocks("prefill-1") == 0
        assert all(holders == {"prefill-0"} for holders in router.kv_index.holders.values())
        router._dispatch(ready("prefill-0", "prefill", 6000))
        assert router.kv_index.num_blocks("prefill-0") == 0 and len(router.kv_index) == 0

    run(body)


# ---- registration ---------------------------------------------------------------------
def test_a_worker_with_another_kv_dtype_is_refused_for_good():
    """KV moves prefill -> decode byte for byte: a bf16 decode worker joining fp32 prefill
    workers would read garbage. It is refused (permanently, naming --dtype), the others stay."""
    import zmq

    from epd.messages import RegistrationRefused, decode

    async def body(router: Router) -> None:
        ctx = zmq.Context.instance()
        inbox = ctx.socket(zmq.PULL)
        port = inbox.bind_to_random_port("tcp://127.0.0.1")
        try:
            router._dispatch(ready("prefill-dt", "prefill", 6000))
            bf16 = WorkerReady("decode", "decode-dt", 6001, f"tcp://127.0.0.1:{port}", b"", [],
                               KVLayout(2, 64, BS, 2, 16, "bfloat16", [], []))
            router._dispatch(bf16)
            await settle()
            assert inbox.poll(5000), "no answer to the refused worker"
            answer = decode(inbox.recv())
            assert isinstance(answer, RegistrationRefused) and answer.permanent
            assert "bfloat16" in answer.reason and "float32" in answer.reason and "--dtype" in answer.reason
            assert "decode-dt" not in router.registry.workers and "prefill-dt" in router.registry.workers
        finally:
            inbox.close(0)

    run(body)


def _refused_then_matched(prefill: KVLayout, decode_layout: KVLayout, named: list[str]) -> None:
    """A decode worker with ``decode_layout`` next to a prefill one with ``prefill``: refused
    permanently with every string of ``named`` in the reason; then one with the prefill
    worker's layout: registered."""
    import zmq

    from epd.messages import Registered, RegistrationRefused, decode

    async def body(router: Router) -> None:
        ctx = zmq.Context.instance()
        inboxes = [ctx.socket(zmq.PULL) for _ in range(2)]
        ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in inboxes]
        try:
            router._dispatch(WorkerReady("prefill", "prefill-q", 6100, "tcp://127.0.0.1:1", b"", [], prefill))
            router._dispatch(WorkerReady("decode", "decode-q", 6101, f"tcp://127.0.0.1:{ports[0]}", b"", [],
                                         decode_layout))
            await settle()
            assert inboxes[0].poll(5000), "no answer to the refused worker"
            answer = decode(inboxes[0].recv())
            assert isinstance(answer, RegistrationRefused) and answer.permanent, answer
            assert all(n in answer.reason for n in named), (named, answer.reason)
            assert "decode-q" not in router.registry.workers and "prefill-q" in router.registry.workers
            router._dispatch(WorkerReady("decode", "decode-same", 6102, f"tcp://127.0.0.1:{ports[1]}", b"", [],
                                         prefill))
            for _ in range(500):  # Registered waits in the handle's backlog until connected: the loop flushes it
                if inboxes[1].poll(0):
                    break
                await asyncio.sleep(0.01)
            assert inboxes[1].poll(0), "no answer to the matching worker"
            assert isinstance(decode(inboxes[1].recv()), Registered)
            assert "decode-same" in router.registry.workers
        finally:
            for s in inboxes:
                s.close(0)

    run(body)


@pytest.mark.parametrize("prefill_kv,decode_kv", [("int8", "fp8_e4m3"), ("int8", "float32"), ("float32", "int8")])
def test_a_worker_with_another_kv_cache_dtype_is_refused_naming_the_flag(prefill_kv, decode_kv):
    """``--kv-cache-dtype`` on one side only, or int8 against fp8_e4m3 (rows of the same
    length: 16 one-byte values and 4 bytes of scales at head_dim 16, so only the name
    tells them apart): the decode worker would read the other's bytes as its own
    format. It is refused permanently, naming --kv-cache-dtype; a worker with the same
    quantized cache is accepted."""
    def layout(kind: str) -> KVLayout:
        return KVLayout(2, 64, BS, 2, 16 if kind == "float32" else 16 + 4, kind, [], [])

    _refused_then_matched(layout(prefill_kv), layout(decode_kv), [prefill_kv, decode_kv, "--kv-cache-dtype"])


@pytest.mark.parametrize("prefill_bs,decode_bs", [(16, 32), (32, 16)])
def test_a_worker_with_another_block_size_is_refused_naming_the_flag(prefill_bs, decode_bs):
    """``--block-size`` 16 on one side and 32 on the other: KV moves block by block, so a
    decode worker with larger blocks would read each prefill block's tokens at the wrong
    positions (found by a fresh user: wrong greedy text, no error) and smaller ones make
    every write fail. It is refused permanently, naming --block-size; a worker with the
    same block size is accepted."""
    def layout(bs: int) -> KVLayout:
        return KVLayout(2, 64, bs, 2, 16, "float32", [], [])

    _refused_then_matched(layout(prefill_bs), layout(decode_bs), [str(prefill_bs), str(decode_bs), "--block-size"])
