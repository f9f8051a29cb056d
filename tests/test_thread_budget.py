"""The thread budget: a host's cores go to the workers that have work.

Real processes share one board file: each takes ``cores // busy workers`` threads when
it steps, an idle one holds none of the share, a SIGKILLed busy one stops counting and
its slot is reclaimed by the next process to join.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import torch

from epd.workers import thread_budget
from epd.workers.thread_budget import ThreadBudget

CORES = 4


def _member(path: str, conn) -> None:
    """A worker process: joins the board, then obeys "busy" / "idle" / "slot" commands."""
    budget = ThreadBudget(cores=CORES, path=path)
    conn.send(("slot", budget.slot))
    while True:
        cmd = conn.recv()
        if cmd == "busy":
            conn.send(("threads", budget.acquire()))
        elif cmd == "idle":
            budget.release()
            conn.send(("ok", None))
        elif cmd == "close":
            budget.close()
            conn.send(("ok", None))
            return


def _spawn(path: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_member, args=(path, child), daemon=True)
    proc.start()
    kind, slot = parent.recv()
    assert kind == "slot"
    return proc, parent, slot


def _ask(conn, cmd: str):
    conn.send(cmd)
    assert conn.poll(60), f"no answer to {cmd}"
    return conn.recv()[1]


def test_cores_follow_the_busy_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(thread_budget, "LIVENESS_CHECK_S", 0.0)
    path = str(tmp_path / "board")
    before = torch.get_num_threads()
    me = ThreadBudget(cores=CORES, path=path)
    procs = []
    try:
        assert me.acquire() == CORES and torch.get_num_threads() == CORES  # alone with work: every core
        a, a_conn, a_slot = _spawn(path)
        b, b_conn, b_slot = _spawn(path)
        procs += [a, b]
        assert len({me.slot, a_slot, b_slot}) == 3
        assert me.acquire() == CORES  # the others joined but are idle: they hold nothing
        assert _ask(a_conn, "busy") == CORES // 2
        assert me.acquire() == CORES // 2 and torch.get_num_threads() == CORES // 2
        assert _ask(b_conn, "busy") == 1  # 4 // 3: never more threads than cores
        assert me.acquire() == 1
        _ask(a_conn, "idle")
        assert me.acquire() == CORES // 2
        os.kill(b.pid, signal.SIGKILL)  # dies busy: its mark no longer counts
        b.join(30)
        assert me.acquire() == CORES
        c, c_conn, c_slot = _spawn(path)  # the dead process's slot is reclaimed
        procs.append(c)
        assert c_slot == b_slot
        me.release()
        assert _ask(c_conn, "busy") == CORES  # a is idle and I released: c alone has work
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        me.close()
        torch.set_num_threads(before)
