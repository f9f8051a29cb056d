"""Membership as the router keeps it: replacements under a reused instance id, dead
workers forgotten, wedged main loops, the live ``max_model_len``, and the per-worker
sockets' backlog.

A real ``Router`` with no worker processes: the tests play the workers' messages
through the router's dispatch and move the registry's clocks back instead of waiting.
"""

from __future__ import annotations

import asyncio
import socket
import time

import zmq

from epd.messages import Heartbeat, KVLayout, Registered, RouterPing, WorkerReady, decode
from epd.roles import Role
from epd.router.router import Router
from tests.router.test_failure_accounting import failures


def ready(inst: str, role: str, pid: int, incarnation: int, *, endpoint: str = "tcp://127.0.0.1:1",
          max_model_len: int = 0, stall_timeout_s: float = 0.0) -> WorkerReady:
    layout = KVLayout(2, 64, 4, 2, 16, "float32", [], []) if role != Role.ENCODE else None
    return WorkerReady(role, inst, pid, endpoint, b"", [], layout, incarnation=incarnation,
                       max_model_len=max_model_len, stall_timeout_s=stall_timeout_s)


def beat(inst: str, incarnation: int, loop: int = 0) -> Heartbeat:
    return Heartbeat(inst, 0, 0, 10, 10, loop=loop, incarnation=incarnation)


def run(body, **kw) -> None:
    async def main():
        router = Router(**kw)
        try:
            await body(router)
        finally:
            await router.stop(shutdown_workers=False)

    asyncio.run(main())


def age(router: Router, inst: str, seconds: float) -> None:
    """Move worker ``inst``'s last heartbeat ``seconds`` into the past."""
    router.registry.get(inst).last_seen -= seconds


# ---- a replacement under the same instance id ------------------------------------------
def test_a_replacements_heartbeats_do_not_keep_its_dead_predecessor_alive():
    """A pod restarted under its instance id (another host, so another process) joins
    while its predecessor's entry still looks alive: refused for now. Its heartbeats,
    which start with its first WorkerReady, must not refresh the predecessor's entry,
    or it stays refused forever; once the predecessor is found dead it joins."""
    inst = "decode-same-id"

    async def body(router: Router) -> None:
        router._dispatch(ready(inst, Role.DECODE, 100, 1, endpoint="tcp://10.0.0.1:1"))
        old = router.registry.get(inst)
        age(router, inst, 1.5)  # the old pod died 1.5 s ago: within the heartbeat timeout
        router._dispatch(ready(inst, Role.DECODE, 200, 2, endpoint="tcp://10.0.0.2:1"))
        assert router.registry.get(inst) is old  # refused while the old one looks alive
        seen = old.last_seen
        for _ in range(8):  # the replacement heartbeats while it asks again
            router._dispatch(beat(inst, 2))
        assert old.last_seen == seen, "another process's heartbeats kept the dead entry alive"
        age(router, inst, 1.0)  # past the heartbeat timeout
        assert not router.registry.is_alive(old)
        router._dispatch(ready(inst, Role.DECODE, 200, 2, endpoint="tcp://10.0.0.2:1"))
        new = router.registry.get(inst)
        assert new is not old and new.info.incarnation == 2 and router.registry.is_alive(new)
        assert old.socket.closed

    run(body)


# ---- forgetting the dead ------------------------------------------------------------------
def test_a_dead_worker_is_forgotten_after_its_peers_were_told_and_its_pool_is_gone():
    """A worker silent past the heartbeat timeout is dead at once but forgotten only once
    ``PeerGone`` went out for it (silent past the router timeout) and
    ``forget_dead_after_s`` passed: its socket is closed, its death was counted once,
    and a pool whose last member it was no longer exists (the pd path is not taken)."""
    async def body(router: Router) -> None:
        router._dispatch(ready("pd-gone", Role.PD, 300, 3))
        router._dispatch(ready("prefill-stays", Role.PREFILL, 301, 4))
        w = router.registry.get("pd-gone")
        base = failures("pd-gone")
        age(router, "pd-gone", 3.0)
        router.forget_dead()  # dead, but its peers were not told yet: kept
        assert router.registry.get("pd-gone") is w and router.has_pool(Role.PD)
        assert router.registry.counts("dead") == {Role.PD: 1}
        age(router, "pd-gone", 10.0)
        router.registry.announce_silent(8.0)
        router.forget_dead()
        assert router.registry.get("pd-gone") is None and not router.has_pool(Role.PD)
        assert w.socket.closed and not w.backlog
        assert router.registry.get("prefill-stays") is not None
        assert router.registry.counts("dead") == {}
        assert failures("pd-gone") == base + 1
        # a replacement under a new id (a Kubernetes pod) joins the pool again
        router._dispatch(ready("pd-new", Role.PD, 302, 5))
        assert router.has_pool(Role.PD) and [x.instance_id for x in router.registry.routable(Role.PD)] == ["pd-new"]

    run(body, forget_dead_after_s=0.0)


def test_forgetting_waits_forget_dead_after_s_and_a_launcher_death_counts_as_told():
    """``mark_dead`` (the launcher saw the process exit) tells the peers at once; the
    entry still stays ``forget_dead_after_s`` from the sweep that first found it dead."""
    async def body(router: Router) -> None:
        router._dispatch(ready("decode-exit", Role.DECODE, 400, 6))
        router.mark_dead("decode-exit")
        router.forget_dead()
        w = router.registry.get("decode-exit")
        assert w is not None and w.dead_at is not None
        w.dead_at -= 31.0
        router.forget_dead()
        assert router.registry.get("decode-exit") is None and not router.has_pool(Role.DECODE)

    run(body, forget_dead_after_s=30.0)


# ---- a wedged main loop ---------------------------------------------------------------------
def test_a_worker_whose_loop_stops_advancing_is_dead_though_it_heartbeats():
    """The heartbeat thread goes on beating while the main loop is wedged: the loop count
    the beats carry stops. Past the worker's stall timeout it is not routable and its death
    counts; a count that moves again brings it back. It is never forgotten while it beats."""
    inst = "decode-wedged"

    async def body(router: Router) -> None:
        router._dispatch(ready(inst, Role.DECODE, 500, 7, stall_timeout_s=5.0))
        w = router.registry.get(inst)
        base = failures(inst)
        router._dispatch(beat(inst, 7, loop=40))
        assert router.registry.routable(Role.DECODE) == [w]
        w.loop_at -= 6.0  # no iteration for 6 s
        for _ in range(4):
            router._dispatch(beat(inst, 7, loop=40))  # the thread repeats the same count
        assert router.registry.routable(Role.DECODE) == [] and not router.registry.is_alive(w)
        assert router.registry.stalled(w)
        router.mailbox.check_deaths()
        assert failures(inst) == base + 1
        router.forget_dead()
        assert router.registry.get(inst) is w  # still beating: not gone, only unroutable
        router._dispatch(beat(inst, 7, loop=39))  # a late, older count changes nothing
        assert not router.registry.is_alive(w)
        router._dispatch(beat(inst, 7, loop=41))
        assert router.registry.routable(Role.DECODE) == [w]

    run(body, forget_dead_after_s=0.0)


# ---- the live max_model_len -----------------------------------------------------------------
def test_the_served_max_model_len_is_the_smallest_live_prefill_or_decode_workers():
    async def body(router: Router) -> None:
        assert router.max_model_len(4096) == 4096  # nobody reports one
        router._dispatch(ready("enc", Role.ENCODE, 600, 8))  # encoders serve no context
        router._dispatch(ready("pre", Role.PREFILL, 601, 9, max_model_len=512))
        router._dispatch(ready("dec", Role.DECODE, 602, 10, max_model_len=192))
        assert router.max_model_len(4096) == 192
        assert router.max_model_len(100) == 100
        age(router, "dec", 5.0)  # a dead worker's limit no longer applies
        assert router.max_model_len(4096) == 512

    run(body)


# ---- the per-worker socket ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_messages_to_a_worker_without_connection_wait_in_order_and_pings_are_dropped():
    """``ZMQ_IMMEDIATE``: nothing queues in the socket for a peer that is not connected.
    What must arrive (``Registered``) waits in the handle's backlog and goes out, in
    order, once the worker's command socket is up; pings meanwhile are dropped."""
    port = _free_port()

    async def body(router: Router) -> None:
        router._dispatch(ready("pd-late", Role.PD, 700, 11, endpoint=f"tcp://127.0.0.1:{port}"))
        w = router.registry.get("pd-late")
        router.registry.ping()
        router.registry.ping()
        assert [type(decode(m)) for m in w.backlog] == [Registered]
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"tcp://127.0.0.1:{port}")
        try:
            got = []
            deadline = time.monotonic() + 10.0
            while len(got) < 2 and time.monotonic() < deadline:
                router._dispatch(beat("pd-late", 11))  # each heartbeat flushes the backlog
                router.registry.ping()
                await asyncio.sleep(0.05)
                while pull.poll(0):
                    got.append(type(decode(pull.recv())))
            assert got[:2] == [Registered, RouterPing] and not w.backlog
        finally:
            pull.close(0)
            ctx.term()

    run(body)
