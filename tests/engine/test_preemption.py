"""Preemption by recompute: a KV cache too small for the batch changes no token."""

from __future__ import annotations

import random

from epd import LLM, SamplingParams


def test_preemption_keeps_tokens(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (30, 45, 12, 60, 25, 38, 50, 20)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    roomy = LLM(model_dir, block_size=8, max_num_batched_tokens=64, dtype="float32")
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    assert roomy.engine.stats()["num_preemptions"] == 0
    roomy.shutdown()

    # 24 blocks of 8 = 192 tokens for 8 requests that need up to ~100 each.
    tight = LLM(model_dir, block_size=8, max_num_batched_tokens=64, num_kv_blocks=24, dtype="float32")
    outs = tight.generate(prompts, params)
    stats = tight.engine.stats()
    assert stats["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert stats["num_free_blocks"] == stats["num_blocks"] == 24
    tight.shutdown()


def test_seeded_sampling_survives_preemption(tiny_model_dirs):
    """A seeded request draws from its own generator, so pressure does not change it."""
    model_dir = tiny_model_dirs["qwen2"]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (30, 45, 12, 60)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = LLM(model_dir, block_size=8, dtype="float32")
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # The same request alone, in another batch position, gives the same tokens.
    alone = roomy.generate([prompts[2]], [params[2]])[0].outputs[0].token_ids
    assert alone == expected[2]
    roomy.shutdown()
    tight = LLM(model_dir, block_size=8, num_kv_blocks=14, dtype="float32")
    outs = tight.generate(prompts, params)
    assert tight.engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    tight.shutdown()
