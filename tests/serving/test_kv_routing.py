"""Routing policies end to end: real `epd launch`, real workers, the openai SDK, /metrics counters.

KV-aware prefill routing: two prefill instances whose KV cache holds about two of
three long system prompts (``--num-kv-blocks``). Requests sharing those system
prompts arrive interleaved (A B C A B C ...). The kv policy keeps each system
prompt on one instance, so its blocks stay cached there; round-robin sends every
prompt to both instances in turn, and each instance's LRU cache thrashes. The
prefix-cache hit tokens (``epd_prefix_cache_hits_tokens_total``, counted by the
engines) must be at least 2x higher under kv, and the greedy answers identical.

Media affinity: the same image sent twice on ``e:2`` is encoded once: the second
request meets the same encoder's cache (``epd_encoder_cache_hits_total``).
"""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest

from epd.models.tiny import IMAGE_TOKEN, create_tiny_model
from tests.serving.conftest import launch
from tests.serving.test_disaggregated import _chat_messages, _png

pytestmark = pytest.mark.slow

BLOCK_SIZE = 8
NUM_KV_BLOCKS = 24  # per worker: two system prompts (10 blocks each) fit, three do not
SYSTEM_TOKENS = 80
ROUNDS = 4
MAX_TOKENS = 2


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("route") / "llava"))


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(10, 400) for _ in range(SYSTEM_TOKENS)] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(10, 400) for _ in range(12)] for i in range(3 * ROUNDS)]


def _counter(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of counter ``name`` whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _settled_metrics(server, expect_query_tokens: int) -> str:
    """/metrics once every prefill engine's lookups reached the exporter (workers
    publish counters with their heartbeat, every 0.25 s)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        if _counter(text, "epd_prefix_cache_queries_tokens_total", pool="prefill") >= expect_query_tokens:
            return text
        assert time.monotonic() < deadline, "prefix-cache query counters never caught up:\n" + text[-3000:]
        time.sleep(0.2)


def _run_shared_prompts(server) -> tuple[list[str], str]:
    client = server.client()
    model = server.model
    answers = []
    for p in _prompts():  # one at a time, interleaved system prompts
        r = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        answers.append(r.choices[0].text)
    return answers, _settled_metrics(server, sum(len(p) for p in _prompts()))


def test_kv_routing_hits_the_prefix_cache_and_media_affinity_hits_the_encoder_cache(llava_dir):
    common = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS))
    # the baseline: round-robin without reading prefixes from the other instance (remote
    # prefix reads would recover most of what round-robin loses: tests/serving/test_prefix_read_serving.py)
    with launch(llava_dir, "p:2,d:1", *common, "--prefill-routing", "round-robin", "--no-remote-prefix-reads"
                ) as server:
        rr_answers, rr_metrics = _run_shared_prompts(server)
    with launch(llava_dir, "e:2,p:2,d:1", *common) as server:  # defaults: kv, free-kv, media-affinity
        kv_answers, kv_metrics = _run_shared_prompts(server)

        # The same image twice: encoded once, by the encoder its item hash maps to.
        client = server.client()
        messages = _chat_messages(f"{IMAGE_TOKEN} What is this?", [_png(7)])
        first = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0)
        second = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0)
        assert second.choices[0].message.content == first.choices[0].message.content
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(server.url + "/metrics", timeout=30).text
            if _counter(text, "epd_encoder_cache_queries_total", pool="encode") >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert _counter(text, "epd_encoder_cache_queries_total", pool="encode") == 2
        assert _counter(text, "epd_encoder_cache_hits_total", pool="encode") == 1
        per_encoder = [_counter(text, "epd_routing_decisions_total", pool="encode", policy="media-affinity",
                                instance=f"encode-{i}") for i in range(2)]
        assert sorted(per_encoder) == [0, 2]
        # The repeated image prompt (same tokens, same item hash) went to the prefill
        # instance that cached it: every full block but the last token's was reused.
        prompt_tokens = second.usage.prompt_tokens
        assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE

    assert kv_answers == rr_answers  # routing never changes greedy output
    n = len(_prompts())
    assert _counter(rr_metrics, "epd_routing_decisions_total", pool="prefill", policy="round-robin") == n
    assert _counter(kv_metrics, "epd_routing_decisions_total", pool="prefill", policy="kv") == n
    assert _counter(kv_metrics, "epd_routing_decisions_total", pool="decode", policy="free-kv") == n
    rr_hits = _counter(rr_metrics, "epd_prefix_cache_hits_tokens_total", pool="prefill")
    kv_hits = _counter(kv_metrics, "epd_prefix_cache_hits_tokens_total", pool="prefill")
    print(f"prefix-cache hit tokens over {n} requests: kv {kv_hits:.0f}, round-robin {rr_hits:.0f}")
    # kv: every request after the first of its system prompt reuses the whole system prompt
    # (here, on a shared 2-core machine, one miss is tolerated: a retry after a late heartbeat).
    assert (n - 4) * SYSTEM_TOKENS <= kv_hits <= (n - 3) * SYSTEM_TOKENS
    assert kv_hits >= 2 * rr_hits
