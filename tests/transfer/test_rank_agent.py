"""Per-rank agents' write plan (epd.transfer.rank_agent.plan_send): every KV head of a
staged request goes from the prefill rank that holds it to the decode rank that owns
it, exactly once, with max(src_tp, dst_tp) writes per layer."""

from __future__ import annotations

import pytest

from epd.messages import KVLayout, RankKV
from epd.transfer.rank_agent import plan_send, rank_agent_name

HEADS, LAYERS, FULL = 4, 3, 4 * 1000  # 4 KV heads; a staging block of all heads: 4000 bytes (1000 per head)


def _decode_layout(tp: int) -> KVLayout:
    ranks = [RankKV(rank_agent_name("decode-0", q), b"", [], [],
                    [(10**9 * (q + 1) + layer * 10**7, 10**6, 0) for layer in range(LAYERS)]) for q in range(tp)]
    return KVLayout(LAYERS, 64, 8, HEADS // tp, 16, "float32", [], [], tp=tp, staging_block_bytes=FULL,
                    kv_agents="per-rank", ranks=ranks)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4), (4, 2), (4, 1), (1, 4)])
def test_every_head_reaches_its_decode_rank_once(src_tp, dst_tp):
    n, dst_start = 3, 5
    d = _decode_layout(dst_tp)
    send = plan_send("r", 2, n, FULL, src_tp, d, dst_start)
    g = max(src_tp, dst_tp)
    assert len(send.targets) == g  # writes per layer
    assert send.part_bytes * g == n * FULL and send.parts == g // src_tp
    per_head = n * FULL // HEADS  # one KV head of the request, bytes (K and V of n blocks)
    got = {}
    for t in send.targets:
        # global heads held by this part: prefill rank t.rank's heads, part t.part of them
        first_head = t.rank * (HEADS // src_tp) + t.part * (HEADS // g)
        q = int(t.agent.rsplit(".tp", 1)[1]) if ".tp" in t.agent else 0
        for layer in range(LAYERS):
            base = d.ranks[q].staging_regions[layer][0] + dst_start * (FULL // dst_tp)
            off = t.remote[layer] - base
            assert 0 <= off and off + send.part_bytes <= n * FULL // dst_tp  # inside rank q's range
            for h in range(HEADS // g):
                got.setdefault((layer, first_head + h), []).append((q, off // per_head + h))
    # every (layer, head) exactly once, on the decode rank owning it, at its place among that rank's heads
    hd = HEADS // dst_tp
    assert got == {(layer, h): [(h // hd, h % hd)] for layer in range(LAYERS) for h in range(HEADS)}


def test_tps_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="divide"):
        plan_send("r", 0, 1, 6 * 1000, 2, _decode_layout(1).__class__(
            1, 8, 8, 2, 16, "float32", [], [], tp=3, staging_block_bytes=6000, kv_agents="per-rank",
            ranks=[RankKV("d", b"", [], [], [(1 << 30, 1 << 20, 0)])] * 3), 0)
