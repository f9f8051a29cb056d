"""Aborted KV transfers: no stale prefill write lands in blocks the decode worker reused,
and nothing leaks (issue 13 defect 1; public bug-log rows 1 and 3).

A prefill worker reads ``Abort`` only between engine steps, but its per-layer hook
keeps writing during the step. The decode worker must keep an aborted reservation's
blocks fenced until that writer says it will never write again (``KVWriterDone``) or
its process is gone, never for a fixed time. ``EPD_INJECT_KV_WRITE_DELAY_S`` makes
every layer after the first of a long prompt's KV land that many seconds late, as a
long final chunk on a slow machine would.
"""

from __future__ import annotations

import time

import pytest

from epd.models.tiny import create_tiny_model
from tests.serving.conftest import Server, launch
from tests.serving.public_bugs_helpers import start_and_drop

pytestmark = pytest.mark.slow

DELAY_S = 4.0  # per layer after the first, for prompts of >= LONG_BLOCKS blocks
LONG_BLOCKS = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("stale") / "llama"))


def _complete(server: Server, prompt: list[int], max_tokens: int) -> str:
    out = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def _idle(server: Server, before: dict, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        after = server.workers()
        if all(after.get(i, {}).get("num_free_blocks") == s.get("num_free_blocks")
               and not any(after[i].get(k, 0) for k in ("num_reserved", "num_held", "num_quarantined",
                                                        "num_running", "num_waiting"))
               for i, s in before.items()):
            return after
        if time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def test_aborted_prefill_never_writes_into_reused_blocks(llama_dir):
    """Defect 1: a long prompt is aborted (client gone) while its prefill worker is still
    writing its layers; a second request, prefilled on the other prefill worker while
    the first one's writes are still coming, decodes on the same decode worker. Its
    tokens equal its undisturbed run: the aborted reservation's blocks were not reused
    before the first writer finished. Every block comes back afterwards."""
    env = {"EPD_INJECT_KV_WRITE_DELAY_S": str(DELAY_S), "EPD_INJECT_KV_WRITE_DELAY_MIN_BLOCKS": str(LONG_BLOCKS)}
    with launch(llama_dir, "p:2,d:1", "--prefill-routing", "round-robin", "--max-num-seqs", "8",
                env=env) as server:
        short = [300 + k for k in range(20)]  # 2 blocks: never delayed
        long = [50 + (7 * k) % 400 for k in range(16 * (LONG_BLOCKS + 4))]
        expected = _complete(server, short, 1500)
        _complete(server, short, 1)  # round-robin: the next prefill goes to the first worker again
        before = server.workers()

        dropped = start_and_drop(server, long, after_s=0.5)  # aborted before its layer-1 write
        time.sleep(2.5)  # past any fixed quarantine, before the stale write lands
        got = _complete(server, short, 1500)  # the other prefill worker, the same decode worker
        dropped.join()
        assert got == expected

        after = _idle(server, before)
        writes = sum(after[i].get("kv_transfer_requests", 0) - s.get("kv_transfer_requests", 0)
                     for i, s in before.items() if i.startswith("prefill"))
        assert writes == 4, writes  # one write per layer (2) of each: the aborted prompt was mid-transfer
        for inst, stats in before.items():
            assert after[inst].get("num_free_blocks") == stats.get("num_free_blocks"), (inst, after[inst])
            assert not after[inst].get("num_quarantined", 0), (inst, after[inst])


def test_bug_log_rows_1_and_3_disconnect_during_transfer_leaks_nothing(llama_dir):
    """Bug-log row 1 (vllm#46283: client disconnects while decode waits for remote KV and
    prefill aborts too) and row 3 (dynamo PR #7489: client disconnect during the NIXL
    transfer): a dozen long prompts dropped mid-transfer leave every worker's blocks,
    reservations and fences as they were, and serving goes on exactly."""
    env = {"EPD_INJECT_KV_WRITE_DELAY_S": "0.3", "EPD_INJECT_KV_WRITE_DELAY_MIN_BLOCKS": str(LONG_BLOCKS)}
    with launch(llama_dir, "p:1,d:1", "--max-num-seqs", "16", env=env) as server:
        short = [200 + k for k in range(24)]
        expected = _complete(server, short, 32)
        before = server.workers()
        threads = [start_and_drop(server, [60 + (13 * i + 5 * k) % 400 for k in range(16 * LONG_BLOCKS + 5)], 0.2)
                   for i in range(12)]
        for t in threads:
            t.join()
        after = _idle(server, before)
        for inst, stats in before.items():
            assert after[inst].get("num_free_blocks") == stats.get("num_free_blocks"), (inst, after[inst])
            for k in ("num_reserved", "num_held", "num_quarantined", "num_running", "num_waiting"):
                assert not after[inst].get(k, 0), (inst, k, after[inst])
        assert _complete(server, short, 32) == expected
