"""What a video costs the API process before any encoder runs: ``epd.encoders.video.decode_video``.

Builds H.264 MP4s with PyAV in the run (``--size`` WxH, ``--source-fps``, each of ``--seconds``
long; a moving gradient, so the encoder has real motion to code), then for each: one untimed
warm-up, ``--runs`` timed ``decode_video`` calls at ``--fps`` (default 2) with at most
``--max-frames`` (32) frames. Reported: decode p50 / min (ms), ms per second of video, frames
sampled. Then the hostile files the limits refuse from their headers (a 10^5-frame ``stts``, a
4096x4096 stream, a 700 s duration under the default 600 s cap, a truncated WebM): how long
the refusal takes, against the full decode the same bytes would have needed.

Each timed call records how many cores other processes kept busy meanwhile (``other_cores``,
/proc/stat): on a shared machine with few cores another busy process slows these numbers a lot.

    python benchmarks/video_decode.py                         # 640x360 @ 30 fps, 2 / 10 / 30 s
    python benchmarks/video_decode.py --size 1280x720 --seconds 10 --runs 3

Writes benchmarks/results/video_decode.{json,png} (``--out-dir``).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import git_commit, timed  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="640x360", help="WxH of the generated videos (default: %(default)s)")
    p.add_argument("--source-fps", type=int, default=30)
    p.add_argument("--seconds", type=float, nargs="+", default=[2.0, 10.0, 30.0])
    p.add_argument("--fps", type=float, default=2.0, help="sampling rate (default: %(default)s)")
    p.add_argument("--max-frames", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def make_video(width: int, height: int, fps: int, seconds: float, fmt: str = "mp4", codec: str = "libx264") -> bytes:
    import av

    buf = io.BytesIO()
    y, x = np.mgrid[0:height, 0:width]
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps, options={"preset": "ultrafast"} if codec == "libx264" else {})
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for i in range(round(seconds * fps)):
            rgb = np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, np.full_like(x, (3 * i) % 256)], -1).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from epd.encoders.media_limits import MediaError
    from epd.encoders.video import VideoSampling, decode_video
    from tests.encoders.video_files import with_declared_frames

    width, height = (int(v) for v in args.size.lower().split("x"))
    sampling = VideoSampling(fps=args.fps, max_frames=args.max_frames)
    rows = []
    for seconds in args.seconds:
        data = make_video(width, height, args.source_fps, seconds)
        decode_video(data, sampling=sampling)  # warm-up
        walls, others = [], []
        for _ in range(args.runs):
            out, wall, other = timed(lambda: decode_video(data, sampling=sampling))
            walls.append(wall)
            others.append(other)
        p50 = statistics.median(walls)
        rows.append({"case": f"{width}x{height} H.264, {seconds:g} s @ {args.source_fps} fps", "bytes": len(data),
                     "video_s": seconds, "frames_sampled": int(out.frames.shape[0]), "p50_ms": 1e3 * p50,
                     "min_ms": 1e3 * min(walls), "ms_per_video_s": 1e3 * p50 / seconds,
                     "other_cores_max": max(others)})

    hostile = {
        "10^5-frame header (1000 fps, 10 frames)": with_declared_frames(make_video(64, 48, 1000, 0.01), 100_000),
        "4096x4096 stream": make_video(4096, 4096, 1, 1.0),
        "700 s duration (1 fps, 64x48)": make_video(64, 48, 1, 700.0),
    }
    webm = make_video(width, height, args.source_fps, 10.0, "webm", "libvpx")
    hostile["truncated WebM (half of 10 s)"] = webm[: len(webm) // 2]
    refusals = []
    for name, data in hostile.items():
        walls, message = [], ""
        for _ in range(args.runs):
            def attempt():
                try:
                    decode_video(data, sampling=sampling)
                    return "accepted"
                except MediaError as e:
                    return f"{type(e).__name__}: {e}"
            message, wall, _ = timed(attempt)
            walls.append(wall)
        refusals.append({"case": name, "bytes": len(data), "p50_ms": 1e3 * statistics.median(walls),
                         "max_ms": 1e3 * max(walls), "error": message[:160]})

    print(f"\ndecode_video at {args.fps:g} fps, at most {args.max_frames} frames (p50 of {args.runs})")
    print(f"{'video':<36} {'bytes':>9} {'frames':>6} {'p50 ms':>9} {'min ms':>9} {'ms / video s':>13} {'busy':>5}")
    for r in rows:
        print(f"{r['case']:<36} {r['bytes']:>9} {r['frames_sampled']:>6} {r['p50_ms']:>9.1f} {r['min_ms']:>9.1f} "
              f"{r['ms_per_video_s']:>13.1f} {r['other_cores_max']:>5.2f}")
    print("\nrefused from the headers (or while decoding, for the truncated file)")
    print(f"{'file':<42} {'bytes':>9} {'p50 ms':>8} {'max ms':>8}  error")
    for r in refusals:
        print(f"{r['case']:<42} {r['bytes']:>9} {r['p50_ms']:>8.2f} {r['max_ms']:>8.2f}  {r['error'][:70]}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": git_commit(), "machine": platform.machine(), "python": platform.python_version(),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "decode": rows, "refusals": refusals}
    (args.out_dir / "video_decode.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["video_s"] for r in rows], [r["p50_ms"] for r in rows], "o-", label="decode_video p50")
        ax.set_xlabel("video length (s)")
        ax.set_ylabel("ms")
        ax.set_title(f"{width}x{height} H.264 @ {args.source_fps} fps, sampled at {args.fps:g} fps")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out_dir / "video_decode.png", dpi=120)
    except ImportError:
        pass
    print(f"\nwrote {args.out_dir / 'video_decode.json'}")
    return 0 if all(r["error"] != "accepted" for r in refusals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
