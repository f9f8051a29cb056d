"""Decode-side reuse over real NIXL: a decode instance matches each reservation against
its own prefix cache, and the prefill worker writes only the blocks after the hit.

Multi-turn conversations on tiny Llama (fp32, blocks of 8): turn 2 extends turn 1's
prompt and answer. Parity: every answer equals transformers' greedy ``generate``. The
saving is counted in bytes: ``epd_kv_transfer_bytes_total`` of turn 2 is its missing
blocks only, and ``epd_kv_transfer_saved_bytes_total`` the blocks the decode side held.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.conftest import hf_greedy
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow
BLOCK = 8
ANSWER = 6
TURN_1 = [list(range(20, 61)), [7 + (k * 37) % 300 for k in range(29)]]  # 41 and 29 tokens: 5 and 3 full blocks
MORE = [11, 12, 13, 14, 15, 16, 17]


def _counter(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def _settled(server, name: str, want: float) -> float:
    """The counter ``name`` once it reached ``want`` (worker counters move each heartbeat)."""
    for _ in range(100):
        got = _counter(server, name)
        if got >= want:
            return got
        time.sleep(0.1)
    return _counter(server, name)


def _complete(server, prompt: list[int]) -> str:
    r = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=ANSWER, temperature=0,
                                           extra_body={"ignore_eos": True})
    return r.choices[0].text


@pytest.fixture(scope="module")
def conversations(tiny_model_dirs):
    """[(turn-1 prompt, turn-2 prompt, turn-1 answer, turn-2 answer)]: the offline engine's
    answers (epd's detokenizer, as the server's), whose tokens equal transformers'."""
    from epd import LLM, SamplingParams

    path = tiny_model_dirs["llama"]
    llm = LLM(path, dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True)
        firsts = [o.outputs[0] for o in llm.generate(TURN_1, params)]
        seconds = [p + list(a.token_ids) + MORE for p, a in zip(TURN_1, firsts)]
        answers = [o.outputs[0] for o in llm.generate(seconds, params)]
    finally:
        llm.shutdown()
    assert [list(a.token_ids) for a in firsts + answers] == hf_greedy(path, TURN_1 + seconds, ANSWER)
    return [(p1, p2, a1.text, a2.text) for p1, p2, a1, a2 in zip(TURN_1, seconds, firsts, answers)]


CASES = [("p:2,d:1", None), ("p:2,d:1", "p:2,d:1")]  # two prefill instances; one of TP 2 (staged 2 -> 1)


@pytest.mark.parametrize("pools,tp", CASES, ids=["p2-d1", "tp2-to-1-staged"])
def test_follow_up_turn_moves_only_what_decode_lacks(pools, tp, tiny_model_dirs, conversations):
    extra = ["--tp", tp] if tp else []
    with launch(tiny_model_dirs["llama"], pools, "--block-size", str(BLOCK), *extra) as server:
        _check_turns(server, conversations, reuse=True)


def test_no_decode_kv_reuse_moves_every_block(tiny_model_dirs, conversations):
    """--no-decode-kv-reuse (the A/B switch): the follow-up turn moves its whole prompt."""
    with launch(tiny_model_dirs["llama"], "p:1,d:1", "--block-size", str(BLOCK), "--no-decode-kv-reuse") as server:
        _check_turns(server, conversations[:1], reuse=False)


def _check_turns(server, conversations, reuse: bool) -> None:
    """Both turns of each conversation answer as the offline engine; turn 2 moves only the
    blocks the decode instance lacks (``reuse``), or every block."""
    block_bytes = server.workers()["decode-0"]["kv_block_bytes"]  # decode TP 1: one rank holds every head
    for p1, p2, a1, a2 in conversations:
        moved0 = _counter(server, "epd_kv_transfer_bytes_total")
        reused0 = server.workers()["decode-0"]["kv_reused_blocks"]
        assert _complete(server, p1) == a1
        moved1 = _settled(server, "epd_kv_transfer_bytes_total", moved0 + 1)
        assert server.workers()["decode-0"]["kv_reused_blocks"] == reused0  # nothing of it was cached
        assert moved1 - moved0 == -(-len(p1) // BLOCK) * block_bytes
        saved1 = _counter(server, "epd_kv_transfer_saved_bytes_total")
        assert _complete(server, p2) == a2
        moved2 = _settled(server, "epd_kv_transfer_bytes_total", moved1 + 1)
        reused = server.workers()["decode-0"]["kv_reused_blocks"] - reused0
        if reuse:
            assert reused >= len(p1) // BLOCK  # turn 1's full prompt blocks at least
            assert _settled(server, "epd_kv_transfer_saved_bytes_total", saved1 + 1) - saved1 == reused * block_bytes
        else:
            assert reused == 0
        assert moved2 - moved1 == (-(-len(p2) // BLOCK) - reused) * block_bytes
    stats = server.workers()
    assert stats["decode-0"]["num_reserved"] == 0 and stats["decode-0"].get("num_quarantined", 0) == 0


def test_each_follow_up_turn_is_routed_to_the_decode_instance_holding_its_last_turn(tiny_model_dirs, conversations):
    """p:1,d:2: the two conversations' first turns run at once, so free-kv spreads them
    over decode-0 and decode-1. Each follow-up turn then goes to the instance that decoded
    its first turn (the decode instances report their prefix caches), and reuses it there;
    plain free-kv would send both to decode-0 (a tie on idle instances), where only one
    conversation's blocks are."""
    from concurrent.futures import ThreadPoolExecutor

    with launch(tiny_model_dirs["llama"], "p:1,d:2", "--block-size", str(BLOCK)) as server:
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda c: _complete(server, c[0]), conversations)) == [c[2] for c in conversations]
        routed = {i: _routed(server, i) for i in ("decode-0", "decode-1")}
        assert routed == {"decode-0": 1, "decode-1": 1}, routed
        time.sleep(1.0)  # past a heartbeat: the decode instances' KV events are in
        before = server.workers()
        for _, p2, _, a2 in conversations:
            assert _complete(server, p2) == a2
        after = server.workers()
        reused = {i: after[i]["kv_reused_blocks"] - before[i]["kv_reused_blocks"] for i in ("decode-0", "decode-1")}
        assert all(n >= 3 for n in reused.values()), reused  # each turn 2 hit its turn 1's blocks
        assert {i: _routed(server, i) for i in routed} == {"decode-0": 2, "decode-1": 2}


def _routed(server, instance: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(
        rf'^epd_routing_decisions_total{{(?=[^}}]*pool="decode")(?=[^}}]*instance="{instance}")[^}}]*}} ([0-9.e+]+)$',
        text, re.M))
