"""Quantized KV cache (``kv_cache_dtype="int8" | "fp8_e4m3"``): greedy SmolLM2-135M output
stays close to the full-precision cache's, which the fp32 parity tests tie to
transformers (tests/engine/test_parity.py).

Exact parity cannot hold (the cache rounds K and V), so: over 100 varied prompts, the
greedy tokens agree position by position on most of the generated tokens (once a
sequence diverges its later positions rarely agree, so this bounds how early any
diverges; each prompt's first divergence is reported), and, on the common prefix,
the log-probability of each chosen token is within ``LOGPROB_TOL`` of the full-precision
engine's (vLLM's check_logprobs_close, tests/models/utils.py). int8 meets the issue's
95 % (``MIN_AGREEMENT``; measured figures there): its full K blocks are quantized per
channel and each decode's last block is kept exact until it fills (KIVI's layout,
kernels.kv_quant). fp8_e4m3 does not (3 mantissa bits, per-row scales). Every
divergence is a near tie: where a prompt diverges, the quantized run's pick is among
the full-precision run's top ``TOP`` and at most ``TIE_NATS`` below its pick.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from epd.config import ConfigError, EngineConfig
from epd.kernels.kv_quant import scale_bytes

NEW_TOKENS = 32
LOGPROB_TOL = {"int8": 0.1, "fp8_e4m3": 0.3}  # nats, p99 (the worst may be twice it)
# Measured 2026-12-05, fp32 model, x86-64 with the C++ decode kernel, the 100 prompts in one
# batch: int8 (per-channel K blocks, exact K residual) 3083/3200 = 96.3 % (9 prompts diverge;
# run as two batches of 50: 95.4 % and 96.9 %; the per-row layout before it: 91.1 % and
# 95.1 %); fp8_e4m3 (per-row scales) 2202/3200 = 68.8 %. A sub-ulp change (the scales'
# rounding, the attention kernel's summation order, the batch's chunking) moves these by a
# point or two: a near-tie flip runs a sequence apart. int8's floor is the issue's 95 %;
# fp8's sits under every measurement, to catch a broken quantizer or layout.
MIN_AGREEMENT = {"int8": 0.95, "fp8_e4m3": 0.6}
# Every divergence is a near-tie flip (as vLLM's check_logprobs_close: where the tokens differ,
# the quantized run's pick is in the full-precision run's TOP logprobs), and the full-precision
# run scored the quantized run's pick at most TIE_NATS below its own there: three times the
# logprob tolerance, as a flip moves both tokens' logprobs, and an end-of-text token's moves
# most (measured 2026-12-05: int8 0.185, an end-of-text token whose logprob the per-row layout
# moved by 0.083 and this one by 0.129 there, the other 8 under 0.025; fp8_e4m3 0.298 nats).
# A quantizer or layout fault diverges where the model is sure.
TOP = 5
TIE_NATS = {kind: 3 * tol for kind, tol in LOGPROB_TOL.items()}
SUBJECTS = ["the ocean", "a small robot", "the history of Rome", "prime numbers", "a rainy day", "coffee",
            "the moon landing", "photosynthesis", "a lost cat", "the internet"]
FORMS = ["Write one sentence about {}.", "Tell me a fact about {}.", "What is interesting about {}?",
         "Describe {} to a child.", "Give three words that describe {}."]
SUBJECTS_2 = ["volcanoes", "a birthday party", "the French revolution", "black holes", "a summer garden",
              "jazz music", "electric cars", "the human heart", "an old library", "chess"]
FORMS_2 = ["Explain {} in two sentences.", "Why do people care about {}?", "Write a short poem about {}.",
           "List two facts about {}.", "How would you teach someone about {}?"]
PROMPTS = ([f.format(s) for s, f in itertools.product(SUBJECTS, FORMS)]
           + [f.format(s) for s, f in itertools.product(SUBJECTS_2, FORMS_2)])  # 100


def _generate(model_dir, kv_cache_dtype):
    from epd import LLM, SamplingParams

    # target_step_ms=0: the step-time bound sizes prefill chunks from measured step times, and a
    # quantized cache's logprobs depend on the chunk boundaries (a chunk attends to its own K/V
    # in full precision); without the time bound the chunks, so the figures, are repeatable.
    llm = LLM(model_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.25,
              target_step_ms=0)
    try:
        messages = [[{"role": "user", "content": p}] for p in PROMPTS]
        prompts = [llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                   for m in messages]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                    logprobs=TOP))
        return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outs], llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def full_precision(default_model_dir):
    return _generate(default_model_dir, "auto")[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_kv_greedy_agrees_with_full_precision(default_model_dir, full_precision, kind):
    ref = full_precision
    got, llm = _generate(default_model_dir, kind)
    assert llm.engine.runner.k_cache.dtype == torch.uint8
    agree = total = 0
    first, diffs, ties = [], [], []
    for (r_ids, r_lps), (q_ids, q_lps) in zip(ref, got):
        agree += sum(a == b for a, b in zip(r_ids, q_ids))
        total += len(r_ids)
        d = next((i for i, (a, b) in enumerate(zip(r_ids, q_ids)) if a != b), None)
        first.append(d)
        diffs += [abs(r_lps[i].logprob - q_lps[i].logprob) for i in range(len(r_ids) if d is None else d)]
        if d is not None:  # same prefix up to d: the quantized pick is in full precision's top TOP, nearly tied
            r = r_lps[d]
            assert q_ids[d] in r.top_ids, (d, r, q_lps[d])
            ties.append(r.logprob - r.top_logprobs[r.top_ids.index(q_ids[d])])
    diverged = sorted(d for d in first if d is not None)
    diffs.sort()
    p99, worst = diffs[int(0.99 * (len(diffs) - 1))], diffs[-1]
    print(f"\n{kind}: {agree}/{total} greedy tokens agree ({agree / total:.1%}); {len(diverged)} of "
          f"{len(PROMPTS)} prompts diverge, first divergence at positions {diverged}, where full precision scored the "
          f"quantized pick {max(ties, default=0):.3f} nats below its own at most; chosen-token logprob |diff| on the "
          f"common prefix: mean {sum(diffs) / len(diffs):.4f}, p99 {p99:.4f}, max {worst:.4f} nats")
    assert p99 < LOGPROB_TOL[kind] and worst < 2 * LOGPROB_TOL[kind], (p99, worst)
    assert max(ties, default=0) < TIE_NATS[kind], ties
    assert agree >= MIN_AGREEMENT[kind] * total, (agree, total, diverged)


def test_kv_cache_dtype_sizes_the_cache_and_is_checked(tiny_model_dirs):
    d = tiny_model_dirs["llama"]
    full = EngineConfig(d, dtype="float32", kv_cache_memory_gb=0.001)
    q = EngineConfig(d, dtype="float32", kv_cache_dtype="int8", kv_cache_memory_gb=0.001)
    assert EngineConfig(d, kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's name
    # head_dim values of 1 byte + their scale bytes (4 per 16 values), against 4-byte values
    assert q.kv_bytes_per_block() * 4 * full.head_dim == full.kv_bytes_per_block() * (full.head_dim
                                                                                     + scale_bytes(full.head_dim))
    assert q.resolve_num_kv_blocks() > full.resolve_num_kv_blocks()
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(d, kv_cache_dtype="int4")


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_kv_prefix_hit_and_chunks_stay_close(tiny_model_dirs, kind):
    """A prefill attends to its own chunk's full-precision K/V and to earlier tokens' K/V as
    stored (quantized), as SGLang's ragged + paged prefill does. So a prompt prefilled
    over a 32-token prefix-cache hit equals the same prompt prefilled in chunks of 32 (both
    attend to the quantized rows 0-31 and to their own rows 32-44 unquantized), and both
    differ from a prefill from scratch by the quantization error only (docs/serving.md says so),
    within twice the tolerance against a full-precision cache. A hit that read another sequence's blocks
    would not equal the chunked run. (Attending to the dequantized rows everywhere,
    as vLLM's paged kernels do, makes all three equal but lowered SmolLM2's int8 agreement
    with the full-precision cache from 93.1 to 65.8 % in
    test_quantized_kv_greedy_agrees_with_full_precision: the error compounds through the
    prompt's layers.)"""
    from epd import LLM, SamplingParams

    d = tiny_model_dirs["llama"]
    prompt = [(7 * i + 3) % 200 + 5 for i in range(45)]  # 2 full blocks of 16 and a partial one
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(**kw):
        llm = LLM(d, dtype="float32", kv_cache_dtype=kind, kv_cache_memory_gb=0.01, block_size=16, **kw)
        try:
            return [llm.generate([prompt], params)[0] for _ in range(2)]
        finally:
            llm.shutdown()

    (miss, hit), (chunked, _) = run(), run(max_num_batched_tokens=32)
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens == 32 and chunked.num_cached_tokens == 0
    lps = {name: torch.tensor([lp.logprob for lp in o.outputs[0].logprobs]) for name, o in
           (("miss", miss), ("hit", hit), ("chunked", chunked))}
    assert list(hit.outputs[0].token_ids) == list(chunked.outputs[0].token_ids)
    torch.testing.assert_close(lps["hit"], lps["chunked"], atol=1e-4, rtol=0)
    first = abs(lps["hit"][0] - lps["miss"][0])  # the first token: the prompt's K/V only
    assert hit.outputs[0].token_ids[0] == miss.outputs[0].token_ids[0]
    assert first < 2 * LOGPROB_TOL[kind], (lps["hit"][0], lps["miss"][0])
