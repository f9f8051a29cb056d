"""eSpeak NG speech synthesis through its C API (``speak_lib.h``), driven with ctypes.

The library and its voice data come from the ``espeakng-loader`` wheel (eSpeak NG 1.52:
``libespeak-ng.so`` and ``espeak-ng-data``), so nothing is needed on the system. The
library has one global state: it is initialized once per process, in
``AUDIO_OUTPUT_SYNCHRONOUS`` mode with a synth callback, and every voice change and
synthesis runs under one process-wide lock (so phrases are spoken one at a time).

``espeak_Synth`` runs on a helper thread; its callback hands each buffer (~100 ms of
22050 Hz audio) through a queue to the caller's generator, which resamples it to
24000 Hz as it goes, so the first chunk comes out long before a long phrase is done.

Reproducibility: the noise generator is reseeded before each phrase
(``espeak_ng_SetRandSeed``), but eSpeak's wave generator keeps static state across
phrases (pitch flutter index, wave phase) that no API call resets, not even
``espeak_Terminate``. So a phrase's samples depend on what the process spoke before:
two processes give the same bytes only after the same sequence of (text, voice) since
start (aborted phrases included); otherwise they differ slightly (a few samples of length).
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from epd.tts import MAX_TEXT_CHARS, SAMPLE_RATE, Synthesizer, UnknownVoiceError, checked_text
from epd.tts.resample import StreamResampler

__all__ = ["MAX_TEXT_CHARS", "OPENAI_VOICES", "EspeakSynthesizer"]


#: OpenAI realtime voice -> eSpeak NG voice: an English language voice ("en" is British)
#: + a variant from espeak-ng-data/voices/!v (m* male, f* female timbres)
OPENAI_VOICES: dict[str, str] = {
    "alloy": "en-us+f3",
    "ash": "en-us+m3",
    "ballad": "en-gb-x-rp+m2",
    "coral": "en-us+f2",
    "echo": "en-us+m1",
    "sage": "en+f4",
    "shimmer": "en-us+f4",
    "verse": "en-us+m5",
    "marin": "en-us+f1",
    "cedar": "en-us+m7",
}

# speak_lib.h constants
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_ENDPAUSE = 0x1000
_EE_OK = 0
_BUFFER_MS = 100  # length of the buffers handed to the synth callback
_RAND_SEED = 1  # eSpeak's noise generator, reseeded before each phrase (else it differs run to run)

_SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
_RAW_VOICE = re.compile(r"([A-Za-z0-9_-]{1,40})(?:\+([A-Za-z0-9_-]{1,40}))?")

_LOCK = threading.Lock()  # eSpeak NG's global state: one voice change or synthesis at a time
_library: _Library | None = None


class _Library:
    """The process's eSpeak NG: loaded and initialized once; used only under ``_LOCK``."""

    def __init__(self) -> None:
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        lib.espeak_ng_SetRandSeed.restype = None
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                     ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        data = Path(espeakng_loader.get_data_path())
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, _BUFFER_MS, str(data.parent).encode(),
                                     _INITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({rate}) with the data in {data}")
        self.lib = lib
        self.sample_rate: int = rate  # 22050
        self.variants = frozenset(os.listdir(data / "voices" / "!v"))
        self._sink: Callable[[np.ndarray], bool] | None = None
        self._aborted = False
        self._callback = _SynthCallback(self._on_audio)  # kept alive: the library holds the pointer
        lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav, numsamples: int, events) -> int:
        if not wav or numsamples <= 0 or self._sink is None:  # NULL: end of synthesis
            return 0
        if self._sink(np.ctypeslib.as_array(wav, (numsamples,)).copy()):
            return 0
        self._aborted = True
        return 1  # abort the synthesis

    def set_voice(self, name: str) -> bool:
        return self.lib.espeak_SetVoiceByName(name.encode()) == _EE_OK

    def speak(self, text: str, voice: str, sink: Callable[[np.ndarray], bool]) -> None:
        """Synthesize ``text``, passing each ``[samples] int16`` buffer to ``sink`` (which
        returns False to abort). Call under ``_LOCK``."""
        if not self.set_voice(voice):
            raise UnknownVoiceError(f"eSpeak NG has no voice {voice!r}")
        data = text.encode("utf-8")
        self.lib.espeak_ng_SetRandSeed(_RAND_SEED)
        self._sink, self._aborted = sink, False
        try:
            err = self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8 | _ENDPAUSE,
                                        None, None)
        finally:
            self._sink = None
        if err != _EE_OK and not self._aborted:  # an aborted synthesis reports an error too
            raise RuntimeError(f"espeak_Synth failed with error {err}")


def _get_library() -> _Library:
    global _library
    with _LOCK:
        if _library is None:
            _library = _Library()
        return _library


class EspeakSynthesizer(Synthesizer):
    """eSpeak NG voices (the C API of speak_lib.h), speaking at the default rate.

    :meth:`synthesize` yields ``[samples] int16`` mono chunks at 24000 Hz, resampled from
    eSpeak's 22050 Hz. Voices: OpenAI's names (:data:`OPENAI_VOICES`, also :attr:`voices`),
    or a raw eSpeak NG voice of the bundled data, ``language`` or ``language+variant``
    (``"en-us"``, ``"en"`` (British), ``"fr"``, ``"en-us+f2"``). Instances share the process's one eSpeak NG
    library, so phrases are synthesized one at a time process-wide; :meth:`close` only
    retires the instance.
    """

    voices = tuple(OPENAI_VOICES)

    def __init__(self) -> None:
        import torchaudio

        self._lib = _get_library()
        self._resample = torchaudio.transforms.Resample(self._lib.sample_rate, SAMPLE_RATE)
        self._known: set[str] = set()  # eSpeak voice names found to load
        self._closed = False

    def espeak_voice(self, voice: str) -> str:
        """The eSpeak NG voice name that ``voice`` selects; raises :class:`UnknownVoiceError`."""
        name = OPENAI_VOICES.get(voice, voice)
        if name in self._known:
            return name
        m = _RAW_VOICE.fullmatch(name) if isinstance(name, str) else None
        if m and (m[2] is None or m[2] in self._lib.variants):
            with _LOCK:
                ok = self._lib.set_voice(m[1])
            if ok:
                self._known.add(name)
                return name
        raise UnknownVoiceError(
            f"unknown voice {voice!r}: use one of {', '.join(self.voices)}, or an eSpeak NG voice "
            "such as 'en-us', 'en' (British), 'fr' or 'en-us+f2' (language[+variant])"
        )

    def synthesize(self, text: str, voice: str) -> Iterator[np.ndarray]:
        """Speak ``text``: ``[samples] int16`` mono chunks at 24000 Hz, as eSpeak makes them.

        Raises :class:`UnknownVoiceError` (unknown ``voice``), ``ValueError`` (``text`` over
        :data:`MAX_TEXT_CHARS` characters), ``TypeError`` (``text`` not a str) and
        ``RuntimeError`` (closed) at the call. Empty or whitespace-only text yields nothing.
        """
        text = checked_text(text, self._closed)
        name = self.espeak_voice(voice)
        if not text.strip():
            return iter(())
        return self._stream(text, name)

    def _stream(self, text: str, voice: str) -> Iterator[np.ndarray]:
        chunks: queue.SimpleQueue = queue.SimpleQueue()  # int16 buffers, then an exception or None
        stop = threading.Event()

        def sink(pcm: np.ndarray) -> bool:
            if pcm.size:
                chunks.put(pcm)
            return not stop.is_set()

        def run() -> None:
            try:
                with _LOCK:
                    self._lib.speak(text, voice, sink)
            except BaseException as exc:  # re-raised in the consumer
                chunks.put(exc)
            chunks.put(None)

        thread = threading.Thread(target=run, name="espeak-synth", daemon=True)
        thread.start()
        resampler = StreamResampler(self._resample)
        try:
            while (item := chunks.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                out = resampler.push(item)
                if out.size:
                    yield out
            out = resampler.flush()
            if out.size:
                yield out
        finally:
            stop.set()  # an early close aborts the synthesis at its next buffer
            thread.join()

    def close(self) -> None:
        """Retire this instance (the process's eSpeak NG library stays loaded). Idempotent."""
        self._closed = True
