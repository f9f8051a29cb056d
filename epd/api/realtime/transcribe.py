"""``/v1/realtime`` transcription: each committed audio part is transcribed in the E pool
for text-only models (``Transcriber``), early from a turn's pause under server VAD.
The protocol is described in ``epd.api.realtime``."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from epd.api.cpu_pool import CpuPool, shared_pool
from epd.api.realtime.conversation import Item, Part
from epd.api.realtime.protocol import ClientError, new_id, pcm_array
from epd.router.router import RequestError

#: how long a transcription waits for an encode pool that is down (503) to come back
ASR_RETRY_S = 10.0
#: audio clips one session may have transcribing at once (each is an encode job)
MAX_SESSION_TRANSCRIPTIONS = 4


class Transcriber:
    """Text-only models: each committed audio part is transcribed in the E pool as
    soon as it arrives; ``emit`` sends the ``...input_audio_transcription.*`` events;
    ``cpu``: the pool that decodes and resamples the clips (default: ``shared_pool()``);
    ``on_end`` is called when a transcription task ends.

    Admission: each transcription is an encode job. A job counts toward the session's
    ``MAX_SESSION_TRANSCRIPTIONS`` and, with the HTTP requests and the realtime
    responses, toward the server's ``max_pending_requests`` (``api.state.admit``) from
    its start until its task ends; work over either limit is refused (``ClientError``,
    code ``rate_limit_exceeded``) before anything starts. ``jobs``: the running jobs
    and the release of each one's admission. Cancelling a job (its item deleted, the
    session closed) closes its router request, which aborts it on the encoder.

    Early transcription (server VAD): ``start_early`` transcribes a turn's audio up to a
    pause while the turn may still go on; when the turn then ends at that pause (no
    speech since), its commit takes that transcript (and its admission) instead of
    starting again, so the transcript is ready about when the silence that ends the turn is over.
    """

    def __init__(self, api, emit, cpu: CpuPool | None = None, on_end: Callable[[], None] = lambda: None) -> None:
        self.api, self.emit, self.cpu, self.on_end = api, emit, cpu or shared_pool(), on_end
        self.jobs: dict[asyncio.Task, Callable[[], None]] = {}
        self.early: tuple[int, asyncio.Task] | None = None  # (speech end ms, transcription of the turn so far)

    @property
    def transcribes(self) -> bool:
        return self.api.processor.modalities.get("audio") == "transcribe"

    def check(self, jobs: int, more: int = 0) -> None:
        """Raise ClientError (``rate_limit_exceeded``) unless ``jobs`` more transcriptions,
        and ``more`` other requests (a response), fit the session's and the server's limits."""
        if not jobs:
            return
        if len(self.jobs) + jobs > MAX_SESSION_TRANSCRIPTIONS:
            raise ClientError(f"this session has {len(self.jobs)} audio clips transcribing and may have at most "
                              f"{MAX_SESSION_TRANSCRIPTIONS}; wait for their transcription events and retry",
                              None, "rate_limit_exceeded", "rate_limit_error")
        limit = self.api.max_pending_requests
        if self.api.state.pending + jobs + more > limit:
            raise ClientError(f"too many requests in flight ({limit}, transcriptions included); retry later",
                              None, "rate_limit_exceeded", "rate_limit_error")

    def start_early(self, data: bytes, rate: int, speech_end_ms: int) -> None:
        """Transcribe ``data`` (PCM16 at ``rate``: a turn up to ``speech_end_ms``) now; an
        earlier early transcription is dropped. Over a limit it is skipped (the commit
        transcribes the turn)."""
        self.drop_early()
        if not (self.transcribes and data):
            return
        try:
            self.check(1)
        except ClientError:
            return
        task = self._run(self._recognize(pcm_array(data), rate), self._admit())
        task.add_done_callback(_quiet)
        self.early = (speech_end_ms, task)

    def drop_early(self) -> None:
        if self.early is not None:
            self.early[1].cancel()
            self.early = None

    def start(self, item: Item, early_ms: int | None = None) -> None:
        """Transcribe each audio part of ``item``, starting now, or (a committed turn
        that ended at ``early_ms``) from its early transcription.

        Raises:
            ClientError: over the session's or the server's limit (nothing started).
        """
        parts = [(idx, p) for idx, p in enumerate(item.parts) if p.type == "input_audio"] if self.transcribes else []
        early = self.early
        if early is None or early_ms is None or early[0] != early_ms or not parts:
            self.drop_early()  # speech went on after that pause: stale
            early = None
        self.check(len(parts) - (early is not None and early[1] in self.jobs))
        self.early = None
        for idx, part in parts:
            if early is not None:  # the job goes on in this part's task, with the early one's admission if it runs
                self._task(item, idx, part, early[1], self.jobs.pop(early[1], None))
                early = None
            else:
                self._task(item, idx, part)

    def jobs_for(self, items: list[Item]) -> int:
        """The transcriptions ``start`` would run for ``items`` (their audio parts, for a text-only model)."""
        return sum(p.type == "input_audio" for it in items for p in it.parts) if self.transcribes else 0

    def failed(self, items: list[Item]) -> list[tuple[Item, int, Part]]:
        """The audio parts of ``items`` whose transcription failed (a pool down, a timeout)."""
        return [(item, idx, part) for item in items for idx, part in enumerate(item.parts)
                if part.asr is not None and part.asr.done() and (part.asr.cancelled() or part.asr.exception())]

    def retry(self, parts: list[tuple[Item, int, Part]]) -> None:
        """Transcribe again ``parts`` (``failed``'s), after ``check`` admitted as many."""
        for item, idx, part in parts:
            self._task(item, idx, part)

    def cancel(self, item: Item) -> None:
        """Stop the transcriptions of ``item``'s parts (its router requests are aborted)."""
        for part in item.parts:
            if part.asr is not None:
                part.asr.cancel()

    def cancel_all(self) -> None:
        self.drop_early()
        for t in list(self.jobs):
            t.cancel()

    def _admit(self) -> Callable[[], None]:
        """One job's admission, after ``check`` let it in."""
        release = self.api.state.admit(self.api.max_pending_requests)
        if release is None:
            raise RuntimeError("a transcription was started without check()")
        return release

    def _run(self, coro, release: Callable[[], None]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.jobs[task] = release
        task.add_done_callback(self._done)
        return task

    def _task(self, item: Item, idx: int, part: Part, early: asyncio.Task | None = None,
              release: Callable[[], None] | None = None) -> None:
        part.asr = self._run(self._transcribe(item, idx, part, early), release or self._admit())

    def _done(self, task: asyncio.Task) -> None:
        release = self.jobs.pop(task, None)
        if release is not None:
            release()
        self.on_end()
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
