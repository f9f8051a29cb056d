"""bf16 end to end: epd in bf16 stays close to transformers in bf16 on the same inputs.

Exact greedy parity cannot hold in bf16 (two implementations round differently), so the
check is vLLM's ``check_logprobs_close`` (tests/models/utils.py), made strict by teacher
forcing: transformers (bf16) scores epd's own greedy continuation, and at every position
where transformers' top-2 margin exceeds ``MARGIN`` (its choice is not a near tie) epd's
token is transformers' top-1 and the two log-probabilities of that token agree within
``LOGPROB_TOL``. The first position where the two top-1 tokens differ is reported.
The fp32 parity tests are unchanged (tests/engine/test_parity.py and the rest pin
``dtype="float32"``).
"""

from __future__ import annotations

import pytest
import torch

from epd.config import EngineConfig, auto_dtype

MARGIN = 0.5  # nats: a top-2 gap above this is not a bf16 rounding tie
LOGPROB_TOL = 0.25  # nats: bf16 logits of one token, two implementations
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is"]
NEW_TOKENS = 24


@pytest.mark.slow
def test_bf16_logprobs_close_to_transformers_bf16(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from epd import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tok(p).input_ids for p in PROMPTS]
    llm = LLM(default_model_dir, dtype="bfloat16", kv_cache_memory_gb=0.25)
    try:
        assert llm.engine.runner.k_cache.dtype == torch.bfloat16  # the KV cache follows the dtype
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16).eval()
    checked = 0
    for prompt, out in zip(prompts, outs):
        gen = list(out.outputs[0].token_ids)
        epd_lps = [lp.logprob for lp in out.outputs[0].logprobs]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + gen])).logits[0]
        hf = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]  # predicts gen[i]
        top2 = hf.topk(2, dim=-1)
        first_diff = next((i for i, t in enumerate(gen) if int(top2.indices[i, 0]) != t), None)
        for i, t in enumerate(gen):
            margin = float(top2.values[i, 0] - top2.values[i, 1])
            if margin <= MARGIN:
                continue
            checked += 1
            assert int(top2.indices[i, 0]) == t, (
                f"prompt {PROMPTS[prompts.index(prompt)]!r}: position {i} (first differing top-1: {first_diff}): "
                f"epd chose {t}, transformers bf16 {int(top2.indices[i, 0])} with a {margin:.2f} nat margin")
            assert abs(epd_lps[i] - float(hf[i, t])) < LOGPROB_TOL, (i, epd_lps[i], float(hf[i, t]))
    assert checked >= len(PROMPTS) * NEW_TOKENS // 2, f"only {checked} positions had a clear top-1"


def test_auto_dtype_picks_bf16_only_where_native(monkeypatch, tiny_model_dirs):
    """``dtype="auto"``: bf16 on a device that computes it natively, fp32 on a CPU that
    would emulate it; an explicit dtype wins."""
    import epd.config as config

    monkeypatch.setattr(config, "native_bf16", lambda device: True)
    assert auto_dtype("cpu") is torch.bfloat16
    assert auto_dtype("cuda", torch.float16) is torch.float16  # a GPU keeps an fp16 checkpoint
    assert EngineConfig(tiny_model_dirs["llama"]).torch_dtype is torch.bfloat16
    assert EngineConfig(tiny_model_dirs["llama"], dtype="float32").torch_dtype is torch.float32
    monkeypatch.setattr(config, "native_bf16", lambda device: False)
    assert auto_dtype("cpu") is torch.float32
    assert EngineConfig(tiny_model_dirs["llama"]).torch_dtype is torch.float32
    assert EngineConfig(tiny_model_dirs["llama"], dtype="bfloat16").torch_dtype is torch.bfloat16
    assert EngineConfig(tiny_model_dirs["llama"], dtype=torch.bfloat16).torch_dtype is torch.bfloat16  # as vLLM
