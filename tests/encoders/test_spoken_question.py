"""The default text-only LM answers a spoken question through the speech front end."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd import LLM, SamplingParams
from epd.encoders.processor import AUDIO_PLACEHOLDER
from epd.errors import InvalidRequestError

SPEECH = Path(__file__).parents[1] / "data" / "speech"


@pytest.mark.slow
def test_smollm2_answers_spoken_question(default_model_dir):
    llm = LLM(default_model_dir, dtype="float32")
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": AUDIO_PLACEHOLDER}], add_generation_prompt=True,
                                     tokenize=False)
    wav = (SPEECH / "capital_of_france.wav").read_bytes()  # encoded bytes, decoded under limits
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": [wav]}},
                       SamplingParams(temperature=0, max_tokens=24))[0]
    assert "What is the capital of France?" in out.prompt  # the transcript replaced the placeholder
    assert "Paris" in out.outputs[0].text
    # The same clip again: one transcription, served from the encoder cache.
    llm.generate({"prompt": prompt, "multi_modal_data": {"audio": [wav]}}, SamplingParams(max_tokens=2))
    assert (llm.encoder.cache.hits, llm.encoder.cache.misses) == (1, 1)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate({"prompt": "no marker", "multi_modal_data": {"audio": [wav]}}, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="does not accept images"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": [b"\x89PNG"]}}, SamplingParams(max_tokens=2))
    llm.shutdown()
