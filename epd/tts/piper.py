"""Piper neural voices (https://github.com/OHF-Voice/piper1-gpl, the ``piper-tts`` wheel)
from a local directory: ``--tts-engine /models/en_US-lessac-medium``.

The directory holds one Piper voice, as Piper's own releases ship it: a VITS model
exported to ONNX (``NAME.onnx``) and its config (``NAME.onnx.json``: sample rate,
eSpeak NG phonemizer voice, phoneme id map, speakers). Nothing is downloaded: the wheel
bundles its eSpeak NG data, and the model is read from the directory only. Piper speaks a
sentence per ONNX run; each sentence's audio is resampled to 24 kHz as it comes.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterator

import numpy as np

from epd.tts import SAMPLE_RATE, Synthesizer, UnknownVoiceError, checked_text
from epd.tts.espeak import OPENAI_VOICES
from epd.tts.resample import StreamResampler


class PiperSynthesizer(Synthesizer):
    """A Piper voice read from ``voice_dir`` (one ``*.onnx`` and its ``*.onnx.json``).

    :meth:`synthesize` yields ``[samples] int16`` mono chunks at 24000 Hz, one or more per
    sentence, resampled from the voice's rate (``sample_rate`` of its config, e.g. 22050).
    Voices: OpenAI's names (``alloy``, ``ash``, ...; :attr:`voices`), as the realtime API
    takes them; on a voice with several speakers they pick its speakers in order (``alloy``
    = speaker 0, ``ash`` = 1, ..., modulo the number of speakers). Calls are
    serialized per instance (Piper's phonemizer is eSpeak NG's global state).

    Raises ``ValueError`` (from the constructor): the directory is missing, holds no
    ``.onnx`` or several, lacks the model's ``.onnx.json``, or the files do not load
    (the message names the file); ``ImportError``: the ``piper-tts`` package is absent.
    """

    def __init__(self, voice_dir: str) -> None:
        import torchaudio

        try:
            from piper import PiperVoice
        except ImportError as e:
            raise ImportError("a Piper voice needs the piper-tts package: pip install 'epd[piper]'") from e
        root = os.path.expanduser(voice_dir)
        if not os.path.isdir(root):
            raise ValueError(f"Piper voice directory {voice_dir!r} does not exist")
        models = sorted(glob.glob(os.path.join(glob.escape(root), "*.onnx")))
        if len(models) != 1:
            raise ValueError(f"{voice_dir!r} must hold exactly one Piper voice model (*.onnx); found "
                             f"{[os.path.basename(m) for m in models] or 'none'}")
        model = models[0]
        if not os.path.isfile(model + ".json"):
            raise ValueError(f"Piper voice {os.path.basename(model)!r} has no config "
                             f"{os.path.basename(model) + '.json'!r} beside it")
        try:
            self._voice = PiperVoice.load(model, model + ".json")
        except Exception as e:  # onnxruntime / json / the config's keys
            raise ValueError(f"Piper voice {model!r} did not load: {type(e).__name__}: {e}") from e
        cfg = self._voice.config
        self.num_speakers = max(1, int(cfg.num_speakers))
        self.voices = tuple(OPENAI_VOICES)
        self.source_rate = int(cfg.sample_rate)
        self._resample = torchaudio.transforms.Resample(self.source_rate, SAMPLE_RATE)
        self._lock = threading.Lock()
        self._closed = False

    def speaker_id(self, voice: str) -> int | None:
        """The speaker ``voice`` selects (None: a one-speaker voice); raises :class:`UnknownVoiceError`."""
        if voice not in OPENAI_VOICES:
            raise UnknownVoiceError(f"unknown voice {voice!r}: use one of {', '.join(self.voices)}")
        return None if self.num_speakers == 1 else self.voices.index(voice) % self.num_speakers

    def synthesize(self, text: str, voice: str) -> Iterator[np.ndarray]:
        """Speak ``text``: ``[samples] int16`` mono chunks at 24000 Hz, a sentence at a time.

        Raises :class:`UnknownVoiceError`, ``ValueError`` (over ``MAX_TEXT_CHARS``
        characters), ``TypeError`` (not a str) and ``RuntimeError`` (closed) at the call.
        Empty or whitespace-only text yields nothing.
        """
        text = checked_text(text, self._closed)
        speaker = self.speaker_id(voice)
        if not text.strip():
            return iter(())
        return self._stream(text, speaker)

    def _stream(self, text: str, speaker: int | None) -> Iterator[np.ndarray]:
        from piper import SynthesisConfig

        resampler = StreamResampler(self._resample)
        with self._lock:
            for chunk in self._voice.synthesize(text, SynthesisConfig(speaker_id=speaker)):
                out = resampler.push(np.asarray(chunk.audio_int16_array, dtype=np.int16).reshape(-1))
                if out.size:
                    yield out
        out = resampler.flush()
        if out.size:
            yield out

    def close(self) -> None:
        """Drop the model; :meth:`synthesize` raises ``RuntimeError`` afterwards. Idempotent."""
        self._closed = True
        self._voice = None
