"""The prefix cache's host tier in served pools (``--kv-host-cache-gb``): on p:1,d:1 with
24 KV blocks of 8 per worker, four 81-token prompts evict each other's blocks; the first
prompt again loads its blocks back from the host tier on both workers (prefill: its
prefix; decode: decode-side reuse) and answers as transformers does. The counters and
gauges of the tier move, and every block comes back free."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.conftest import hf_greedy
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow
BLOCK = 8
PROMPTS = [list(range(20, 101))] + [[base + (k * step) % 400 for k in range(81)]
                                     for base, step in ((7, 37), (9, 53), (11, 71), (13, 89), (17, 97))]
ANSWER = 6


@pytest.fixture(scope="module")
def answers(tiny_model_dirs) -> list[str]:
    """The offline engine's greedy answers to PROMPTS (epd's detokenizer, as the server's);
    the first one's tokens equal transformers'."""
    from epd import LLM, SamplingParams

    path = tiny_model_dirs["llama"]
    llm = LLM(path, dtype="float32")
    try:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=ANSWER,
                                                                           ignore_eos=True))]
    finally:
        llm.shutdown()
    assert list(outs[0].token_ids) == hf_greedy(path, PROMPTS[:1], ANSWER)[0]
    return [o.text for o in outs]


def _complete(server, prompt: list[int], max_tokens: int = ANSWER) -> str:
    return server.client().completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, extra_body={"ignore_eos": True}).choices[0].text


def _block_gb(path: str, n: int) -> str:
    """``n`` KV blocks of tiny Llama (fp32, BLOCK tokens), in GiB, as a flag value."""
    from epd.config import EngineConfig

    return repr(n * EngineConfig(path, dtype="float32", block_size=BLOCK).kv_bytes_per_block() / 2**30)


def _settled_metric(server, name: str, instance: str, tier: str, want: float) -> float:
    """The metric once it reached ``want`` (worker metrics move once per heartbeat)."""
    for _ in range(50):
        got = _metric(server, name, instance, tier)
        if got >= want:
            return got
        time.sleep(0.1)
    return _metric(server, name, instance, tier)


def _metric(server, name: str, instance: str, tier: str = "") -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    pattern = rf'^{name}{{[^}}]*instance="{instance}"[^}}]*}} ([0-9.e+]+)$'
    if tier:
        pattern = rf'^{name}{{(?=[^}}]*instance="{instance}")(?=[^}}]*tier="{tier}")[^}}]*}} ([0-9.e+]+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_prompt_evicted_to_host_comes_back(tiny_model_dirs, answers):
    with launch(tiny_model_dirs["llama"], "p:1,d:1", "--block-size", str(BLOCK), "--num-kv-blocks", "24",
                "--kv-host-cache-gb", "0.01") as server:
        assert _complete(server, PROMPTS[0]) == answers[0]
        for p in PROMPTS[1:4]:
            _complete(server, p)
        before = server.workers()
        for inst in ("prefill-0", "decode-0"):
            assert before[inst]["kv_host_offloaded_blocks"] >= 10 and before[inst]["kv_host_used_blocks"] > 0
        assert _complete(server, PROMPTS[0]) == answers[0]
        after = server.workers()
        for inst in ("prefill-0", "decode-0"):
            loaded = after[inst]["prefix_cache_host_hit_tokens"] - before[inst]["prefix_cache_host_hit_tokens"]
            assert loaded >= 9 * BLOCK, (inst, after[inst])  # most of the prompt's 10 full blocks
            assert after[inst]["num_free_blocks"] == 24
        assert _settled_metric(server, "epd_prefix_cache_hits_tokens_total", "prefill-0", "host", 9 * BLOCK) \
            >= 9 * BLOCK
        assert _metric(server, "epd_kv_host_offloaded_blocks_total", "decode-0") >= 10
        assert 0 < _metric(server, "epd_kv_host_cache_usage_ratio", "prefill-0") <= 1


def test_prompt_evicted_to_disk_comes_back(tiny_model_dirs, answers, tmp_path):
    """Host tiers of 4 blocks with a disk tier under them: the first prompt's blocks go
    device -> host -> disk and come back from disk on both workers, exactly."""
    path = tiny_model_dirs["llama"]
    with launch(path, "p:1,d:1", "--block-size", str(BLOCK), "--num-kv-blocks", "24",
                "--kv-host-cache-gb", _block_gb(path, 4), "--kv-disk-cache-dir", str(tmp_path),
                "--kv-disk-cache-gb", "0.01") as server:
        assert _complete(server, PROMPTS[0]) == answers[0]
        for p in PROMPTS[1:4]:
            _complete(server, p)
        before = server.workers()
        for inst in ("prefill-0", "decode-0"):
            assert before[inst]["kv_host_blocks"] == 4 and before[inst]["kv_disk_stored_blocks"] >= 6, before[inst]
        assert _complete(server, PROMPTS[0]) == answers[0]
        after = server.workers()
        for inst in ("prefill-0", "decode-0"):
            read = after[inst]["prefix_cache_disk_hit_tokens"] - before[inst]["prefix_cache_disk_hit_tokens"]
            assert read >= 5 * BLOCK, (inst, after[inst])
            assert after[inst]["num_free_blocks"] == 24 and after[inst]["kv_disk_write_errors"] == 0
        assert list(tmp_path.iterdir()) == []  # anonymous files: nothing named on disk
        assert _settled_metric(server, "epd_prefix_cache_hits_tokens_total", "prefill-0", "disk", 5 * BLOCK) \
            >= 5 * BLOCK
        assert _metric(server, "epd_kv_disk_stored_blocks_total", "decode-0") >= 6
        assert 0 < _metric(server, "epd_kv_disk_cache_usage_ratio", "prefill-0") <= 1
        text = httpx.get(server.url + "/metrics", timeout=30).text  # a counter never moved is there, at 0
        assert re.search(r'^epd_kv_disk_write_errors_total{[^}]*instance="prefill-0"[^}]*} 0\.0$', text, re.M)


def test_kv_routing_sends_a_prompt_back_to_the_instance_holding_it_in_its_host_tier(tiny_model_dirs):
    """p:2,d:1 with KV-aware prefill routing (the default) and 16-block caches: prompt A
    runs on prefill-0, four others alternate between the two and push A's blocks out of
    prefill-0's KV cache into its host tier. Past the routing prediction's lifetime, A
    goes back to prefill-0 (the index knows its blocks are in the host tier), not to
    prefill-1 (which a tie on an empty index would pick: it was routed fewer requests),
    and loads them back."""
    from epd.router.kv_index import PREDICTION_TTL_S

    path = tiny_model_dirs["llama"]
    with launch(path, "p:2,d:1", "--block-size", str(BLOCK), "--num-kv-blocks", "16",
                "--kv-host-cache-gb", "0.01") as server:
        first = _complete(server, PROMPTS[0], 2)
        for p in PROMPTS[1:5]:
            _complete(server, p, 2)
        before = server.workers()
        assert before["prefill-0"]["kv_host_offloaded_blocks"] >= 8, before["prefill-0"]
        assert before["prefill-0"]["prefix_cache_query_tokens"] > before["prefill-1"]["prefix_cache_query_tokens"]
        time.sleep(PREDICTION_TTL_S + 1)  # only the reported tiers remain in the index
        assert _complete(server, PROMPTS[0], 2) == first
        after = server.workers()
        p0, p0_before = after["prefill-0"], before["prefill-0"]
        assert p0["prefix_cache_host_hit_tokens"] - p0_before["prefix_cache_host_hit_tokens"] >= 8 * BLOCK, p0
        assert after["prefill-1"]["prefix_cache_query_tokens"] == before["prefill-1"]["prefix_cache_query_tokens"]


def test_full_tiers_and_cancels_lose_nothing_and_leak_nothing(tiny_model_dirs, answers, tmp_path):
    """p:1,d:1 with a 2-block host tier over a 4-block disk tier, both full within the
    first requests: twelve requests over six prompts at once, every third cancelled after
    its first streamed token. Every answer that completes is exact, both tiers keep
    evicting, and every worker ends idle with all its blocks free."""
    from concurrent.futures import ThreadPoolExecutor

    path = tiny_model_dirs["llama"]
    with launch(path, "p:1,d:1", "--block-size", str(BLOCK), "--num-kv-blocks", "24",
                "--kv-host-cache-gb", _block_gb(path, 2), "--kv-disk-cache-dir", str(tmp_path),
                "--kv-disk-cache-gb", _block_gb(path, 4)) as server:
        client = server.client()

        def run(i: int) -> str | None:
            p = PROMPTS[i % len(PROMPTS)]
            if i % 3 == 2:  # cancelled: the client goes away after the first token
                stream = client.completions.create(model=server.model, prompt=p, max_tokens=100, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                next(iter(stream))
                stream.close()
                return None
            return _complete(server, p)

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(run, range(12)))
        assert [g for g in got if g is not None] == [answers[i % len(PROMPTS)] for i in range(12) if i % 3 != 2]

        def idle():
            st = server.workers()
            return all(st[i]["num_free_blocks"] == 24 and not st[i]["num_running"] and not st[i]["num_waiting"]
                       and not st[i].get("num_reserved", 0) for i in ("prefill-0", "decode-0")), st

        for _ in range(100):
            done, st = idle()
            if done:
                break
            time.sleep(0.1)
        assert done, st
        for inst in ("prefill-0", "decode-0"):
            s = st[inst]
            assert s["kv_host_used_blocks"] <= 2 and s["kv_disk_used_blocks"] <= 4, s
            assert s["kv_host_evicted_blocks"] > 0 and s["kv_disk_evicted_blocks"] > 0, s  # both tiers were full
            assert s["kv_disk_write_errors"] == 0
