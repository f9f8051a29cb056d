"""A voice assistant turn over epd's realtime API, with the official ``openai`` SDK.

Streams a WAV file to ``/v1/realtime`` in real-time-paced chunks (as a microphone
would), commits the turn, asks for a response, prints the TTS-ready phrases
(``response.output_text.segment``, an epd extension event) as they arrive, speaks
each with espeak-ng when it is installed, and prints the time from the end of speech
(the commit) to the first phrase and to the first text delta.

    make run                                                   # in another shell
    .venv/bin/python examples/voice_assistant.py               # the bundled question
    .venv/bin/python examples/voice_assistant.py --wav my.wav --base-url http://127.0.0.1:8000/v1 --no-speak

``OPENAI_API_KEY`` is sent when the server was started with ``--api-key``.

Any WAV/FLAC works (mono or stereo, any rate): it is sent as PCM16 mono at its own
rate, declared with ``session.update`` (``audio.input.format.rate``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import soundfile as sf
from openai import AsyncOpenAI

DEFAULT_WAV = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech" / "capital_of_france.wav"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="epd's OpenAI base URL")
    p.add_argument("--wav", type=Path, default=DEFAULT_WAV, help="the spoken question")
    p.add_argument("--chunk-ms", type=int, default=100, help="audio per input_audio_buffer.append")
    p.add_argument("--no-pacing", action="store_true", help="send the audio as fast as possible")
    p.add_argument("--max-output-tokens", type=int, default=96)
    p.add_argument("--instructions", default=None, help="system prompt (default: the model's own)")
    p.add_argument("--no-speak", action="store_true", help="do not speak the phrases with espeak-ng")
    return p.parse_args(argv)


class Speaker:
    """Speaks phrases one after another with espeak-ng (in a thread; never blocks the socket)."""

    def __init__(self, enabled: bool) -> None:
        self.exe = shutil.which("espeak-ng") if enabled else None
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._run()) if self.exe else None

    def say(self, text: str) -> None:
        if self.task is not None and text.strip():
            self.queue.put_nowait(text.strip())

    async def _run(self) -> None:
        while (text := await self.queue.get()) is not None:
            await asyncio.to_thread(subprocess.run, [self.exe, text], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, check=False)

    async def finish(self) -> None:
        if self.task is not None:
            self.queue.put_nowait(None)
            await self.task


async def main(args: argparse.Namespace) -> None:
    audio, rate = sf.read(args.wav, dtype="int16", always_2d=True)
    pcm = audio.mean(axis=1).astype(np.int16).tobytes()
    step = rate * 2 * args.chunk_ms // 1000
    client = AsyncOpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
    speaker = Speaker(not args.no_speak)
    if speaker.exe is None and not args.no_speak:
        print("(espeak-ng not found: printing only)")
    async with client.realtime.connect() as conn:
        session = {"type": "realtime", "max_output_tokens": args.max_output_tokens,
                   "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate},
                                       "turn_detection": None}}}  # this client commits the turn itself
        if args.instructions:
            session["instructions"] = args.instructions
        await conn.session.update(session=session)
        async for ev in conn:  # session.created, then our update's answer
            if ev.type == "error":
                raise SystemExit(f"session.update failed: {ev.error.message}")
            if ev.type == "session.updated":
                break
        print(f"streaming {args.wav.name}: {len(pcm) / 2 / rate:.1f} s at {rate} Hz in {args.chunk_ms} ms chunks")
        start = time.perf_counter()
        for i, off in enumerate(range(0, len(pcm), step)):
            if not args.no_pacing:  # a microphone delivers audio no faster than it is spoken
                await asyncio.sleep(max(0.0, start + i * args.chunk_ms / 1000 - time.perf_counter()))
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[off:off + step]).decode())
        t0 = time.perf_counter()  # end of speech
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        first_delta = first_segment = None
        async for ev in conn:
            now = time.perf_counter() - t0
            if ev.type == "conversation.item.input_audio_transcription.completed":
                print(f"[{now * 1000:6.0f} ms] heard: {ev.transcript}")
            elif ev.type == "response.output_text.delta" and first_delta is None:
                first_delta = now
            elif ev.type == "response.output_text.segment":
                first_segment = now if first_segment is None else first_segment
                print(f"[{now * 1000:6.0f} ms] {ev.text.strip()}")
                speaker.say(ev.text)
            elif ev.type == "error":
                print(f"error: {ev.error.message}")
            elif ev.type == "response.done":
                usage = ev.response.usage
                print(f"status {ev.response.status}; {usage.input_tokens if usage else '?'} prompt tokens, "
                      f"{usage.output_tokens if usage else '?'} output tokens")
                break
    print(f"time to first segment: {first_segment * 1000:.0f} ms" if first_segment is not None
          else "no segment")
    print(f"time to first delta:   {first_delta * 1000:.0f} ms" if first_delta is not None else "no delta")
    await speaker.finish()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
