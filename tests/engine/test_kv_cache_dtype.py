"""Quantized KV cache (``kv_cache_dtype="int8" | "fp8_e4m3"``): greedy SmolLM2-135M output
stays close to the full-precision cache's, which the fp32 parity tests tie to
transformers (tests/engine/test_parity.py).

Exact parity cannot hold (the cache rounds K and V), so: over 50 varied prompts, the
greedy tokens agree position by position on most of the generated tokens (once a
sequence diverges its later positions rarely agree, so this bounds how early any
diverges; each prompt's first divergence is reported), and, on the common prefix,
the log-probability of each chosen token is within ``LOGPROB_TOL`` of the full-precision
engine's (vLLM's check_logprobs_close, tests/models/utils.py). The agreement floor is
``MIN_AGREEMENT`` (measured figures there); 95 % is the goal, not reached yet.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from epd.config import ConfigError, EngineConfig
from epd.kernels.kv_quant import scale_bytes

NEW_TOKENS = 32
LOGPROB_TOL = {"int8": 0.1, "fp8_e4m3": 0.3}  # nats, p99 (the worst may be twice it)
# Measured 2026-12-03 (one scale per 16 values): int8 93.6 %, fp8_e4m3 76.5 %. The issue's
# 95 % is not reached; these floors catch a regression, not the target.
MIN_AGREEMENT = {"int8": 0.90, "fp8_e4m3": 0.70}
SUBJECTS = ["the ocean", "a small robot", "the history of Rome", "prime numbers", "a rainy day", "coffee",
            "the moon landing", "photosynthesis", "a lost cat", "the internet"]
FORMS = ["Write one sentence about {}.", "Tell me a fact about {}.", "What is interesting about {}?",
         "Describe {} to a child.", "Give three words that describe {}."]
PROMPTS = [f.format(s) for s, f in itertools.product(SUBJECTS, FORMS)]  # 50


def _generate(model_dir, kv_cache_dtype):
    from epd import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.25)
    try:
        messages = [[{"role": "user", "content": p}] for p in PROMPTS]
        prompts = [llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                   for m in messages]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                    logprobs=0))
        return [(list(o.outputs[0].token_ids), [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], llm
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_kv_greedy_agrees_with_full_precision(default_model_dir, kind):
    ref, _ = _generate(default_model_dir, "auto")
    got, llm = _generate(default_model_dir, kind)
    assert llm.engine.runner.k_cache.dtype == torch.uint8
    agree = total = 0
    first, diffs = [], []
    for (r_ids, r_lps), (q_ids, q_lps) in zip(ref, got):
        agree += sum(a == b for a, b in zip(r_ids, q_ids))
        total += len(r_ids)
        d = next((i for i, (a, b) in enumerate(zip(r_ids, q_ids)) if a != b), None)
        first.append(d)
        diffs += [abs(r_lps[i] - q_lps[i]) for i in range(len(r_ids) if d is None else d)]  # same prefix
    diverged = sorted(d for d in first if d is not None)
    diffs.sort()
    p99, worst = diffs[int(0.99 * (len(diffs) - 1))], diffs[-1]
    print(f"\n{kind}: {agree}/{total} greedy tokens agree ({agree / total:.1%}); {len(diverged)} of "
          f"{len(PROMPTS)} prompts diverge, first divergence at positions {diverged}; chosen-token logprob "
          f"|diff| on the common prefix: mean {sum(diffs) / len(diffs):.4f}, p99 {p99:.4f}, max {worst:.4f} nats")
    assert p99 < LOGPROB_TOL[kind] and worst < 2 * LOGPROB_TOL[kind], (p99, worst)
    assert agree >= MIN_AGREEMENT[kind] * total, (agree, total, diverged)


def test_kv_cache_dtype_sizes_the_cache_and_is_checked(tiny_model_dirs):
    d = tiny_model_dirs["llama"]
    full = EngineConfig(d, dtype="float32", kv_cache_memory_gb=0.001)
    q = EngineConfig(d, dtype="float32", kv_cache_dtype="int8", kv_cache_memory_gb=0.001)
    assert EngineConfig(d, kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's name
    # head_dim values of 1 byte + their float32 scales, against 4-byte values
    assert q.kv_bytes_per_block() * 4 * full.head_dim == full.kv_bytes_per_block() * (full.head_dim
                                                                                     + scale_bytes(full.head_dim))
    assert q.resolve_num_kv_blocks() > full.resolve_num_kv_blocks()
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(d, kv_cache_dtype="int4")
