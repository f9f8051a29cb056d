"""Text-to-speech worker (the ``t`` pool): one phrase of an answer in, PCM16 chunks out.

The realtime API cuts a streaming answer into phrases (``epd.api.realtime.segmenter``) and sends
each as a ``SynthesizeRequest``; this worker speaks it with its synthesizer
(``epd.tts.load_synthesizer``: eSpeak NG by default) and streams ``AudioChunk``\\ s of
at most ``CHUNK_BYTES`` back as they are produced, the last one ``final``. Phrases
are spoken one at a time in arrival order, one chunk per loop turn, so an ``Abort``
(barge-in) stops a phrase between two chunks and commands stay responsive. A worker
like the others: heartbeats, drain, restart, metrics (``epd_tts_*``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from epd.messages import AudioChunk, Message, SynthesizeRequest
from epd.roles import Role
from epd.workers.base import BaseWorker

logger = logging.getLogger(__name__)

#: PCM bytes per AudioChunk: ~0.33 s at 24 kHz, so the first audio leaves early
CHUNK_BYTES = 16 * 2**10


@dataclass(slots=True)
class _Phrase:
    """The phrase being spoken: its request, the synthesizer's chunk iterator, timings."""

    req: SynthesizeRequest
    chunks: Iterator[np.ndarray]
    received: float  # monotonic, when the request arrived
    started: float  # monotonic, when synthesis began
    pending: deque[bytes] = field(default_factory=deque)  # PCM of the last chunk not sent yet
    samples: int = 0
    first_sent: bool = False


class TTSWorker(BaseWorker):
    """SynthesizeRequest -> AudioChunk stream. No KV, no NIXL regions."""

    role = Role.TTS

    def __init__(self, args) -> None:
        super().__init__(args)
        from epd.tts import load_synthesizer

        self.synth = load_synthesizer(args.engine_kwargs.get("tts_engine") or "espeak")
        self.queue: deque[tuple[SynthesizeRequest, float]] = deque()  # (request, arrival)
        self.current: _Phrase | None = None
        self.num_phrases = 0
        self.announce([])

    def _model_fingerprint(self) -> str:
        return ""  # speaks text: any LM's router may use it

    def handle_role(self, msg: Message) -> None:
        if not isinstance(msg, SynthesizeRequest):
            return super().handle_role(msg)
        self.queue.append((msg, time.monotonic()))

    def has_work(self) -> bool:
        return bool(self.queue) or self.current is not None

    def step(self) -> None:
        """Send the next chunk of the phrase being spoken (starting the next phrase first)."""
        if self.current is None:
            req, arrival = self.queue.popleft()
            now = time.monotonic()
            self.observe("tts_queue", now - arrival)
            try:
                self.current = _Phrase(req, iter(self.synth.synthesize(req.text, req.voice)), arrival, now)
            except Exception as e:  # an unknown voice, text too long: the request's fault
                self.fail(req.request_id, e, prefix="speech synthesis failed: ")
                return
        ph = self.current
        if not ph.pending:
            try:
                pcm = next(ph.chunks)
            except StopIteration:
                self._finish(ph)
                return
            except Exception as e:
                self.current = None
                self.fail(ph.req.request_id, e, prefix="speech synthesis failed: ")
                return
            data = np.ascontiguousarray(pcm, dtype="<i2").tobytes()
            ph.samples += len(data) // 2
            ph.pending.extend(data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES))
            if not ph.pending:
                return
        self.send(AudioChunk(ph.req.request_id, self.instance_id, ph.pending.popleft(), self.synth.sample_rate,
                             synth_s=time.monotonic() - ph.started))
        if not ph.first_sent:
            ph.first_sent = True
            self.observe("tts_first_audio", time.monotonic() - ph.received)

    def _finish(self, ph: _Phrase) -> None:
        self.current = None
        synth_s = time.monotonic() - ph.started
        self.send(AudioChunk(ph.req.request_id, self.instance_id, b"", self.synth.sample_rate, final=True,
                             synth_s=synth_s))
        self.num_phrases += 1
        self.observe("tts_synthesis", synth_s)
        self.count("tts_phrases")
        self.count("tts_characters", len(ph.req.text))
        self.count("tts_audio_seconds", ph.samples / self.synth.sample_rate)

    def abort(self, request_id: str) -> None:
        """Drop the phrase ``request_id``, queued or half spoken."""
        self.queue = deque(q for q in self.queue if q[0].request_id != request_id)
        if self.current is not None and self.current.req.request_id == request_id:
            close = getattr(self.current.chunks, "close", None)
            if close is not None:
                close()
            self.current = None

    def in_flight(self) -> set[str]:
        ids = {req.request_id for req, _ in self.queue}
        if self.current is not None:
            ids.add(self.current.req.request_id)
        return ids

    def stats(self) -> dict[str, float]:
        return {"num_running": float(self.current is not None), "num_waiting": float(len(self.queue)),
                "num_phrases": float(self.num_phrases)}

    def update_metrics(self, stats: dict[str, float]) -> None:
        self.metrics.queue_depth.labels(**self.labels).set(stats.get("num_waiting", 0))
        self.metrics.running_requests.labels(**self.labels).set(stats.get("num_running", 0))

    def close(self) -> None:
        try:
            self.synth.close()
        finally:
            super().close()
