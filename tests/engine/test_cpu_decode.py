"""The fused CPU decode step (epd.engine.cpu_decode) against the eager modules.

The eager torch modules (``enforce_eager=True``) are the reference. In fp32 the fused step
gives the same greedy tokens and log-probabilities within 1e-4 (the kernels sum in another
order than oneDNN) across prefill chunks, decode, preemption, TP 2 and image embeddings;
in bf16 (and with int8 weights) the log-probabilities are close by vLLM's
``check_logprobs_close``: while the two greedy paths agree, the chosen token's
log-probabilities agree within a tolerance, and where they first part, each side's token
is among the other's top alternatives (a near tie).
"""

from __future__ import annotations

import random

import pytest
import torch

from epd import LLM, SamplingParams
from epd.kernels.cpu_extension import load

pytestmark = pytest.mark.skipif(load() is None, reason="epd's CPU kernels are not built here")


def _generate(model_dir, prompts, params, **kw):
    llm = LLM(model_dir, **kw)
    runner = llm.engine.runner
    calls = []
    if runner.fused is not None:
        run = runner.fused.run
        runner.fused.run = lambda *a: calls.append(1) or run(*a)
    try:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs], len(calls), stats


def check_logprobs_close(ref, test, tol: float, min_agree: float = 0.5) -> None:
    """vLLM's check: on every sequence, matching tokens have log-probabilities within
    ``tol``; at the first differing position each token is in the other's top list.
    At least ``min_agree`` of all positions must be compared before a split."""
    compared = total = 0
    for r, t in zip(ref, test):
        total += len(r.token_ids)
        for i, (a, b) in enumerate(zip(r.logprobs, t.logprobs)):
            if a.token_id == b.token_id:
                assert abs(a.logprob - b.logprob) <= tol, (i, a, b)
                compared += 1
                continue
            assert a.token_id in b.top_ids and b.token_id in a.top_ids, (i, a, b)
            break
    assert compared >= min_agree * total, (compared, total)


def _prompts(n_lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in n_lens]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fused_decode_equals_eager_fp32(kind, tiny_model_dirs):
    """Chunked prefill (16-token steps), mixed steps, then decode-only steps run fused."""
    prompts = _prompts((30, 5, 47, 12))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    kw = dict(block_size=8, max_num_batched_tokens=16, dtype="float32")
    eager, n_eager, _ = _generate(tiny_model_dirs[kind], prompts, params, enforce_eager=True, **kw)
    fused, n_fused, _ = _generate(tiny_model_dirs[kind], prompts, params, **kw)
    assert n_eager == 0 and n_fused > 10
    for e, f in zip(eager, fused):
        assert f.token_ids == e.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(e.logprobs, f.logprobs)) < 1e-4


def test_fused_decode_through_preemption(tiny_model_dirs):
    prompts = _prompts((30, 45, 12, 60, 25, 38, 50, 20), seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(block_size=8, max_num_batched_tokens=64, dtype="float32")
    eager, _, _ = _generate(tiny_model_dirs["llama"], prompts, params, enforce_eager=True, **kw)
    fused, n, stats = _generate(tiny_model_dirs["llama"], prompts, params, num_kv_blocks=24, **kw)
    assert stats["num_preemptions"] > 0 and n > 0
    assert [f.token_ids for f in fused] == [e.token_ids for e in eager]
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_fused_decode_at_tp2(tiny_model_dirs):
    """The fused step all-reduces each row-parallel output through the TP group."""
    prompts = _prompts((20, 33, 9))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(block_size=8, max_num_batched_tokens=32, dtype="float32")
    eager, _, _ = _generate(tiny_model_dirs["qwen2"], prompts, params, enforce_eager=True, **kw)
    fused, n, _ = _generate(tiny_model_dirs["qwen2"], prompts, params, tensor_parallel_size=2, **kw)
    assert n > 0
    for e, f in zip(eager, fused):
        assert f.token_ids == e.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(e.logprobs, f.logprobs)) < 1e-4


def test_fused_decode_after_image_embeddings(tmp_path):
    import numpy as np
    from PIL import Image

    from epd.models.tiny import IMAGE_TOKEN, create_tiny_model

    model_dir = str(create_tiny_model("llava", tmp_path / "llava"))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)) for _ in range(2)]
    request = {"prompt": f"Look {IMAGE_TOKEN}{IMAGE_TOKEN} and tell", "multi_modal_data": {"image": images}}
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    kw = dict(block_size=8, max_num_batched_tokens=16, dtype="float32")
    eager, _, _ = _generate(model_dir, request, params, enforce_eager=True, **kw)
    fused, n, _ = _generate(model_dir, request, params, **kw)
    assert n > 0
    assert fused[0].token_ids == eager[0].token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(eager[0].logprobs, fused[0].logprobs)) < 1e-4


REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is",
                "List three primary colours:", "Once upon a time"]


@pytest.mark.slow
def test_fused_bf16_and_int8_close_to_eager_bf16(default_model_dir):
    """SmolLM2 in bf16: the fused step against the eager one; int8 weights against bf16."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    kw = dict(dtype="bfloat16", kv_cache_memory_gb=0.25)
    eager, _, _ = _generate(default_model_dir, REAL_PROMPTS, params, enforce_eager=True, **kw)
    fused, n, _ = _generate(default_model_dir, REAL_PROMPTS, params, **kw)
    assert n > 0
    check_logprobs_close(eager, fused, tol=0.25, min_agree=0.8)  # bf16 logits: a few ulps
    int8, _, _ = _generate(default_model_dir, REAL_PROMPTS, params, quantization="int8", **kw)
    check_logprobs_close(eager, int8, tol=0.5, min_agree=0.5)


def test_int8_weights_of_an_fp16_model_are_dequantized_not_packed(tiny_model_dirs):
    """The CPU kernel multiplies fp32 / bf16 activations only: an fp16 model's int8 weights
    stay unpacked (dequantized per call), and it generates (it crashed every request)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts((12,))
    kw = dict(block_size=8, dtype="float16")
    fp16, _, _ = _generate(tiny_model_dirs["llama"], prompts, params, **kw)
    llm = LLM(tiny_model_dirs["llama"], quantization="int8", **kw)
    try:
        layer = llm.engine.runner.model.model.layers[0]
        assert layer.mlp.down_proj.packed is None and layer.mlp.down_proj.weight.dtype == torch.int8
        assert llm.engine.runner.fused is None
        out = llm.generate(prompts, params)[0].outputs[0]
    finally:
        llm.shutdown()
    assert len(out.token_ids) == 8 and len(fp16[0].token_ids) == 8
