"""Server VAD for ``/v1/realtime``: OpenAI's ``turn_detection: {"type": "server_vad"}``.

Silero VAD (the ``silero-vad`` PyPI package, which ships its model) scores each 32 ms
window of 16 kHz audio with a speech probability. A turn starts at the first window
over ``threshold`` (``speech_started``, its ``audio_start_ms`` moved back by
``prefix_padding_ms``) and ends once ``silence_duration_ms`` of windows under it follow
(``speech_stopped``, ``audio_end_ms`` where the speech ended). Times are milliseconds of
the session's input audio since it began. The session (``epd.api.realtime.session``) commits the
turn's audio, answers it, and cancels an answer that speech interrupts.

Source: OpenAI Realtime API reference (``session.audio.input.turn_detection``,
``input_audio_buffer.speech_started`` / ``speech_stopped``); Silero VAD
(github.com/snakers4/silero-vad, ``VADIterator``'s start/end logic).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

#: the VAD's sample rate and window (Silero's 16 kHz window: 512 samples, 32 ms)
VAD_RATE = 16000
WINDOW = 512
WINDOW_MS = WINDOW * 1000 // VAD_RATE

_load_lock = threading.Lock()


@dataclass(slots=True)
class ServerVad:
    """A session's ``turn_detection`` of type ``server_vad`` (OpenAI's fields and defaults).

    ``threshold``: speech probability a window must exceed, in (0, 1);
    ``prefix_padding_ms``: audio kept before the detected onset; ``silence_duration_ms``:
    silence that ends a turn; ``idle_timeout_ms``: after a response, silence this long
    (None: never) triggers ``input_audio_buffer.timeout_triggered`` and a response;
    ``create_response``: answer each turn; ``interrupt_response``: speech cancels the
    answer in flight.
    """

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    idle_timeout_ms: int | None = None
    create_response: bool = True
    interrupt_response: bool = True

    def to_json(self) -> dict:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "idle_timeout_ms": self.idle_timeout_ms,
                "create_response": self.create_response, "interrupt_response": self.interrupt_response}


def load_vad_model():
    """A fresh Silero VAD model (TorchScript, from the installed package's data; it holds
    the stream's state, so each session has its own). Importing ``silero_vad`` sets
    torch's thread count to 1; the API process's setting is put back."""
    import torch

    with _load_lock:
        threads = torch.get_num_threads()
        try:
            from silero_vad import load_silero_vad

            return load_silero_vad()
        finally:
            torch.set_num_threads(threads)


#: silence inside a turn after which its transcription starts early (at most silence_duration_ms)
PAUSE_MS = 160


class SpeechDetector:
    """One session's streaming turn detector.

    ``feed(pcm)`` takes the next input audio (float32 in [-1, 1], mono, at ``VAD_RATE``)
    and returns the turn edges it completes: ``("speech_started", audio_start_ms)``,
    ``("speech_paused", speech_end_ms)`` (once per pause: ``pause_ms`` of silence inside a
    turn, which may yet go on; the session starts transcribing the turn so far) and
    ``("speech_stopped", audio_end_ms)`` (after ``silence_duration_ms``; the end is the
    same as the pause's when no speech came between). Times are ms on the session's
    input-audio clock, which starts at ``start_ms`` for this detector. Not thread-safe: a
    session feeds it one chunk at a time (in the API's CPU pool).
    """

    def __init__(self, settings: ServerVad, model=None, start_ms: int = 0) -> None:
        self.settings = settings
        self.model = model if model is not None else load_vad_model()
        self._pending = np.zeros(0, dtype=np.float32)  # less than a window, not yet scored
        self.ms = start_ms  # input audio scored so far, on the session's clock
        self.in_speech = False
        self._speech_end_ms = 0  # end of the last window over the threshold
        self._paused = False  # the pause since _speech_end_ms was reported
        self.pause_ms = min(PAUSE_MS, settings.silence_duration_ms)

    def feed(self, pcm: np.ndarray) -> list[tuple[str, int]]:
        import torch

        s = self.settings
        audio = np.concatenate([self._pending, pcm.astype(np.float32, copy=False)])
        n = len(audio) // WINDOW * WINDOW
        self._pending = audio[n:]
        events: list[tuple[str, int]] = []
        with torch.inference_mode():
            for i in range(0, n, WINDOW):
                p = float(self.model(torch.from_numpy(audio[i:i + WINDOW]), VAD_RATE))
                start, self.ms = self.ms, self.ms + WINDOW_MS
                if p > s.threshold:
                    if not self.in_speech:
                        self.in_speech = True
                        events.append(("speech_started", max(0, start - s.prefix_padding_ms)))
                    self._speech_end_ms, self._paused = self.ms, False
                elif self.in_speech and self.ms - self._speech_end_ms >= s.silence_duration_ms:
                    self.in_speech = False
                    events.append(("speech_stopped", self._speech_end_ms))
                elif self.in_speech and not self._paused and self.ms - self._speech_end_ms >= self.pause_ms:
                    self._paused = True
                    events.append(("speech_paused", self._speech_end_ms))
        return events

    def reset(self) -> None:
        """Forget the turn in progress (``input_audio_buffer.clear`` / a manual commit);
        the timeline goes on."""
        self.model.reset_states()
        self.in_speech = self._paused = False
