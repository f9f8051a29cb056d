"""A request resumed from its output so far samples as the uninterrupted one.

The router migrates a request whose decode worker died: the prompt plus the N
tokens streamed so far run again elsewhere, with ``num_prior_output_tokens=N``
and the remaining ``max_tokens``. The penalties must count those N tokens as
output, and a seeded generator must be where the uninterrupted run's was after
N draws, on every engine the resumed request runs on (the prefill worker's
one-token run, the decode worker's reservation, an aggregated engine).
"""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from epd import LLM, SamplingParams
from epd.layers.sampler import Sampler
from epd.sequence import Sequence

K = 24  # tokens of the uninterrupted run
CASES = {
    "greedy+frequency": dict(temperature=0.0, frequency_penalty=1.5),
    "greedy+presence": dict(temperature=0.0, presence_penalty=2.0),
    "seeded": dict(temperature=0.8, seed=1234),
    "seeded+penalties": dict(temperature=0.8, top_p=0.9, seed=7, frequency_penalty=1.0, presence_penalty=0.5),
}


def resumed(params: SamplingParams, n: int) -> SamplingParams:
    """``params`` of a request resumed after ``n`` output tokens (what the router sends)."""
    return msgspec.structs.replace(params, max_tokens=params.max_tokens - n, num_prior_output_tokens=n)


def test_penalties_count_prior_output_tokens_as_output():
    """Hand-built logits: a sequence whose last 3 prompt tokens are prior output is
    penalized exactly like the one that generated them."""
    logits = torch.zeros(2, 10)
    logits[:, 4] = 2.0
    logits[:, 5] = 1.9
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    grown = Sequence("a", [1, 2], params)
    grown.token_ids.extend([4, 4, 5])
    moved = Sequence("b", [1, 2, 4, 4, 5], resumed(params, 3))
    assert moved.all_output_token_ids == grown.all_output_token_ids == [4, 4, 5]
    assert moved.num_output_tokens == 0  # max_tokens counts only what this engine generates
    # 4: 2.0 - 2 x 1.0 = 0.0; 5: 1.9 - 1.0 = 0.9 (unpenalized, 4 would win)
    assert Sampler(0)(logits, [grown, moved]) == [5, 5]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    engine = LLM(tiny_model_dirs["llama"], block_size=8, dtype="float32")
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_request_continues_the_uninterrupted_stream(llm, case):
    prompt = [random.Random(3).randrange(3, 400) for _ in range(20)]
    params = SamplingParams(max_tokens=K, ignore_eos=True, **CASES[case])
    full = llm.generate([prompt], [params])[0].outputs[0].token_ids
    assert len(full) == K
    for n in (1, 5, K - 1):
        # An aggregated engine (or a decode worker recomputing) resumes the rest.
        rest = llm.generate([prompt + full[:n]], [resumed(params, n)])[0].outputs[0].token_ids
        assert rest == full[n:], (case, n)
        # The prefill worker's run of a migrated request: its one token is the next one.
        first = msgspec.structs.replace(resumed(params, n), max_tokens=1, stop_token_ids=[])
        assert llm.generate([prompt + full[:n]], [first])[0].outputs[0].token_ids == full[n:n + 1], (case, n)


def test_a_reservation_resumes_the_generator_after_prior_draws(llm):
    """The decode side: the reserved sequence's generator has made the prior draws;
    ``add_prefilled`` then skips the prefill worker's draw, as for a fresh request."""
    engine = llm.engine
    params = SamplingParams(temperature=0.8, seed=99, max_tokens=8)
    ref = Sequence("ref", [5, 6, 7], params)
    sampler = Sampler(0)
    logits = torch.zeros(1, engine.vocab_size)
    for _ in range(4):
        sampler(logits, [ref])
    blocks, _ = engine.add_remote_request("moved", [5, 6, 7, 8, 9, 10], resumed(params, 3))
    try:
        assert blocks is not None
        seq = engine.scheduler.waiting_for_remote_kv["moved"]
        assert seq.all_output_token_ids == [8, 9, 10] and seq.num_output_tokens == 0
        engine.add_prefilled("moved", 11)  # the prefill worker's draw (the 4th)
        assert torch.equal(seq.generator.get_state(), ref.generator.get_state())
    finally:
        engine.abort_request("moved")


def test_prior_output_tokens_must_leave_a_prompt(llm):
    from epd.errors import InvalidRequestError

    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        SamplingParams(num_prior_output_tokens=-1)
    with pytest.raises(InvalidRequestError, match="num_prior_output_tokens"):
        llm.engine.validate([1, 2, 3], SamplingParams(num_prior_output_tokens=3))
