"""Speculative decoding with n-gram proposals (epd.engine.spec_decode): greedy output with
speculation equals greedy output without it, token for token (fp32, tiny random models),
on the fused CPU decode and the eager path, with chunked prefill, prefix hits, stops inside
an accepted run and preemption; the proposer, the acceptance rule and the config."""

from __future__ import annotations

import random

import numpy as np
import pytest

from epd import LLM, SamplingParams
from epd.config import ConfigError
from epd.engine.spec_decode import NgramProposer, SpeculativeConfig, accept
from tests.conftest import TINY_KINDS, hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MAX_TOKENS = 40


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span (what n-gram lookup finds), and plain random ones."""
    rng = random.Random(seed)
    out = []
    for n in (6, 12, 20, 30):
        span = [rng.randrange(3, 400) for _ in range(n)]
        out.append([rng.randrange(3, 400) for _ in range(5)] + span * 3)
    out += [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 50)]
    return out


class _Oracle:
    """A proposer that drafts each prompt's known continuation, the draft at every 7th position wrong."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], wrong_every: int = 7) -> None:
        self.cases, self.wrong_every = list(zip(prompts, outputs)), wrong_every

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        toks = tokens.tolist()
        for prompt, out in self.cases:
            if toks[:len(prompt)] == prompt and toks[len(prompt):] == out[:len(toks) - len(prompt)]:
                drafts = out[len(toks) - len(prompt):][:k]
                w = self.wrong_every
                return [t + 1 if w and (len(toks) + i) % w == 0 else t for i, t in enumerate(drafts)]
        return []


def test_ngram_proposer_takes_the_longest_most_recent_match():
    p = NgramProposer(2, 3)
    toks = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert p.propose(toks, 2) == [7, 5]  # "1 2 3" recurs: what followed its latest earlier occurrence
    assert p.propose(np.array([4, 5, 6, 4, 5]), 3) == [6, 4, 5]  # n = 2
    assert p.propose(np.array([1, 2, 3, 4]), 3) == []  # nothing recurs
    assert p.propose(toks, 0) == []
    assert NgramProposer(1, 1).propose(np.array([8, 8]), 4) == [8]  # what follows is all there is


def test_acceptance_keeps_drafts_until_the_first_mismatch_then_the_targets_token():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the bonus token
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the target's token at the first mismatch
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept([], [3]) == [3]


def test_speculative_config_is_vllms_and_refuses_what_it_cannot_run():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}) == \
        SpeculativeConfig("ngram", 2, 4, 4)
    assert SpeculativeConfig.parse(None) is None
    for bad, match in (({"method": "eagle3", "num_speculative_tokens": 2}, "not supported"),
                       ({"method": "ngram"}, "num_speculative_tokens is required"),
                       ({"method": "ngram", "num_speculative_tokens": "4"}, "integers"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "<= prompt_lookup_max"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown keys"),
                       ("{not json", "JSON object")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)


def test_engine_refuses_a_bad_speculative_config(tiny_model_dirs):
    with pytest.raises(ConfigError, match="not supported"):
        LLM(tiny_model_dirs["llama"], dtype="float32", speculative_config={"method": "mtp",
                                                                            "num_speculative_tokens": 1})


@pytest.mark.parametrize("eager", [False, True], ids=["fused", "eager"])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_greedy_output_with_speculation_equals_without(kind, eager, tiny_model_dirs):
    model_dir = tiny_model_dirs[kind]
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # the engine without speculation (its greedy tokens equal transformers': test_parity.py, checked
    # again here up to each prompt's first EOS, where transformers stops)
    plain = LLM(model_dir, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, dtype="float32")
    try:
        expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params)]
    finally:
        plain.shutdown()
    for want, hf in zip(expected, hf_greedy(model_dir, prompts, MAX_TOKENS)):
        assert want[:len(hf)] == hf
    # a 32-token step budget: prompts are chunked beside speculating decodes
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, dtype="float32",
              enforce_eager=eager, speculative_config=SPEC)
    try:
        outs = llm.generate(prompts, params)  # n-gram drafts (random weights: few, if any, are right)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        # drafts that are mostly right, one position in 7 wrong: runs of accepted drafts, bonus
        # tokens and corrections, across block boundaries (4-token blocks, 4 drafts)
        llm.engine.spec.proposer = _Oracle(prompts, expected)
        outs = llm.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        stats = llm.engine.stats()
        assert stats["spec_num_accepted_tokens"] > 0  # drafts were accepted ...
        assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]  # ... and rejected
        assert stats["spec_num_accepted_tokens_pos3"] > 0  # whole runs of 4 (the bonus token after them)
        assert stats["num_free_blocks"] == stats["num_blocks"]
        # the prefix cache holds only real prefixes: the same prompt again hits exactly as without speculation
        again = llm.generate([prompts[3]], params)[0]
        assert list(again.outputs[0].token_ids) == expected[3]
        assert again.num_cached_tokens == (len(prompts[3]) - 1) // 4 * 4
    finally:
        llm.shutdown()


def test_a_stop_inside_an_accepted_run_ends_the_output_there(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompt = _prompts()[2]
    plain = LLM(model_dir, block_size=4, dtype="float32")
    spec = LLM(model_dir, block_size=4, dtype="float32", speculative_config=SPEC)
    try:
        full = list(plain.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                            ignore_eos=True))[0].outputs[0].token_ids)
        # a token first seen inside a run of 5 (the prefill's token, then 4 drafts + a bonus per step)
        stop_at = next(full[i] for i in range(6, MAX_TOKENS) if (i - 1) % 5 in (1, 2, 3) and full[i] not in full[:i])
        spec.engine.spec.proposer = _Oracle([prompt], [full], wrong_every=0)  # every draft right: runs of 5
        for params in (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      stop_token_ids=[stop_at]),
                       SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)):
            want = plain.generate([prompt], params)[0].outputs[0]
            got = spec.generate([prompt], params)[0].outputs[0]
            assert list(got.token_ids) == list(want.token_ids)
            assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
        assert spec.engine.stats()["spec_num_accepted_tokens_pos3"] > 0
    finally:
        plain.shutdown()
        spec.shutdown()


def test_preemption_and_sampled_requests_beside_speculation(tiny_model_dirs):
    """A KV cache too small for every sequence (preemption by recompute), greedy requests
    speculating beside seeded sampled ones (which do not): each output equals its run
    without speculation."""
    model_dir = tiny_model_dirs["llama"]
    prompts = _prompts()[:4]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)] * 2
    outs = {}
    for name, cfg in (("plain", None), ("spec", SPEC)):
        llm = LLM(model_dir, block_size=4, num_kv_blocks=40, max_num_seqs=4, dtype="float32",
                  speculative_config=cfg)
        try:
            outs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            stats = llm.engine.stats()
            assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
        finally:
            llm.shutdown()
    assert outs["spec"] == outs["plain"]
