"""Greedy parity with transformers ``generate``: the engine's central correctness proof."""

from __future__ import annotations

import random

import pytest

from epd import LLM, SamplingParams
from tests.conftest import TINY_KINDS, hf_greedy

MAX_TOKENS = 20
# Mixed lengths: a 1-token prompt, prompts shorter and longer than a block and
# than the step budget (32), one spanning many chunks.
PROMPT_LENS = [1, 3, 17, 33, 64, 100, 5, 250, 40]


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_parity_chunked_prefill_and_prefix_cache(kind, tiny_model_dirs):
    model_dir = tiny_model_dirs[kind]
    prompts = _prompts()
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    # A 32-token step budget forces every prompt over 32 tokens into chunks
    # that share steps with other sequences' decodes.
    llm = LLM(model_dir, block_size=8, max_num_batched_tokens=32, max_num_seqs=8, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens == 0 for o in outs)

    # Repeat the longest prompt, and a prompt that shares only its first 120 tokens:
    # the prefix cache serves the shared full blocks, and tokens stay identical.
    long = prompts[7]
    branch = long[:120] + [7, 8, 9, 10, 11]
    expected_branch = hf_greedy(model_dir, [branch], MAX_TOKENS)[0]
    again, other = llm.generate([long, branch], params)
    assert again.outputs[0].token_ids == expected[7]
    assert again.num_cached_tokens == (len(long) - 1) // 8 * 8
    assert other.outputs[0].token_ids == expected_branch
    assert other.num_cached_tokens == 120
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    llm.shutdown()


@pytest.mark.slow
def test_smollm2_parity_batch(default_model_dir):
    """The real default model, 8 chat prompts submitted together, chunked prefill."""
    llm = LLM(default_model_dir, max_num_batched_tokens=64, dtype="float32")
    tok = llm.get_tokenizer()
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?",
                 "Write a haiku about the sea.", "Who wrote Hamlet?", "Explain gravity in one sentence.",
                 "List the days of the week.", "What is the boiling point of water in Celsius?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in questions]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    expected = hf_greedy(default_model_dir, prompts, 24)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[0].outputs[0].text
    # The system prompt is shared: a repeat hits the prefix cache and still matches.
    again = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24))[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == expected[0]
    llm.shutdown()
