"""Voice latency over the realtime API: time to first phrase and first delta, and barge-in.

C concurrent sessions (default 1, 4 and 8) each speak ``--turns`` questions in one
conversation, through the official ``openai`` SDK's realtime client against
``/v1/realtime``: the spoken questions of tests/data/speech (capital_of_france.wav,
primary_colors.wav, alternating), resampled to PCM16 24 kHz (the API's default
format), streamed in 100 ms appends paced at real time (as a microphone delivers them;
``--no-pacing`` sends at once), then ``input_audio_buffer.commit`` and
``response.create`` (greedy, ``--max-output-tokens``). Sessions start 0-1 s apart
(seeded), as independent users would. Per turn, from the commit (end of speech):

* ``asr``: the transcription event (Whisper tiny.en in the E pool);
* ``first delta``: the first ``response.output_text.delta`` (what a text UI shows);
* ``first segment``: the first ``response.output_text.segment`` (what a TTS engine
  can start speaking: a whole phrase);
* ``done``: ``response.done``.

``--vad`` drives the same sessions the way a voice agent (pipecat at its defaults) does:
server VAD (the default ``turn_detection``), audio out (``output_modalities:
["audio"]``, the launched server gets a tts pool: ``e:1,p:1,d:1,t:1``), no commit and no
``response.create`` from the client; each question is followed by 1.5 s of silence, also
paced. Per turn, from the end of the question's audio (the last speech chunk appended):

* ``speech_stopped``: ``input_audio_buffer.speech_stopped`` (silero-vad's end of turn);
* ``transcript delta``: the first ``...input_audio_transcription.delta`` (early
  transcription starts at the VAD's pause, so this can come right after
  ``speech_stopped``); ``asr`` in the JSON is the ``.completed`` event;
* ``first delta``: the first ``response.output_audio_transcript.delta``;
* ``first audio``: the first ``response.output_audio.delta`` (the first sound out);
* ``done``: ``response.done``.

Barge-in under VAD: a long spoken answer is interrupted by speech (the question again)
once its first audio arrives; measured: ``speech_started`` -> ``response.done``
(cancelled), with no ``response.cancel`` from the client.

Barge-in (``--cancel-trials``, one session alone): a long answer is cancelled with
``response.cancel`` after its 3rd delta; measured: cancel -> ``response.done``
(status cancelled) at the client, and cancel -> every decode worker idle with all KV
blocks free, polled through ``GET /epd/workers`` (each poll is one round trip to every
worker, so this includes up to one poll's time).

    python benchmarks/voice_latency.py                        # launches epd (e:1,p:1,d:1) itself
    python benchmarks/voice_latency.py --url http://127.0.0.1:8000
    python benchmarks/voice_latency.py --quick                # smoke run: C = 1, 2; one turn
    python benchmarks/voice_latency.py --vad                  # server VAD + speech out (e:1,p:1,d:1,t:1)

Writes benchmarks/results/voice_latency.json and .png (``--out-dir``). The machine's
load average at start and end goes into the JSON: on a shared machine with few cores, other
processes move these numbers a lot.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT, git_commit, launch, pct, stop_launched

SPEECH = ROOT / "tests" / "data" / "speech"
QUESTIONS = ["capital_of_france.wav", "primary_colors.wav"]
RATE = 24000
CHUNK_MS = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an epd server to measure (default: launch one)")
    p.add_argument("--pools", help="pools of the launched server (default e:1,p:1,d:1; with --vad, "
                                   "e:1,p:1,d:1,t:1)")
    p.add_argument("--vad", action="store_true", help="server VAD and audio out, as a voice agent at its defaults")
    p.add_argument("--concurrency", type=int, nargs="+")
    p.add_argument("--turns", type=int, help="spoken turns per session (one conversation)")
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--cancel-trials", type=int, help="barge-in measurements")
    p.add_argument("--no-pacing", action="store_true", help="send each question's audio at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency = args.concurrency or [1, 2]
        args.turns = args.turns or 1
        args.cancel_trials = 2 if args.cancel_trials is None else args.cancel_trials
    args.concurrency = args.concurrency or [1, 4, 8]
    args.pools = args.pools or ("e:1,p:1,d:1,t:1" if args.vad else "e:1,p:1,d:1")
    args.turns = args.turns or 2
    args.cancel_trials = 5 if args.cancel_trials is None else args.cancel_trials
    return args


def load_questions() -> list[bytes]:
    """The spoken questions as PCM16 mono 24 kHz bytes."""
    import soundfile as sf
    import torch
    import torchaudio.functional as F

    out = []
    for name in QUESTIONS:
        audio, sr = sf.read(SPEECH / name, dtype="float32")
        x = F.resample(torch.from_numpy(audio), sr, RATE)
        out.append((x.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes())
    return out


async def recv_until(conn, pred, timeout_s: float = 600.0):
    async def loop():
        while True:
            ev = await conn.recv()
            if ev.type == "error":
                raise RuntimeError(f"server error event: {ev.error.message}")
            if pred(ev):
                return ev
    return await asyncio.wait_for(loop(), timeout_s)


def dithered(pcm: bytes, seed: int) -> bytes:
    """The clip with +-1 LSB of seeded noise: every turn is a new recording to the
    server (no encoder-cache hit on an identical clip), inaudibly."""
    import numpy as np

    x = np.frombuffer(pcm, dtype="<i2").astype(np.int32)
    x += np.random.default_rng(seed).integers(-1, 2, x.shape)
    return np.clip(x, -32768, 32767).astype("<i2").tobytes()


async def session(client, questions: list[bytes], turns: int, start_s: float, seed: int, args) -> list[dict]:
    """One user: ``turns`` spoken questions in one conversation; a record per turn."""
    await asyncio.sleep(start_s)
    records = []
    step = RATE * 2 * CHUNK_MS // 1000
    async with client.realtime.connect() as conn:
        await recv_until(conn, lambda e: e.type == "session.created")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await recv_until(conn, lambda e: e.type == "session.updated")
        for turn in range(turns):
            pcm = dithered(questions[turn % len(questions)], seed * 1000 + turn)
            t_start = time.perf_counter()
            for i, off in enumerate(range(0, len(pcm), step)):
                if not args.no_pacing:
                    await asyncio.sleep(max(0.0, t_start + i * CHUNK_MS / 1000 - time.perf_counter()))
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[off:off + step]).decode())
            t0 = time.perf_counter()
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"max_output_tokens": args.max_output_tokens})
            rec = {"turn": turn, "question": QUESTIONS[turn % len(QUESTIONS)]}

            def see(ev) -> bool:
                now = time.perf_counter() - t0
                if ev.type == "conversation.item.input_audio_transcription.completed":
                    rec["asr_s"] = now
                    rec["transcript"] = ev.transcript
                elif ev.type == "response.output_text.delta":
                    rec.setdefault("first_delta_s", now)
                elif ev.type == "response.output_text.segment":
                    rec.setdefault("first_segment_s", now)
                    rec.setdefault("first_segment", ev.text)
                elif ev.type == "response.done":
                    rec["done_s"] = now
                    rec["status"] = ev.response.status
                    usage = ev.response.usage
                    rec["output_tokens"] = usage.output_tokens
                    rec["input_tokens"] = usage.input_tokens
                    rec["cached_tokens"] = usage.input_token_details.cached_tokens
                    return True
                return False

            await recv_until(conn, see)
            records.append(rec)
    return records


async def session_vad(client, questions: list[bytes], turns: int, start_s: float, seed: int, args) -> list[dict]:
    """One user of a voice agent: server VAD, audio out; ``turns`` spoken questions."""
    await asyncio.sleep(start_s)
    records = []
    step = RATE * 2 * CHUNK_MS // 1000
    quiet = bytes(RATE * 2 * 1500 // 1000)
    async with client.realtime.connect() as conn:
        await recv_until(conn, lambda e: e.type == "session.created")
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "max_output_tokens": args.max_output_tokens})
        await recv_until(conn, lambda e: e.type == "session.updated")
        for turn in range(turns):
            pcm = dithered(questions[turn % len(questions)], seed * 1000 + turn)
            rec = {"turn": turn, "question": QUESTIONS[turn % len(QUESTIONS)]}
            t0 = None

            def see(ev) -> bool:
                now = time.perf_counter() - t0 if t0 is not None else float("nan")
                if ev.type == "input_audio_buffer.speech_stopped":
                    rec.setdefault("speech_stopped_s", now)
                elif ev.type == "conversation.item.input_audio_transcription.delta":
                    rec.setdefault("asr_delta_s", now)
                elif ev.type == "conversation.item.input_audio_transcription.completed":
                    rec["asr_s"] = now
                    rec["transcript"] = ev.transcript
                elif ev.type == "response.output_audio_transcript.delta":
                    rec.setdefault("first_delta_s", now)
                elif ev.type == "response.output_audio.delta":
                    rec.setdefault("first_audio_s", now)
                elif ev.type == "response.done":
                    rec["done_s"] = now
                    rec["status"] = ev.response.status
                    rec["output_tokens"] = ev.response.usage.output_tokens
                    return True
                return False

            async def receive():
                await recv_until(conn, see)

            receiver = asyncio.create_task(receive())
            t_start = time.perf_counter()
            audio = pcm + quiet
            for i, off in enumerate(range(0, len(audio), step)):
                if not args.no_pacing:
                    await asyncio.sleep(max(0.0, t_start + i * CHUNK_MS / 1000 - time.perf_counter()))
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[off:off + step]).decode())
                if off + step >= len(pcm) and t0 is None:
                    t0 = time.perf_counter()  # the question's last chunk is in
            await receiver
            records.append(rec)
    return records


async def measure_vad_barge_in(url: str, questions: list[bytes], trials: int, args) -> list[dict]:
    """Barge-in under server VAD: speech over a spoken answer; speech_started -> done."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    step = RATE * 2 * CHUNK_MS // 1000
    out = []
    async with client.realtime.connect() as conn:
        await recv_until(conn, lambda e: e.type == "session.created")
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "instructions": "You are a storyteller. Tell long stories."})
        await recv_until(conn, lambda e: e.type == "session.updated")
        for i in range(trials):
            pcm = dithered(questions[0], 7000 + i)
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": f"Tell me a very long story about dragon number {i}."}]})
            await conn.response.create(response={"max_output_tokens": 400})
            first = await recv_until(conn, lambda e: e.type == "response.output_audio.delta")
            story, stamps, seen = first.response_id, {}, []

            def see(ev) -> bool:
                if not ev.type.endswith(".delta"):
                    seen.append(ev.type)
                if ev.type == "input_audio_buffer.speech_started":
                    stamps.setdefault("started", time.perf_counter())
                elif ev.type == "response.done" and ev.response.id == story:
                    stamps["status"] = ev.response.status
                    if "started" in stamps:  # else the story ended before the speech began
                        stamps["done"] = time.perf_counter()
                elif ev.type == "response.done":
                    return True  # the answer to the interrupting turn
                return False

            receiver = asyncio.create_task(recv_until(conn, see, timeout_s=180))
            audio = pcm + bytes(RATE * 2 * 1500 // 1000)
            t_start = time.perf_counter()
            for k, off in enumerate(range(0, len(audio), step)):
                await asyncio.sleep(max(0.0, t_start + k * CHUNK_MS / 1000 - time.perf_counter()))
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[off:off + step]).decode())
            try:
                await receiver
            except TimeoutError:
                raise RuntimeError(f"barge-in trial {i}: no answer to the interrupting turn; events: {seen}") from None
            if "done" in stamps:
                out.append({"speech_started_to_done_s": stamps["done"] - stamps["started"], "status": stamps["status"]})
            else:
                print(f"barge-in trial {i}: the story ended ({stamps.get('status')}) before speech began; not counted")
    return out


async def run_level(url: str, questions: list[bytes], concurrency: int, args, rng: random.Random) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    starts = [0.0] + [rng.uniform(0, 1) for _ in range(concurrency - 1)]
    run = session_vad if args.vad else session
    per = await asyncio.gather(*(run(client, questions, args.turns, s, rng.getrandbits(32), args)
                                 for s in starts))
    return [dict(r, session=i) for i, recs in enumerate(per) for r in recs]


async def measure_cancel(url: str, trials: int) -> list[dict]:
    """Barge-in: cancel a long answer after its 3rd delta; cancel -> done, cancel -> slot free."""
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def slots_free() -> bool:
            stats = (await http.get("/epd/workers")).json()
            return all(s["num_running"] == 0 and s.get("num_reserved", 0) == 0
                       and s["num_free_blocks"] == s["num_blocks"]
                       for k, s in stats.items() if k.startswith(("decode", "pd")))

        async with client.realtime.connect() as conn:
            await recv_until(conn, lambda e: e.type == "session.created")
            for i in range(trials):
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": f"Tell me a very long story about dragon number {i}."}]})
                await conn.response.create(response={"max_output_tokens": 400})
                n, stamps = 0, []

                def third(ev) -> bool:
                    nonlocal n
                    if ev.type == "response.output_text.delta":
                        n += 1
                        stamps.append(time.perf_counter())
                    return n >= 3

                await recv_until(conn, third)
                t0 = time.perf_counter()
                await conn.response.cancel()
                done = await recv_until(conn, lambda e: e.type == "response.done")
                t_done = time.perf_counter() - t0
                while not await slots_free():
                    if time.perf_counter() - t0 > 30:
                        raise RuntimeError("the decode slot was not freed within 30 s")
                t_free = time.perf_counter() - t0
                out.append({"cancel_to_done_s": t_done, "cancel_to_slot_free_s": t_free,
                            "itl_before_cancel_s": [b - a for a, b in zip(stamps, stamps[1:])],
                            "status": done.response.status, "output_tokens": done.response.usage.output_tokens})
    return out


def summarize(concurrency: int, recs: list[dict]) -> dict:
    row = {"concurrency": concurrency, "turns": len(recs)}
    for key in ("speech_stopped_s", "asr_delta_s", "asr_s", "first_delta_s", "first_segment_s", "first_audio_s",
                "done_s"):
        xs = [r[key] for r in recs if key in r]
        row[key] = {"p50": pct(xs, 50), "p90": pct(xs, 90), "p95": pct(xs, 95),
                    "mean": statistics.fmean(xs) if xs else float("nan")}
    row["completed"] = sum(r.get("status") in ("completed", "incomplete") for r in recs)
    return row


def plot(rows: list[dict], path: Path, title: str, vad: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(rows), 4))
    x = range(len(rows))
    w = 0.27
    series = ([("speech_stopped_s", "speech_stopped"), ("first_delta_s", "first delta"),
               ("first_audio_s", "first audio")] if vad else
              [("asr_s", "transcript"), ("first_delta_s", "first delta"), ("first_segment_s", "first segment")])
    for k, (key, label) in enumerate(series):
        p50 = [r[key]["p50"] * 1000 for r in rows]
        p90 = [r[key]["p90"] * 1000 for r in rows]
        ax.bar([i + (k - 1) * w for i in x], p50, w, label=f"{label} (p50)",
               yerr=[[0] * len(rows), [b - a for a, b in zip(p50, p90)]], capsize=3)
    ax.set_xticks(list(x), [str(r["concurrency"]) for r in rows])
    ax.set_xlabel("concurrent voice sessions")
    ax.set_ylabel(("ms after the question's last audio" if vad else "ms after commit") + " (whisker: p90)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    questions = load_questions()
    proc = None
    url = args.url
    if url is None:
        print(f"launching epd ({args.pools}) ...", flush=True)
        proc, url = launch(args.pools)
    load_start = os.getloadavg()
    try:
        asyncio.run(run_level(url, questions, 1, argparse.Namespace(**{**vars(args), "turns": 1}), rng))  # warm-up
        rows, samples = [], {}
        for c in args.concurrency:
            recs = asyncio.run(run_level(url, questions, c, args, rng))
            samples[str(c)] = recs
            rows.append(summarize(c, recs))
            print(f"C={c}: {rows[-1]['completed']}/{len(recs)} turns done", flush=True)
        cancels = asyncio.run(measure_cancel(url, args.cancel_trials)) if args.cancel_trials and not args.vad else []
        barge = asyncio.run(measure_vad_barge_in(url, questions, args.cancel_trials, args)) \
            if args.cancel_trials and args.vad else []
    finally:
        if proc is not None:
            stop_launched(proc)
    load_end = os.getloadavg()

    ms = lambda s: f"{s * 1000:7.0f}"  # noqa: E731
    print()
    if args.vad:
        cols = [("speech_stopped_s", "speech_stopped"), ("asr_delta_s", "transcript delta"),
                ("first_delta_s", "first text delta"), ("first_audio_s", "first audio"), ("done_s", "done")]
        print(f"{'sessions':>8} | {'turns':>5} | " + " | ".join(f"{name + ' p50 / p95':>26}" for _, name in cols))
        print("-" * (18 + 29 * len(cols)))
        for r in rows:
            print(f"{r['concurrency']:>8} | {r['turns']:>5} | " + " | ".join(
                f"{ms(r[key]['p50'])} / {ms(r[key]['p95']):>16}" for key, _ in cols))
        print("(ms after the question's last audio chunk; server VAD, audio out)")
        if barge:
            xs = [b["speech_started_to_done_s"] for b in barge]
            print(f"\nbarge-in over {len(barge)} trials: speech_started -> response.done "
                  f"({', '.join(sorted({b['status'] for b in barge}))}) p50 {pct(xs, 50) * 1000:.1f} ms "
                  f"(max {max(xs) * 1000:.1f})")
    else:
        print(f"{'sessions':>8} | {'turns':>5} | {'transcript p50':>14} | {'first delta p50 / p90':>21} | "
              f"{'first segment p50 / p90':>23} | {'done p50':>8}")
        print("-" * 96)
        for r in rows:
            print(f"{r['concurrency']:>8} | {r['turns']:>5} | {ms(r['asr_s']['p50']):>14} | "
                  f"{ms(r['first_delta_s']['p50'])} / {ms(r['first_delta_s']['p90']):>11} | "
                  f"{ms(r['first_segment_s']['p50'])} / {ms(r['first_segment_s']['p90']):>13} | "
                  f"{ms(r['done_s']['p50']):>8}")
        print("(ms after input_audio_buffer.commit)")
        if cancels:
            done = [c["cancel_to_done_s"] for c in cancels]
            free = [c["cancel_to_slot_free_s"] for c in cancels]
            print(f"\nbarge-in over {len(cancels)} trials: response.cancel -> response.done(cancelled) p50 "
                  f"{pct(done, 50) * 1000:.1f} ms (max {max(done) * 1000:.1f}); -> decode slot free p50 "
                  f"{pct(free, 50) * 1000:.1f} ms (max {max(free) * 1000:.1f}); ITL (delta to delta) before the "
                  f"cancel p50 {pct([x for c in cancels for x in c['itl_before_cancel_s']], 50) * 1000:.1f} ms")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = ("voice_latency_vad" if args.vad else "voice_latency") + ("_quick" if args.quick else "")
    report = {"benchmark": "voice_latency", "model": "SmolLM2-135M-Instruct (embedded default) + Whisper tiny.en",
              "url": args.url, "pools": None if args.url else args.pools, "turns_per_session": args.turns,
              "max_output_tokens": args.max_output_tokens, "paced": not args.no_pacing, "seed": args.seed,
              "questions": QUESTIONS, "cpu_count": os.cpu_count(), "platform": platform.platform(),
              "git_commit": git_commit(), "loadavg_start": load_start, "loadavg_end": load_end,
              "vad": args.vad, "results": rows, "cancel": cancels, "vad_barge_in": barge,
              "samples": samples}
    json_path = args.out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    png_path = args.out_dir / f"{stem}.png"
    plot(rows, png_path, f"epd realtime API, SmolLM2-135M + Whisper tiny.en, {os.cpu_count()} CPUs, "
                         f"{args.turns} spoken turns/session" + (", server VAD + audio out" if args.vad else ""),
         vad=args.vad)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
