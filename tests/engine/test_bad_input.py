"""Bad requests fail with a clear, typed error; the engine keeps serving the others."""

from __future__ import annotations

import pytest

from epd import LLM, SamplingParams
from epd.errors import InvalidRequestError
from epd.models.checkpoints import ModelNotFoundError


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    engine = LLM(tiny_model_dirs["llama"], block_size=8, max_model_len=128, dtype="float32")
    yield engine
    engine.shutdown()


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="empty") as e:
        llm.generate([[]], SamplingParams(max_tokens=4))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4))


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(InvalidRequestError, match=r"200 tokens.*max_model_len is 128"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=4))


def test_out_of_vocab_token(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[5, 10**9]], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_not_positive(max_tokens):
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=max_tokens)


def test_unknown_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(str(missing), dtype="float32")


def test_bad_requests_do_not_disturb_running_ones(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([[11, 12, 13, 14]], params)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("good", [11, 12, 13, 14], params)
    engine.step()  # the good request is now running with blocks allocated
    for bad in ([], [1] * 500, [-1]):
        with pytest.raises(InvalidRequestError):
            engine.add_request(f"bad-{len(bad)}", bad, params)
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request("good", [1, 2], params)
    # A batch with one invalid prompt queues nothing.
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], []], params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.request_id == "good"
    assert final.outputs[0].token_ids == expected
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_abort_frees_blocks(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params)
    engine.add_request("b", list(range(3, 20)), params)
    for _ in range(3):
        engine.step()
    assert engine.stats()["num_free_blocks"] < engine.stats()["num_blocks"]
    engine.abort_request("a")
    engine.abort_request("b")
    engine.abort_request("unknown")  # ignored
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
