"""Piper voices from a local directory (``--tts-engine DIR``), on a voice built in the
test run (tests/tts/fake_piper_voice.py: Piper's ONNX interface around a tone)."""

from __future__ import annotations

import numpy as np
import pytest

from epd.tts import SAMPLE_RATE, UnknownVoiceError, check_engine, load_synthesizer
from tests.tts import fake_piper_voice as fake

TEXT = "Hello there. How are you today?"


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return fake.build(tmp_path_factory.mktemp("piper") / "voice", speakers=2)


def dominant_hz(pcm: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64)))
    return float(np.argmax(spectrum) * SAMPLE_RATE / len(pcm))


def test_a_piper_voice_speaks_each_sentence_at_24khz_with_its_speakers(voice_dir):
    from piper import PiperVoice

    synth = load_synthesizer(str(voice_dir))
    chunks = list(synth.synthesize(TEXT, "alloy"))
    pcm = np.concatenate(chunks)
    assert pcm.dtype == np.int16 and len(chunks) >= 2  # a sentence at a time, not the whole at the end
    # what Piper's phonemizer made of the text reached the model: HOP samples per phoneme id
    ref = PiperVoice.load(next(voice_dir.glob("*.onnx")))
    ids = sum(len(ref.phonemes_to_ids(p)) for p in ref.phonemize(TEXT) if p)
    assert abs(len(pcm) - ids * fake.HOP * SAMPLE_RATE / fake.SAMPLE_RATE) <= 2
    assert abs(dominant_hz(pcm) - fake.BASE_HZ) < 3  # alloy: speaker 0
    other = np.concatenate(list(synth.synthesize(TEXT, "ash")))  # OpenAI's 2nd name: speaker 1
    assert abs(dominant_hz(other) - (fake.BASE_HZ + 100)) < 3
    third = np.concatenate(list(synth.synthesize(TEXT, "ballad")))  # 3rd: speaker 2 % 2 = 0
    assert abs(dominant_hz(third) - fake.BASE_HZ) < 3
    assert synth.voices[:2] == ("alloy", "ash")
    assert list(synth.synthesize("  \n ", "alloy")) == []
    with pytest.raises(UnknownVoiceError, match="alloy, ash"):
        synth.synthesize(TEXT, "nobody")
    synth.close()
    with pytest.raises(RuntimeError, match="closed"):
        synth.synthesize(TEXT, "alloy")


def test_bad_voice_directories_say_what_is_wrong(tmp_path, voice_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="exactly one Piper voice model.*none"):
        load_synthesizer(str(empty))
    two = fake.build(tmp_path / "two")
    fake.build(two, name="other")
    with pytest.raises(ValueError, match="exactly one.*en_US-test-tone.onnx"):
        load_synthesizer(str(two))
    no_config = fake.build(tmp_path / "noconf")
    next(no_config.glob("*.json")).unlink()
    with pytest.raises(ValueError, match="has no config 'en_US-test-tone.onnx.json'"):
        load_synthesizer(str(no_config))
    corrupt = fake.build(tmp_path / "corrupt")
    next(corrupt.glob("*.onnx")).write_bytes(b"not a model")
    with pytest.raises(ValueError, match="did not load"):
        load_synthesizer(str(corrupt))
    assert check_engine(str(voice_dir)) == str(voice_dir)
    with pytest.raises(ValueError, match="directory of a Piper voice"):
        check_engine(str(tmp_path / "missing"))
