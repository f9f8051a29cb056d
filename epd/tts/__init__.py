"""Text-to-speech engines: text in, streamed PCM16 mono at 24 kHz out.

A :class:`Synthesizer` speaks one phrase at a time and yields its audio in chunks as
the engine produces them, at the rate of OpenAI realtime's ``pcm16`` format (24000 Hz),
whatever the engine's own rate. :func:`load_synthesizer` picks the engine; eSpeak NG
(:mod:`epd.tts.espeak`, embedded through the ``espeakng-loader`` wheel) is the default.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is the synthesizers' (kept out of `epd`'s start: `epd launch` checks ENGINES)
    import numpy as np

__all__ = ["ENGINES", "SAMPLE_RATE", "Synthesizer", "UnknownVoiceError", "check_engine", "load_synthesizer"]

#: Hz of every synthesizer's output (OpenAI realtime's pcm16: 24 kHz, mono, int16)
SAMPLE_RATE = 24000

ENGINES = ("espeak",)
#: characters per phrase; longer text raises ValueError
MAX_TEXT_CHARS = 4096
# C0 controls other than tab/newline/CR, and DEL: eSpeak (also Piper's phonemizer) reads \x01
# as an embedded command
CONTROLS = {c: " " for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F]}


def checked_text(text: str, closed: bool) -> str:
    """``text`` as a synthesizer speaks it (control characters as spaces), after the checks
    every ``Synthesizer.synthesize`` makes at the call: raises ``RuntimeError`` (``closed``),
    ``TypeError`` (not a str), ``ValueError`` (over :data:`MAX_TEXT_CHARS` characters)."""
    if closed:
        raise RuntimeError("the synthesizer is closed")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"text has {len(text)} characters; at most {MAX_TEXT_CHARS} per phrase")
    return text.translate(CONTROLS)


class UnknownVoiceError(ValueError):
    """A voice name the synthesizer does not have; the message lists the valid names."""


class Synthesizer(ABC):
    """One TTS engine instance. Safe to call from several threads (an engine may serialize
    the calls: eSpeak NG speaks one phrase at a time per process)."""

    #: Hz of the chunks :meth:`synthesize` yields
    sample_rate: int = SAMPLE_RATE
    #: the voice names :meth:`synthesize` accepts (an engine may accept more, see its docs)
    voices: tuple[str, ...] = ()

    @abstractmethod
    def synthesize(self, text: str, voice: str) -> Iterator[np.ndarray]:
        """Speak ``text`` with ``voice``: an iterator of ``[samples] int16`` mono chunks at
        :attr:`sample_rate` (24000 Hz), yielded as they are produced.

        Nothing is yielded for empty or whitespace-only text. The voice and the text are
        checked at the call, before any audio: raises :class:`UnknownVoiceError` for a voice
        the engine lacks, ``ValueError`` for text over the engine's length cap,
        ``RuntimeError`` once :meth:`close` was called. Closing the iterator early (``close()``,
        or dropping it) stops the synthesis.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the engine; :meth:`synthesize` raises ``RuntimeError`` afterwards. Idempotent."""

    def __enter__(self) -> Synthesizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_engine(spec: str) -> str:
    """``spec`` if it names a synthesizer :func:`load_synthesizer` can build: one of
    :data:`ENGINES`, or a directory (a Piper voice). Checks the name only, loads nothing;
    raises ``ValueError`` naming what is accepted."""
    if spec.strip().lower() in ENGINES or os.path.isdir(os.path.expanduser(spec)):
        return spec
    raise ValueError(f"unknown TTS engine {spec!r}: use one of {', '.join(repr(e) for e in ENGINES)}, "
                     f"or the directory of a Piper voice (NAME.onnx + NAME.onnx.json)")


def load_synthesizer(spec: str = "espeak") -> Synthesizer:
    """The synthesizer named by ``spec``: ``"espeak"`` (eSpeak NG, embedded, the default),
    or a local directory holding a Piper voice (``epd.tts.piper.PiperSynthesizer``).

    Raises ``ValueError``: an unknown name (naming the engines), or a directory that is
    not a loadable Piper voice; ``ImportError``: a Piper voice without ``piper-tts``.
    """
    check_engine(spec)
    if spec.strip().lower() == "espeak":
        from epd.tts.espeak import EspeakSynthesizer

        return EspeakSynthesizer()
    from epd.tts.piper import PiperSynthesizer

    return PiperSynthesizer(spec)
