"""Qwen2.5-VL through the encode pool: encode time per video second, and TTFT for 1-4 images or one video.

A random Qwen2.5-VL is built in the run (``epd.models.tiny``'s, with a wider and deeper vision
tower than the tests' and a larger ``max_pixels``, so the tower costs what a small real one
would on these cores: ``--vision-hidden``, ``--vision-depth``, ``--max-pixels``). Media are
made in the run: 320x240 PNGs of noise, and H.264 MP4s (a moving gradient, 24 fps) that
``--video-fps`` samples.

1. **Encode per video second** (in this process): ``MultiModalProcessor.video_item``
   (PyAV decode + resize/normalize into temporal patches, what the API process does) and the
   vision tower's forward (what an encode worker does), p50 of ``--runs``, over
   ``--video-seconds`` long videos.
2. **TTFT**, one request at a time, fresh media every request (no encoder- or prefix-cache
   hits): 1, 2, 3, 4 images or one ``--ttft-video-s`` video, then a text-only request sent
   while a video request is encoding (``text beside video``), on
   * ``in-process``: the offline ``epd.LLM`` (decode, encode, prefill in one process, one
     after another: the TTFT floor with no network hops, and what an engine without an encode
     pool does);
   * ``aggregated`` ``epd launch --pools e:1,pd:1`` (encode pool + one prefill+decode engine);
   * ``disaggregated`` ``epd launch --pools e:1,p:1,d:1``.
   Served TTFT is the first streamed content chunk through the ``openai`` SDK (``max_tokens``
   4). Workers use epd's default thread budget; everything shares the machine's cores.
3. **A long video split across two encoders**, simulated: the longest video's tower forward
   in one process, against its two halves at a temporal-patch boundary in two processes at
   once (1 torch thread each).
4. With ``--split``, **served**: TTFT of one fresh ``--split-video-s`` (8 s) video per request
   on ``e:1,p:1,d:1`` against ``e:2,p:1,d:1``, where the router encodes it in two chunks of
   temporal patches, one per encoder (``--video-encode-split auto``, router/encode_split.py).

    python benchmarks/video_ttft.py                 # ~10 min on 2 cores
    python benchmarks/video_ttft.py --runs 3 --video-seconds 2 4
    python benchmarks/video_ttft.py --split --configs   # 1, 3 and the served split (4.), no 2

Writes benchmarks/results/video_ttft.json (``--out-dir``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import free_port, git_commit, start_server, stop_server, timed  # noqa: E402
from video_decode import make_video  # noqa: E402

CONFIGS = {"aggregated": "e:1,pd:1", "disaggregated": "e:1,p:1,d:1"}
IMAGE_SIZE = (240, 320)  # H, W
MAX_TOKENS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vision-hidden", type=int, default=256, help="vision tower width (tests' tiny: 32)")
    p.add_argument("--vision-depth", type=int, default=8, help="vision tower blocks (tests' tiny: 2)")
    p.add_argument("--max-pixels", type=int, default=256 * 8 * 8,
                   help="processor max_pixels: at most max_pixels / 64 LM tokens per image or temporal patch "
                        "(default: %(default)s, 256 tokens)")
    p.add_argument("--video-fps", type=float, default=2.0)
    p.add_argument("--video-seconds", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--ttft-video-s", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--configs", nargs="*", default=["in-process", *CONFIGS])
    p.add_argument("--split", action="store_true",
                   help="also measure a --split-video-s video's TTFT on e:1,p:1,d:1 vs e:2,p:1,d:1 (split encode)")
    p.add_argument("--split-video-s", type=float, default=8.0)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def build_model(out: Path, hidden: int, depth: int, max_pixels: int) -> Path:
    """``epd.models.tiny``'s Qwen2.5-VL with a ``hidden`` x ``depth`` vision tower (window attention in
    every block but every fourth and the last, as the real one) and ``max_pixels``."""
    import epd.models.tiny as tiny

    base = tiny._CONFIGS["qwen2.5-vl"]

    def config(tokenizer):
        cfg = base(tokenizer)
        vc = cfg.vision_config
        vc.hidden_size, vc.intermediate_size, vc.depth = hidden, 4 * hidden, depth
        vc.num_heads = max(2, hidden // 64)
        vc.fullatt_block_indexes = sorted({i for i in range(3, depth, 4)} | {depth - 1})
        return cfg

    saved = tiny._CONFIGS["qwen2.5-vl"], tiny.QWEN_VL_MAX_PIXELS
    tiny._CONFIGS["qwen2.5-vl"], tiny.QWEN_VL_MAX_PIXELS = config, max_pixels
    try:
        return tiny.create_tiny_model("qwen2.5-vl", out)
    finally:
        tiny._CONFIGS["qwen2.5-vl"], tiny.QWEN_VL_MAX_PIXELS = saved


def png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def mp4(seed: int, seconds: float) -> bytes:
    """A 320x240 24 fps H.264 clip; ``seed`` shifts the gradient, so every clip is new bytes."""
    return make_video(IMAGE_SIZE[1] + 2 * (seed % 3), IMAGE_SIZE[0], 24, seconds + 0.01 * (seed % 7))


def url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def workloads(runs: int, video_s: float) -> dict[str, list[tuple[list[bytes], list[bytes]]]]:
    """name -> per run, (images, videos) never sent before."""
    seed = iter(range(1000, 100000))
    out = {f"{n} image{'s' if n > 1 else ''}": [([png(next(seed)) for _ in range(n)], []) for _ in range(runs)]
           for n in (1, 2, 3, 4)}
    out[f"video {video_s:g} s"] = [([], [mp4(next(seed), video_s)]) for _ in range(runs)]
    return out


QUESTION = "Describe it."


def content(images: list[bytes], videos: list[bytes]) -> list[dict]:
    return ([{"type": "image_url", "image_url": {"url": url(b, "image/png")}} for b in images]
            + [{"type": "video_url", "video_url": {"url": url(b, "video/mp4")}} for b in videos]
            + [{"type": "text", "text": QUESTION}])


# ---- 1. encode time per video second --------------------------------------------------
def encode_per_second(model: Path, args) -> list[dict]:
    import torch

    from epd import LLM

    torch.set_num_threads(1)
    llm = LLM(str(model), dtype="float32", kv_cache_memory_gb=0.05, video_fps=args.video_fps)
    proc, tower = llm.mm_processor, llm.encoder.vision
    rows = []
    for seconds in args.video_seconds:
        clips = [mp4(i, seconds) for i in range(args.runs + 1)]
        prep, enc, others = [], [], []
        for i, clip in enumerate(clips):
            item, wall_p, other_p = timed(lambda: proc.video_item(clip))
            d = item.data
            with torch.inference_mode():
                _, wall_e, other_e = timed(lambda: tower.encode(d["pixel_values_videos"], d["video_grid_thw"][None]))
            if i:  # the first is a warm-up
                prep.append(wall_p)
                enc.append(wall_e)
                others.append(max(other_p, other_e))
        grid = [int(x) for x in d["video_grid_thw"]]
        rows.append({"video_s": seconds, "grid_thw": grid, "tokens": item.num_tokens,
                     "patches": int(d["pixel_values_videos"].shape[0]),
                     "decode_preprocess_ms": 1e3 * statistics.median(prep),
                     "tower_ms": 1e3 * statistics.median(enc),
                     "decode_preprocess_ms_per_video_s": 1e3 * statistics.median(prep) / seconds,
                     "tower_ms_per_video_s": 1e3 * statistics.median(enc) / seconds,
                     "other_cores_max": max(others)})
        print(f"  {seconds:g} s video: {rows[-1]}", flush=True)
    llm.shutdown()
    return rows


# ---- 3. a long video split across two encoders (simulated) -----------------------------
_TOWER = None


def _tower_init(model: str) -> None:
    global _TOWER
    import torch
    from transformers import AutoConfig

    from epd.encoders.encoder_runner import EncoderRunner

    torch.set_num_threads(1)
    _TOWER = EncoderRunner(model, AutoConfig.from_pretrained(model), cache_bytes=0).vision


def _tower_run(pixels, grid) -> tuple[float, object]:
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = _TOWER.encode(pixels, grid)[0]
    return time.perf_counter() - t0, out


def chunked_encode(model: Path, args) -> dict:
    """The longest ``--video-seconds`` video's tower forward in one process against its two
    halves (at a temporal-patch boundary, exact: tests/encoders/test_video_chunks.py) in two
    processes at once, 1 torch thread each, as two encode instances would run them: wall
    from sending to having both, p50 of ``--runs``. Not through epd's router, which sends a
    request's items to one encoder."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import torch
    from transformers import AutoConfig

    from epd.encoders.processor import MultiModalProcessor
    from epd.encoders.video import VideoSampling

    seconds = max(args.video_seconds)
    proc = MultiModalProcessor(str(model), AutoConfig.from_pretrained(str(model)), video_fps=args.video_fps)
    item = proc.video_item(mp4(77, seconds), VideoSampling(fps=args.video_fps, max_frames=32))
    px, g = item.data["pixel_values_videos"], item.data["video_grid_thw"]
    t, h, w = g.tolist()
    half = t // 2
    pieces = [(px[:half * h * w], torch.tensor([[half, h, w]])), (px[half * h * w:], torch.tensor([[t - half, h, w]]))]
    ctx = mp.get_context("spawn")
    one_walls, two_walls = [], []
    with ProcessPoolExecutor(2, mp_context=ctx, initializer=_tower_init, initargs=(str(model),)) as pool:
        whole = None
        for run in range(args.runs + 1):
            t0 = time.perf_counter()
            _, whole = pool.submit(_tower_run, px, g[None]).result()
            one = time.perf_counter() - t0
            t0 = time.perf_counter()
            futs = [pool.submit(_tower_run, *p) for p in pieces]
            parts = [f.result()[1] for f in futs]
            two = time.perf_counter() - t0
            if run:  # the first is a warm-up (both processes load the tower)
                one_walls.append(one)
                two_walls.append(two)
        exact = bool(torch.equal(torch.cat(parts), whole))
    row = {"video_s": seconds, "grid_thw": [t, h, w], "tokens": item.num_tokens,
           "one_encoder_ms": 1e3 * statistics.median(one_walls), "two_encoders_ms": 1e3 * statistics.median(two_walls),
           "speedup": statistics.median(one_walls) / statistics.median(two_walls), "bit_identical": exact}
    print(f"  {row}", flush=True)
    return row


# ---- 2. TTFT ------------------------------------------------------------------------
def ttft_in_process(model: Path, args, loads) -> dict:
    from epd import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", kv_cache_memory_gb=0.2, video_fps=args.video_fps)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1)

    def one(images, videos):
        parts = [{"type": "image"}] * len(images) + [{"type": "video"}] * len(videos) + [
            {"type": "text", "text": QUESTION}]
        text = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                       tokenize=False)
        mm = {k: v for k, v in (("image", images), ("video", videos)) if v}
        t0 = time.perf_counter()
        r = llm.generate({"prompt": text, "multi_modal_data": mm}, params)[0]
        return time.perf_counter() - t0, len(r.prompt_token_ids)

    one([png(1)], [])  # warm-up
    one([], [mp4(1, 1.0)])
    out = {}
    for name, runs in loads.items():
        got = [one(*r) for r in runs]
        out[name] = {"ttft_s": [g[0] for g in got], "prompt_tokens": got[0][1]}
        print(f"  in-process {name}: p50 {1e3 * statistics.median(out[name]['ttft_s']):.0f} ms", flush=True)
    llm.shutdown()
    return out


def _stream_ttft(client, model: str, parts: list[dict]) -> tuple[float, int]:
    t0 = time.perf_counter()
    first = None
    usage = 0
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage:
            usage = chunk.usage.prompt_tokens
    return (first if first is not None else time.perf_counter() - t0), usage


def ttft_served(model: Path, pools: str, args, loads, log: Path) -> dict:
    import httpx
    from openai import OpenAI

    port = free_port()
    cmd = [sys.executable, "-m", "epd.cli", "launch", "--pools", pools, "--port", str(port), "--model", str(model),
           "--dtype", "float32", "--kv-cache-memory-gb", "0.2", "--video-fps", str(args.video_fps)]
    base = f"http://127.0.0.1:{port}"
    proc = start_server(cmd, base, log, 600.0, env={"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    try:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        name = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        _stream_ttft(client, name, content([png(1)], []))  # warm-up
        _stream_ttft(client, name, content([], [mp4(1, 1.0)]))
        out = {}
        for wl, runs in loads.items():
            got = [_stream_ttft(client, name, content(*r)) for r in runs]
            out[wl] = {"ttft_s": [g[0] for g in got], "prompt_tokens": got[0][1]}
            print(f"  {pools} {wl}: p50 {1e3 * statistics.median(out[wl]['ttft_s']):.0f} ms", flush=True)
        # a text request sent while a video request is in its encode stage
        video_runs = loads[next(k for k in loads if k.startswith("video"))]
        alone, beside = [], []
        for i, (_, _videos) in enumerate(video_runs):
            alone.append(_stream_ttft(client, name, [{"type": "text", "text": f"Say something {i}."}])[0])
            fresh = [mp4(5000 + i, args.ttft_video_s)]
            th = threading.Thread(target=_stream_ttft, args=(client, name, content([], fresh)))
            th.start()
            time.sleep(0.05)
            beside.append(_stream_ttft(client, name, [{"type": "text", "text": f"Say anything {i}."}])[0])
            th.join()
        out["text alone"] = {"ttft_s": alone, "prompt_tokens": None}
        out["text beside video"] = {"ttft_s": beside, "prompt_tokens": None}
        print(f"  {pools} text alone / beside a video: {1e3 * statistics.median(alone):.0f} / "
              f"{1e3 * statistics.median(beside):.0f} ms", flush=True)
        return out
    finally:
        stop_server(proc)


def ttft_split(model: Path, args, tmp: Path) -> dict:
    """TTFT of a fresh ``args.split_video_s`` video per request on one encoder and split over two."""
    loads = {f"video {args.split_video_s:g}s": [([], [mp4(7000 + i, args.split_video_s)]) for i in range(args.runs)]}
    out = {}
    for pools in ("e:1,p:1,d:1", "e:2,p:1,d:1"):
        got = ttft_served(model, pools, args, loads, tmp / f"split-{pools.replace(':', '').replace(',', '-')}.log")
        out[pools] = {k: v for k, v in got.items() if k.startswith("video")}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="video_ttft-"))
    model = build_model(tmp / "qwen2.5-vl", args.vision_hidden, args.vision_depth, args.max_pixels)
    print(f"model {model}: vision {args.vision_hidden} x {args.vision_depth}, max_pixels {args.max_pixels}", flush=True)
    print("1. encode per video second", flush=True)
    encode = encode_per_second(model, args)
    print("3. a long video's tower on one encoder vs split across two", flush=True)
    chunked = chunked_encode(model, args)
    loads = workloads(args.runs, args.ttft_video_s)
    ttft = {}
    print("2. TTFT", flush=True)
    for cfg in args.configs:
        if cfg == "in-process":
            ttft[cfg] = ttft_in_process(model, args, loads)
        else:
            ttft[cfg] = ttft_served(model, CONFIGS[cfg], args, loads, tmp / f"{cfg}.log")

    print(f"\nencode per video second (sampled at {args.video_fps:g} fps; p50 of {args.runs}; 1 torch thread)")
    print(f"{'video':>7} {'grid t,h,w':>12} {'tokens':>7} {'decode+prep ms':>15} {'tower ms':>9} "
          f"{'decode+prep ms/s':>17} {'tower ms/s':>11} {'busy':>5}")
    for r in encode:
        print(f"{r['video_s']:>6g}s {','.join(map(str, r['grid_thw'])):>12} {r['tokens']:>7} "
              f"{r['decode_preprocess_ms']:>15.0f} {r['tower_ms']:>9.0f} "
              f"{r['decode_preprocess_ms_per_video_s']:>17.0f} "
              f"{r['tower_ms_per_video_s']:>11.0f} {r['other_cores_max']:>5.2f}")
    print(f"\n{chunked['video_s']:g} s video ({chunked['tokens']} tokens, grid {chunked['grid_thw']}) tower: "
          f"one encoder {chunked['one_encoder_ms']:.0f} ms, halves on two {chunked['two_encoders_ms']:.0f} ms "
          f"({chunked['speedup']:.2f}x; bit-identical: {chunked['bit_identical']})")
    if ttft:  # --configs may name none (--split alone)
        names = list(next(iter(ttft.values())))
        print(f"\nTTFT p50 ms (min) over {args.runs} requests, fresh media each")
        print(f"{'request':<18} {'tokens':>6} " + " ".join(f"{c:>20}" for c in ttft))
        for n in names:
            toks = next((ttft[c][n]["prompt_tokens"] for c in ttft if n in ttft[c] and ttft[c][n]["prompt_tokens"]),
                        None)
            cells = []
            for c in ttft:
                if n not in ttft[c]:
                    cells.append(f"{'-':>20}")
                    continue
                xs = ttft[c][n]["ttft_s"]
                cells.append(f"{f'{1e3 * statistics.median(xs):.0f} ({1e3 * min(xs):.0f})':>20}")
            print(f"{n:<18} {toks if toks else '':>6} " + " ".join(cells))

    split = None
    if args.split:
        print(f"4. TTFT of a {args.split_video_s:g} s video, one encoder vs split across two", flush=True)
        split = ttft_split(model, args, tmp)
        for pools, res in split.items():
            for wl, r in res.items():
                print(f"  {pools} {wl}: p50 {1e3 * statistics.median(r['ttft_s']):.0f} ms "
                      f"(min {1e3 * min(r['ttft_s']):.0f}), {r['prompt_tokens']} prompt tokens")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": git_commit(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "python": platform.python_version(),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "encode": encode, "chunked": chunked, "ttft": ttft, "split": split}
    (args.out_dir / "video_ttft.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out_dir / 'video_ttft.json'}")
    with contextlib.suppress(OSError):
        import shutil

        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
