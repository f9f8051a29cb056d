"""Speculative decoding served (``--speculative-config``) on p:1,d:1: the decode worker
verifies n-gram drafts and streams several tokens per step; every answer, streamed or
not, equals the offline engine's greedy answer without speculation, and the
speculation counters reach /metrics."""

from __future__ import annotations

import json
import random
import time

import pytest

from tests.serving.conftest import launch
from tests.serving.public_bugs_helpers import Reference, assert_idle, metric

pytestmark = pytest.mark.slow
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
MAX_TOKENS = 48


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    out = []
    for n in (4, 10, 24):
        span = [rng.randrange(3, 400) for _ in range(n)]
        out.append([rng.randrange(3, 400) for _ in range(3)] + span * 3)
    return out


def test_served_speculation_keeps_greedy_answers(tiny_model_dirs):
    ref = Reference(tiny_model_dirs["llama"])
    prompts = _prompts()
    try:
        want = ref.texts(prompts, MAX_TOKENS)
    finally:
        ref.close()
    with launch(tiny_model_dirs["llama"], "p:1,d:1", "--block-size", "8", "--speculative-config", SPEC) as server:
        before = server.workers()
        client = server.client()
        for prompt, text in zip(prompts, want):
            body = dict(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                        extra_body={"ignore_eos": True})
            out = client.completions.create(**body)
            assert out.choices[0].text == text and out.usage.completion_tokens == MAX_TOKENS
            streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
            assert streamed == text
        stats = assert_idle(server, before)["decode-0"]
        assert stats["spec_num_draft_tokens"] > 0, stats
        for _ in range(50):  # (worker metrics move once per heartbeat)
            if metric(server, "epd_spec_decode_num_draft_tokens_total", instance="decode-0") \
                    == stats["spec_num_draft_tokens"]:
                break
            time.sleep(0.1)
        assert metric(server, "epd_spec_decode_num_draft_tokens_total", instance="decode-0") \
            == stats["spec_num_draft_tokens"]
