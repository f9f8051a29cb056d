"""``/v1/realtime`` transcription: each committed audio part is transcribed in the E pool
for text-only models (``Transcriber``), early from a turn's pause under server VAD.
The protocol is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import itertools

from epd.api.cpu_pool import CpuPool, shared_pool
from epd.api.realtime.conversation import Item, Part
from epd.api.realtime.protocol import new_id, pcm_array
from epd.router.router import RequestError

#: how long a transcription waits for an encode pool that is down (503) to come back
ASR_RETRY_S = 10.0


class Transcriber:
    """Text-only models: each committed audio part is transcribed in the E pool as
    soon as it arrives; ``emit`` sends the ``...input_audio_transcription.*`` events;
    ``cpu``: the pool that decodes and resamples the clips (default: ``shared_pool()``).

    Early transcription (server VAD): ``start_early`` transcribes a turn's audio up to a
    pause while the turn may still go on; when the turn then ends at that pause (no
    speech since), its commit takes that transcript instead of starting again, so the
    transcript is ready about when the silence that ends the turn is over.
    """

    def __init__(self, api, emit, cpu: CpuPool | None = None) -> None:
        self.api, self.emit, self.cpu = api, emit, cpu or shared_pool()
        self.tasks: set[asyncio.Task] = set()
        self.early: tuple[int, asyncio.Task] | None = None  # (speech end ms, transcription of the turn so far)

    @property
    def transcribes(self) -> bool:
        return self.api.processor.modalities.get("audio") == "transcribe"

    def start_early(self, data: bytes, rate: int, speech_end_ms: int) -> None:
        """Transcribe ``data`` (PCM16 at ``rate``: a turn up to ``speech_end_ms``) now; an
        earlier early transcription is dropped."""
        self.drop_early()
        if self.transcribes and data:
            task = asyncio.create_task(self._recognize(pcm_array(data), rate))
            task.add_done_callback(_quiet)
            self.early = (speech_end_ms, task)

    def drop_early(self) -> None:
        if self.early is not None:
            self.early[1].cancel()
            self.early = None

    def start(self, item: Item, early_ms: int | None = None) -> None:
        """Transcribe each audio part of ``item``, starting now, or (a committed turn
        that ended at ``early_ms``) from its early transcription."""
        early, self.early = self.early, None
        if early is not None and (early_ms is None or early[0] != early_ms):
            early[1].cancel()  # speech went on after that pause: stale
            early = None
        if not self.transcribes:
            return
        for idx, part in enumerate(item.parts):
            if part.type == "input_audio":
                self._task(item, idx, part, early[1] if early is not None else None)
                early = None

    def retry_failed(self, items: list[Item]) -> None:
        """A clip whose transcription failed (a pool down, a timeout) is tried again by the next response."""
        for item in items:
            for idx, part in enumerate(item.parts):
                if part.asr is not None and part.asr.done() and (part.asr.cancelled() or part.asr.exception()):
                    self._task(item, idx, part)

    def cancel_all(self) -> None:
        self.drop_early()
        for t in list(self.tasks):
            t.cancel()

    def _task(self, item: Item, idx: int, part: Part, early: asyncio.Task | None = None) -> None:
        part.asr = asyncio.create_task(self._transcribe(item, idx, part, early))
        self.tasks.add(part.asr)
        part.asr.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # reported as a transcription.failed event; a response awaiting it fails

    async def _recognize(self, pcm, rate: int) -> str:
        """The transcript of one clip (int16 ``[samples]`` at ``rate``) from the E pool. A
        pool that is down (503: e.g. its worker missed heartbeats on a busy machine) is
        retried for ``ASR_RETRY_S``."""
        rid = new_id("asr")  # the server's own: a client's item id is the client's, not unique across sessions
        media = await self.cpu.run(self.api.processor.audio_item, (pcm, rate))
        deadline = asyncio.get_running_loop().time() + ASR_RETRY_S
        for attempt in itertools.count():
            try:
                (text,) = await self.api.router.transcribe(f"{rid}.{attempt}", [media])
                return text
            except RequestError as e:
                if e.status != 503 or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.25)
        raise AssertionError("unreachable")

    async def _transcribe(self, item: Item, idx: int, part: Part, early: asyncio.Task | None = None) -> str:
        """The part's transcript (the early one's when given and it succeeded), then the
        ``.delta`` (the whole text, as OpenAI's whisper-1 sends it) and ``.completed``
        events; ``.failed`` when it cannot be had."""
        try:
            text = None
            if early is not None:
                try:
                    text = await early
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise
                except Exception:  # tried again below, on the whole clip
                    text = None
            if text is None:
                text = await self._recognize(part.pcm, part.rate)
        except asyncio.CancelledError:
            if early is not None:
                early.cancel()
            raise
        except Exception as e:
            self.emit("conversation.item.input_audio_transcription.failed", item_id=item.id, content_index=idx,
                      error={"type": "transcription_error", "code": None, "message": str(e), "param": None})
            raise
        part.transcript = text.strip()
        part.pcm = None  # the transcript is what the model hears from now on
        if part.transcript:
            self.emit("conversation.item.input_audio_transcription.delta", item_id=item.id, content_index=idx,
                      delta=part.transcript)
        self.emit("conversation.item.input_audio_transcription.completed", item_id=item.id, content_index=idx,
                  transcript=part.transcript)
        return part.transcript


def _quiet(task: asyncio.Task) -> None:
    """Retrieve an early transcription's failure (its commit, if any, reports it)."""
    if not task.cancelled():
        task.exception()
