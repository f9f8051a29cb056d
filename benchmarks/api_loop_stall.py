"""Event-loop stalls in the API process: ``/health`` latency and other streams' ITL
while a 1,000-item realtime session responds.

Every stream, the router's receive loop and ``/health`` share the API process's one
asyncio loop, so CPU work on it (chat templates, tokenization, media decoding, the
realtime history re-render) stalls all of them. This benchmark launches ``epd launch``
on a tiny Llama (``epd model create-tiny llama``, random weights; ``--pools pd:1``,
0.05 GB of KV cache, so the context is small), then:

1. opens a ``/v1/realtime`` WebSocket and adds ``--items`` conversation items (default
   999: with the response's answer, 1,000, the session limit; alternating user / assistant text of ~``--item-chars``
   characters each), far more than the context holds: the response must drop the
   oldest items (OpenAI's ``truncation: "auto"``);
2. starts ``--streams`` streamed chat completions (``ignore_eos``, restarted until the
   end) and a thread that polls ``GET /health`` every ``--health-interval-ms``;
3. after ``--baseline-s`` of that, sends ``response.create`` and waits for ``response.done``.

Reported, in the window from ``response.create`` to ``response.done`` ("during") and
in the ``--baseline-s`` before it ("baseline"): ``/health`` round-trip latency and the
chat streams' inter-token latency (time between consecutive content chunks of one
stream), p50 / p99 / max; the realtime response's time to ``response.created``, first
delta and ``response.done``.

    python benchmarks/api_loop_stall.py --label after        # launches its own server
    python benchmarks/api_loop_stall.py --label before --url http://127.0.0.1:8000

Results merge by ``--label`` into benchmarks/results/api_loop_stall.json (and
api_loop_stall.png when matplotlib is there). On a shared machine with few cores other
processes move these numbers; the load average at start and end goes into the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import websockets
from _common import ROOT, git_commit, launch, stop_launched

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above "
         "quiet hills and rivers run to the sea").split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an epd server to measure (default: launch one on a tiny llama)")
    p.add_argument("--pools", default="pd:1", help="pools of the launched server")
    p.add_argument("--label", default="run", help="the name of this run in the JSON (e.g. before / after)")
    p.add_argument("--items", type=int, default=999,
                   help="conversation items before the response (its answer makes 1,000, the session limit)")
    p.add_argument("--item-chars", type=int, default=120, help="about this many characters per item")
    p.add_argument("--streams", type=int, default=3, help="concurrent streamed chat completions")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each chat completion")
    p.add_argument("--health-interval-ms", type=float, default=20.0, help="pause between /health polls")
    p.add_argument("--baseline-s", type=float, default=3.0, help="seconds measured before response.create")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args(argv)


def item_text(i: int, chars: int) -> str:
    words, n = [], 0
    k = i
    while n < chars:
        w = WORDS[k % len(WORDS)]
        words.append(w)
        n += len(w) + 1
        k = k * 7 + 3
    return f"{i}: " + " ".join(words)


def poll_health(url: str, interval_s: float, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """(start time, round-trip seconds) of each ``GET /health`` until ``stop``; in its own thread."""
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            t = time.perf_counter()
            client.get(url + "/health")
            out.append((t, time.perf_counter() - t))
            stop.wait(interval_s)


async def chat_stream(client: httpx.AsyncClient, model: str, max_tokens: int, stop: asyncio.Event,
                      out: list[tuple[float, float]], errors: list[tuple[float, str]]) -> None:
    """Streamed chat completions back to back until ``stop``; (arrival time, gap seconds)
    of each content chunk after a stream's first; (time, text) of each failed request."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        last = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                errors.append((time.perf_counter(), f"{r.status_code} {(await r.aread()).decode()[:200]}"))
                await asyncio.sleep(0.2)
                continue
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"error"' in line:
                    errors.append((time.perf_counter(), line[6:206]))
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if last is not None:
                    out.append((now, now - last))
                last = now


async def realtime_session(url: str, model: str, args) -> tuple[websockets.ClientConnection, int]:
    """A realtime socket holding ``args.items`` items (all acknowledged); its max_output_tokens."""
    ws = await websockets.connect(url.replace("http", "ws", 1) + f"/v1/realtime?model={model}",
                                  max_size=2**24, ping_interval=None)  # a stalled server misses pings
    await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": 16}}))
    for i in range(args.items):
        role, kind = ("user", "input_text") if i % 2 == 0 else ("assistant", "output_text")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": role, "content": [{"type": kind, "text": item_text(i, args.item_chars)}]}}))
    created = 0
    while created < args.items:
        ev = json.loads(await ws.recv())
        if ev["type"] == "error":
            raise RuntimeError(f"realtime error event: {ev['error']}")
        created += ev["type"] == "conversation.item.created"
    return ws, 16


def stats(xs: list[float]) -> dict:
    """p50 / p99 / max / n of ``xs`` (seconds)."""
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, round(q * (len(s) - 1)))]  # noqa: E731
    return {"n": len(s), "p50": at(0.5), "p99": at(0.99), "max": s[-1]}


async def measure(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await client.post("/v1/chat/completions", json={"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "warm up"}]})
        ws, _ = await realtime_session(url, model, args)
        health: list[tuple[float, float]] = []
        itl: list[tuple[float, float]] = []
        errors: list[tuple[float, str]] = []
        stop_health, stop_streams = threading.Event(), asyncio.Event()
        poller = threading.Thread(target=poll_health, args=(url, args.health_interval_ms / 1000, stop_health,
                                                            health), daemon=True)
        poller.start()
        streams = [asyncio.create_task(chat_stream(client, model, args.max_tokens, stop_streams, itl, errors))
                   for _ in range(args.streams)]
        try:
            await asyncio.sleep(args.baseline_s)
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create"}))
            marks: dict[str, float] = {}
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 600))
                now = time.perf_counter() - t0
                if ev["type"] == "error":
                    raise RuntimeError(f"realtime error event: {ev['error']}")
                if ev["type"] == "response.created":
                    marks["created_s"] = now
                elif ev["type"] == "response.output_text.delta":
                    marks.setdefault("first_delta_s", now)
                elif ev["type"] == "response.done":
                    marks["done_s"] = now
                    done = ev["response"]
                    break
            t1 = time.perf_counter()
        finally:
            stop_streams.set()
            stop_health.set()
            await asyncio.gather(*streams, return_exceptions=True)
            poller.join(120)
            await ws.close()
    base = (t0 - args.baseline_s, t0)
    during = (t0, t1)
    pick = lambda xs, w: [d for t, d in xs if w[0] <= t < w[1]]  # noqa: E731
    usage = done.get("usage") or {}
    return {"realtime": {**marks, "status": done["status"], "input_tokens": usage.get("input_tokens"),
                         "status_details": done.get("status_details")},
            "health_baseline": stats(pick(health, base)), "health_during": stats(pick(health, during)),
            "itl_baseline": stats(pick(itl, base)), "itl_during": stats(pick(itl, during)),
            "chat_errors": [(t - t0, e) for t, e in errors],
            "health_samples": [(t - t0, d) for t, d in health], "itl_samples": [(t - t0, d) for t, d in itl]}


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.8 * len(runs)), squeeze=False)
    for ax, (label, run) in zip(axes[:, 0], runs.items()):
        h = run["health_samples"]
        i = run["itl_samples"]
        ax.plot([t for t, _ in h], [d * 1000 for _, d in h], ".", ms=3, label="/health latency")
        ax.plot([t for t, _ in i], [d * 1000 for _, d in i], ".", ms=3, label="chat stream ITL")
        ax.axvspan(0, run["realtime"]["done_s"], color="orange", alpha=0.15, label="realtime response")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{label}: {run['items']} items, response.done after {run['realtime']['done_s']:.2f} s",
                     fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds after response.create")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, url = None, args.url
    tmp = tempfile.TemporaryDirectory(prefix="epd-loop-stall-")
    if url is None:
        # in a child process: this one never imports torch, so its own GC pauses (a big heap) do not
        # show up as server latency
        model_dir = str(Path(tmp.name) / "llama")
        subprocess.run([sys.executable, "-m", "epd.cli", "model", "create-tiny", "llama", model_dir], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"launching epd ({args.pools}, tiny llama) ...", flush=True)
        proc, url = launch(args.pools, "--model", model_dir, "--kv-cache-memory-gb", "0.05")
    load_start = os.getloadavg()
    try:
        run = asyncio.run(measure(url, args))
    finally:
        if proc is not None:
            stop_launched(proc)
        tmp.cleanup()
    run.update(items=args.items, item_chars=args.item_chars, streams=args.streams, pools=args.pools,
               git_commit=git_commit(), loadavg_start=load_start, loadavg_end=os.getloadavg(),
               cpu_count=os.cpu_count(), platform=platform.platform())

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "api_loop_stall.json"
    runs = json.loads(json_path.read_text())["runs"] if json_path.exists() else {}
    runs[args.label] = run
    json_path.write_text(json.dumps({"benchmark": "api_loop_stall", "runs": runs}, indent=1) + "\n")

    ms = lambda s: "-" if s is None else f"{s * 1000:.1f}"  # noqa: E731
    print(f"\n{'run':>10} | {'window':>8} | {'/health p50 / p99 / max (n)':>30} | {'ITL p50 / p99 / max (n)':>30}")
    print("-" * 90)
    for label, r in runs.items():
        for w in ("baseline", "during"):
            h, i = r[f"health_{w}"], r[f"itl_{w}"]
            print(f"{label:>10} | {w:>8} | {ms(h['p50']):>7} / {ms(h['p99']):>7} / {ms(h['max']):>7} ({h['n']:>4}) "
                  f"| {ms(i['p50']):>7} / {ms(i['p99']):>7} / {ms(i['max']):>7} ({i['n']:>4})")
    print("(ms; during: response.create -> response.done)")
    for label, r in runs.items():
        rt = r["realtime"]
        print(f"{label}: realtime response {rt['status']}, {rt['input_tokens']} prompt tokens; created "
              f"{ms(rt.get('created_s'))} ms, first delta {ms(rt.get('first_delta_s'))} ms, done "
              f"{ms(rt.get('done_s'))} ms after response.create; {len(r['chat_errors'])} chat requests failed")
        if rt["status"] != "completed":
            print(f"  {rt['status_details']}")
    try:
        png_path = args.out_dir / "api_loop_stall.png"
        plot(runs, png_path)
        print(f"\nwrote {json_path} and {png_path}")
    except ImportError:
        print(f"\nwrote {json_path} (no matplotlib: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
