"""KV transfer prefill -> decode: bytes, time, GB/s against an in-process memcpy.

SmolLM2-135M-Instruct (the embedded default, fp32, 30 layers x 3 KV heads x 64 dims,
16-token blocks of 12 KiB per layer for K and again for V) on the CPU.

Served mode (default): pools ``p:1,d:1`` started in this process as ``epd launch``
does (router + launcher of worker processes). For each prompt length, one request at
a time (``max_tokens=2``, greedy), ``--reps`` times, each with fresh random token ids
(ids < 17 are special and never drawn; no two prompts share a block, so the prefix
cache never hits). The first event of a disaggregated request carries the prefill
worker's ``PrefillDone`` stats; per length the median over the reps of:

* ``kv_bytes``: K and V of every prompt block of every layer;
* ``kv_transfer_s`` (the window): from the first NIXL write (layer 0, issued as soon as
  that layer's K/V is stored) until every write completed;
* ``kv_write_s`` (time inside the write calls; on CPU UCX's cma copies synchronously
  there) and ``kv_exposed_s`` (still in flight after the forward ended); their sum is
  what the KV move costs the request: ``effective GB/s = kv_bytes / (kv_write_s +
  kv_exposed_s)``; the share of the window hidden behind compute is ``1 - that / window``.

Raw mode (``--raw``): two NixlTransport agents in two processes (UCX, as the workers
use), each with a KV cache shaped like the workers'; the initiator posts the same
per-layer writes (one write per layer: the prompt's K blocks and V blocks) back to
back, no compute, and busy-polls until all complete. Two block layouts: contiguous
ids on both sides (NIXL coalesces each layer's K and V into one descriptor each) and
random ids on both sides (one 12 KiB descriptor per block). Best of 5 after a warm-up.

memcpy baseline (both modes): the same number of blocks per layer for K and V between
two tensors shaped like the KV cache, in this process, one torch thread (UCX moves
the bytes with one thread as well), best of 5: ``index`` = random block ids,
``dst[l].index_copy_(0, dst_ids, src[l].index_select(0, src_ids))``; ``contig`` = ids
0..n-1, one ``copy_`` per layer for K and for V (a single-pass memcpy).

    python benchmarks/kv_transfer.py              # served p:1,d:1 + memcpy
    python benchmarks/kv_transfer.py --raw        # NIXL only + memcpy
    python benchmarks/kv_transfer.py --all        # both
    python benchmarks/kv_transfer.py --quick      # smoke run: 128 and 1024 tokens, 1 rep
    python benchmarks/kv_transfer.py --lengths 8192 --reps 1   # add / redo one length
    python benchmarks/kv_transfer.py --report-only              # table + plot from the JSON

Writes benchmarks/results/kv_transfer.json and kv_transfer.png. Results are merged by
length: lengths and modes this run did not measure keep their earlier values (each row
has its ``measured_at``).

On a CPU the UCX transport is cma (process_vm_writev): a NIXL WRITE is copied inside
``write()`` by the calling thread and is already done when it returns (raw mode reports
this as ``*_done_at_post``). The prefill worker's per-layer writes therefore run in the
forward's own thread, serially: ``kv_exposed_s`` is ~0 and the "hidden" share ~100 %
by construction, while the copy time sits inside ``prefill_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

NUM_SPECIAL_IDS = 17  # SmolLM2's ids 0..16 are special tokens: never drawn into prompts
DEFAULT_LENGTHS = (128, 512, 1024, 2048, 4096, 8192)
TARGET_RATIO = 0.5  # the target: effective >= 50 % of memcpy at >= 1024 tokens
TARGET_MIN_TOKENS = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true", help="NIXL only between two processes (no workers)")
    mode.add_argument("--all", action="store_true", help="served mode, then raw mode")
    mode.add_argument("--report-only", action="store_true",
                      help="measure nothing: print the table and redraw the plot from the saved JSON")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help=f"prompt lengths (default {' '.join(map(str, DEFAULT_LENGTHS))}); a length at or above "
                        "the model's max_position_embeddings (8192) is sent as max-1 tokens (same blocks)")
    p.add_argument("--reps", type=int, default=3, help="requests per length in served mode (median reported)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 and 1024 tokens, 1 rep")
    p.add_argument("--num-kv-blocks", type=int, default=640,
                   help="KV cache blocks of each worker (and of the raw / memcpy caches); 640 x 16 tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads per worker (default: all usable cores; requests run one at a time, "
                        "so only one worker computes at once)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per request (also the router's stage deadline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths = args.lengths or [128, 1024]
        args.reps = 1
    args.lengths = sorted(set(args.lengths or DEFAULT_LENGTHS))
    if args.reps < 1 or any(n < 1 for n in args.lengths):
        p.error("--reps and --lengths must be >= 1")
    return args


# ---------------------------------------------------------------------------- geometry
class Geometry:
    """KV cache shape of the model on one worker: [layers, blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, model_dir: Path, block_size: int, num_blocks: int) -> None:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
        self.layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_pos = cfg.max_position_embeddings
        self.vocab = cfg.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.elem = 4  # fp32 on the CPU
        self.block_bytes = block_size * self.kv_heads * self.head_dim * self.elem

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layers, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)

    def prompt_tokens(self, length: int) -> int:
        """Tokens actually sent for a nominal length (the engine needs prompt < max_model_len)."""
        return min(length, self.max_pos - 1)

    def blocks(self, length: int) -> int:
        return -(-self.prompt_tokens(length) // self.block_size)

    def kv_bytes(self, length: int) -> int:
        return 2 * self.layers * self.blocks(length) * self.block_bytes


def _gbps(nbytes: float, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


# ---------------------------------------------------------------------------- memcpy
def measure_memcpy(geo: Geometry, lengths: list[int], seed: int, repeats: int = 5) -> dict:
    """In-process block copies of the same bytes, one torch thread, best of ``repeats``."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(seed)
        src_k = torch.randn(geo.shape, generator=g)
        src_v = torch.randn(geo.shape, generator=g)
        dst_k = torch.ones(geo.shape)
        dst_v = torch.ones(geo.shape)
        out = {}
        rng = np.random.default_rng(seed)
        for length in lengths:
            n = geo.blocks(length)
            nbytes = geo.kv_bytes(length)
            src_ids = torch.from_numpy(rng.permutation(geo.num_blocks)[:n].astype(np.int64))
            dst_ids = torch.from_numpy(rng.permutation(geo.num_blocks)[:n].astype(np.int64))

            def index_copy() -> None:
                for layer in range(geo.layers):
                    dst_k[layer].index_copy_(0, dst_ids, src_k[layer].index_select(0, src_ids))
                    dst_v[layer].index_copy_(0, dst_ids, src_v[layer].index_select(0, src_ids))

            def contig_copy() -> None:
                for layer in range(geo.layers):
                    dst_k[layer, :n].copy_(src_k[layer, :n])
                    dst_v[layer, :n].copy_(src_v[layer, :n])

            res = {"kv_bytes": nbytes, "blocks": n}
            index_copy()
            assert torch.equal(dst_k[geo.layers - 1, dst_ids], src_k[geo.layers - 1, src_ids])
            for name, fn in (("index", index_copy), ("contig", contig_copy)):
                fn()  # warm-up (page faults, allocator)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                res[f"{name}_s"] = min(times)
                res[f"{name}_gbps"] = _gbps(nbytes, min(times))
            out[str(length)] = res
        return out
    finally:
        torch.set_num_threads(old_threads)


# ---------------------------------------------------------------------------- raw NIXL
def _raw_target(conn, name: str, shape: tuple[int, ...]) -> None:
    """Target process: registers a K and a V cache, drives UCX (get_notifs) until told to stop."""
    torch.set_num_threads(1)
    from epd.transfer import NixlTransport

    transport = NixlTransport(name)
    k = torch.zeros(shape)
    v = torch.zeros(shape)
    regions = transport.register([k, v])
    conn.send({"metadata": transport.metadata(), "regions": regions})
    try:
        while True:
            if not conn.poll(0.0002):
                transport.get_notifs()
                continue
            cmd, *args = conn.recv()
            if cmd == "checksum":  # sum of blocks `ids` of layer `layer`, K and V
                layer, ids = args
                idx = torch.tensor(ids, dtype=torch.int64)
                conn.send(float(k[layer, idx].double().sum() + v[layer, idx].double().sum()))
            elif cmd == "close":
                conn.send(True)
                return
    finally:
        transport.close()


def measure_raw(geo: Geometry, lengths: list[int], seed: int, repeats: int = 5) -> dict:
    """Per-layer NIXL writes of each length's blocks, back to back, between two processes."""
    from epd.transfer import NixlTransport

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_target, args=(child, "kvraw-decode", geo.shape), daemon=True)
    proc.start()
    child.close()
    out: dict = {}
    transport = None
    try:
        if not conn.poll(120):
            raise RuntimeError("raw target process did not start within 120 s")
        info = conn.recv()
        g = torch.Generator().manual_seed(seed + 1)
        k = torch.randn(geo.shape, generator=g)
        v = torch.randn(geo.shape, generator=g)
        transport = NixlTransport("kvraw-prefill")
        (k_loc, v_loc) = transport.register([k, v])
        peer = transport.add_peer(info["metadata"], list(info["regions"]))
        k_rem, v_rem = info["regions"]
        layer_bytes = geo.num_blocks * geo.block_bytes
        bb = geo.block_bytes
        rng = np.random.default_rng(seed + 2)

        def layer_descs(base_k, base_v, layer: int, ids: np.ndarray) -> np.ndarray:
            kb = base_k[0] + layer * layer_bytes + ids * bb
            vb = base_v[0] + layer * layer_bytes + ids * bb
            addrs = np.concatenate([kb, vb])
            return np.stack([addrs, np.full_like(addrs, bb), np.zeros_like(addrs)], axis=1)

        def one_round(src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[float, float, int, int]:
            """(seconds first post -> all done, seconds spent posting, descriptors, writes done when posted)."""
            plans = [(layer_descs(k_loc, v_loc, layer, src_ids), layer_descs(k_rem, v_rem, layer, dst_ids))
                     for layer in range(geo.layers)]
            t0 = time.perf_counter()
            xfers = [transport.write(peer, loc, rem) for loc, rem in plans]
            t_post = time.perf_counter() - t0
            done_at_post = sum(t.done for t in xfers)
            pending = list(xfers)
            deadline = time.monotonic() + 60
            while pending:
                pending = [t for t in pending if not t.poll()]
                if pending and time.monotonic() > deadline:
                    for t in pending:
                        t.release()
                    raise RuntimeError("raw NIXL writes not done after 60 s")
            return time.perf_counter() - t0, t_post, sum(t.num_descs for t in xfers), done_at_post

        # Connection set-up and first-touch costs, not timed.
        one_round(np.arange(4), np.arange(4))
        for length in lengths:
            n = geo.blocks(length)
            nbytes = geo.kv_bytes(length)
            res: dict = {"kv_bytes": nbytes, "blocks": n, "num_writes": geo.layers}
            layouts = {"contig": (np.arange(n), np.arange(n)),
                       "scattered": (rng.permutation(geo.num_blocks)[:n], rng.permutation(geo.num_blocks)[:n])}
            for name, (src_ids, dst_ids) in layouts.items():
                one_round(src_ids, dst_ids)  # warm-up
                times, posts, descs, done_at_post = [], [], 0, 0
                for _ in range(repeats):
                    dt, post, descs, done_at_post = one_round(src_ids, dst_ids)
                    times.append(dt)
                    posts.append(post)
                res[f"{name}_s"] = min(times)
                res[f"{name}_post_share"] = statistics.median(p / t for p, t in zip(posts, times))
                res[f"{name}_done_at_post"] = done_at_post
                res[f"{name}_median_s"] = statistics.median(times)
                res[f"{name}_gbps"] = _gbps(nbytes, min(times))
                res[f"{name}_descs"] = descs
            # The bytes arrived: last layer's scattered blocks, summed on both sides.
            layer = geo.layers - 1
            conn.send(("checksum", layer, [int(i) for i in dst_ids]))
            remote_sum = conn.recv()
            idx = torch.from_numpy(src_ids.astype(np.int64))
            local_sum = float(k[layer, idx].double().sum() + v[layer, idx].double().sum())
            if abs(remote_sum - local_sum) > 1e-6 * max(1.0, abs(local_sum)):
                raise RuntimeError(f"raw NIXL check failed at {length} tokens: {remote_sum} != {local_sum}")
            out[str(length)] = res
            print(f"  raw {length:5d} tokens: contig {res['contig_gbps']:6.2f} GB/s "
                  f"({res['contig_descs']} descs), scattered {res['scattered_gbps']:6.2f} GB/s "
                  f"({res['scattered_descs']} descs); time spent inside write() (posting): "
                  f"{res['contig_post_share']:.0%} / {res['scattered_post_share']:.0%}, writes already done "
                  f"when write() returned: {res['contig_done_at_post']} / {res['scattered_done_at_post']} "
                  f"of {geo.layers}", flush=True)
        return out
    finally:
        if transport is not None:
            transport.close()
        try:
            if proc.is_alive():
                conn.send(("close",))
                conn.poll(10) and conn.recv()
        except (OSError, EOFError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# ---------------------------------------------------------------------------- served
async def _served(args, geo: Geometry, model_dir: Path, log_dir: Path, sink: dict) -> None:
    from epd import metrics
    from epd.launch.spec import build_launch_plan
    from epd.launch.supervisor import Launcher
    from epd.router.router import Router, RouterRequest
    from epd.sampling_params import SamplingParams

    plan = build_launch_plan("p:1,d:1", None, num_attention_heads=geo.heads, num_kv_heads=geo.kv_heads)
    metrics.setup_multiprocess_dir()
    threads = args.threads_per_worker or len(os.sched_getaffinity(0))
    max_len = min(geo.max_pos, max(geo.prompt_tokens(n) for n in args.lengths) + 2)
    worker_args = ["--max-model-len", str(max(max_len, 256)), "--num-kv-blocks", str(args.num_kv_blocks),
                   "--block-size", str(args.block_size)]
    # The router's default 120 s stage deadline is too short for 8192 tokens on a busy CPU.
    router = Router(stage_timeout_s=args.request_timeout, token_timeout_s=args.request_timeout)
    await router.start()
    launcher = Launcher(plan, model=str(model_dir), router_endpoint=router.endpoint, threads_per_worker=threads,
                        extra_worker_args=worker_args, log_dir=log_dir)
    gen = torch.Generator().manual_seed(args.seed)
    rows: dict = sink.setdefault("results", {})
    sink["config"] = {"pools": "p:1,d:1", "threads_per_worker": threads, "worker_args": worker_args,
                      "reps": args.reps, "max_num_batched_tokens": "worker default (2048)"}
    try:
        t0 = time.monotonic()
        launcher.start()

        def check_children() -> None:
            dead = launcher.poll_dead()
            if dead:
                raise RuntimeError("worker died during start-up: " + "; ".join(d.describe() for d in dead))

        await router.wait_ready({"prefill": 1, "decode": 1}, args.ready_timeout, on_poll=check_children)
        print(f"  workers ready in {time.monotonic() - t0:.1f} s ({threads} threads each; "
              f"{' '.join(worker_args)})", flush=True)

        async def one(rid: str, length: int) -> dict:
            n = geo.prompt_tokens(length)
            prompt = torch.randint(NUM_SPECIAL_IDS, geo.vocab, (n,), generator=gen).tolist()
            req = RouterRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2))
            stats = None
            t_start = time.perf_counter()

            async def consume() -> None:
                nonlocal stats
                async for ev in router.generate(req):
                    if stats is None:
                        stats = ev.prefill_stats
            await asyncio.wait_for(consume(), args.request_timeout)
            if stats is None:
                raise RuntimeError(f"{rid}: first event carried no prefill_stats")
            dead = launcher.poll_dead()
            if dead:
                raise RuntimeError("worker died: " + "; ".join(d.describe() for d in dead))
            return dict(stats, wall_s=time.perf_counter() - t_start, prompt_tokens=n)

        await one("kv-warmup", 64)  # NIXL connection set-up, first-touch of the caches
        for length in args.lengths:
            samples = []
            for rep in range(args.reps):
                s = await one(f"kv-{length}-{rep}", length)
                samples.append(s)
                print(f"  {length:5d} tokens rep {rep}: {s['kv_bytes'] / 1e6:7.1f} MB, transfer "
                      f"{s['kv_transfer_s'] * 1e3:8.1f} ms, exposed {s['kv_exposed_s'] * 1e3:7.1f} ms, prefill "
                      f"{s['prefill_s'] * 1e3:8.1f} ms, {s['num_transfer_requests']} writes", flush=True)
            med = {k: statistics.median(s[k] for s in samples)
                   for k in ("kv_bytes", "kv_transfer_s", "kv_exposed_s", "kv_write_s", "prefill_s", "queue_s",
                             "wall_s")}
            # Time the KV move costs the request: inside the (synchronous, on CPU) writes
            # during the forward, plus whatever was still in flight after it.
            cost = [s["kv_write_s"] + s["kv_exposed_s"] for s in samples]
            # Share of the in-flight window (first write .. last completion) that overlapped
            # compute: 1 - cost / window. On CPU the cma copies run inside write(), so this
            # is the share of the window that was other layers' compute.
            hidden = [1.0 - c / s["kv_transfer_s"] for c, s in zip(cost, samples) if s["kv_transfer_s"] > 0]
            med["hidden_share"] = statistics.median(hidden) if hidden else None
            med["kv_cost_s"] = statistics.median(cost)
            med["effective_gbps"] = _gbps(med["kv_bytes"], med["kv_cost_s"])
            med["window_gbps"] = _gbps(med["kv_bytes"], med["kv_transfer_s"])
            med["exposed_only_gbps_upper"] = _gbps(med["kv_bytes"], med["kv_exposed_s"])
            med["num_transfer_requests"] = samples[0]["num_transfer_requests"]
            med["prompt_tokens"] = samples[0]["prompt_tokens"]
            med["samples"] = samples
            med["reps"] = len(samples)
            if med["kv_bytes"] != geo.kv_bytes(length):
                print(f"  warning: {length} tokens moved {med['kv_bytes']} B, expected {geo.kv_bytes(length)} B",
                      flush=True)
            rows[str(length)] = med
    finally:
        try:
            await router.stop()
        finally:
            launcher.stop()


def measure_served(args, geo: Geometry, model_dir: Path, sink: dict) -> None:
    """Fills ``sink`` ({"config", "results": {length: medians}}) as lengths complete."""
    log_dir = Path(tempfile.mkdtemp(prefix="epd-kv-transfer-logs-"))
    try:
        asyncio.run(_served(args, geo, model_dir, log_dir, sink))
    except BaseException:
        print(f"served run failed; worker logs in {log_dir}:", file=sys.stderr)
        for f in sorted(log_dir.glob("*.log")):
            tail = f.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {f.name}\n" + "\n".join(tail), file=sys.stderr)
        raise


# ---------------------------------------------------------------------------- report
def build_rows(data: dict, lengths: list[int]) -> list[dict]:
    served = (data.get("served") or {}).get("results", {})
    raw = (data.get("raw") or {}).get("results", {})
    mem = (data.get("memcpy") or {}).get("results", {})
    rows = []
    for length in lengths:
        key = str(length)
        s, r, m = served.get(key, {}), raw.get(key, {}), mem.get(key, {})
        kv = s.get("kv_bytes") or r.get("kv_bytes") or m.get("kv_bytes")
        eff, idx, ctg = s.get("effective_gbps"), m.get("index_gbps"), m.get("contig_gbps")
        raw_s, raw_c = r.get("scattered_gbps"), r.get("contig_gbps")
        rows.append({
            "tokens": length, "kv_bytes": kv, "kv_transfer_s": s.get("kv_transfer_s"),
            "prefill_s": s.get("prefill_s"), "kv_exposed_s": s.get("kv_exposed_s"), "kv_cost_s": s.get("kv_cost_s"),
            "hidden_share": s.get("hidden_share"), "effective_gbps": eff,
            "raw_scattered_gbps": raw_s, "raw_contig_gbps": raw_c,
            "memcpy_index_gbps": idx, "memcpy_contig_gbps": ctg,
            "effective_over_memcpy": eff / idx if eff and idx else None,
            "effective_over_memcpy_contig": eff / ctg if eff and ctg else None,
            "raw_over_memcpy": raw_s / idx if raw_s and idx else None,
            "raw_contig_over_memcpy_contig": raw_c / ctg if raw_c and ctg else None,
        })
    return rows


def format_table(rows: list[dict]) -> str:
    def f(v, fmt, scale=1.0):
        if v is None:
            return "-"
        v *= scale
        if fmt.endswith("g3"):  # 3 significant digits, without exponent for the small values here
            return f"{v:.3f}" if v >= 0.1 else f"{v:.2g}" if v >= 1e-3 else f"{v:.1e}"
        return format(v, fmt)

    head = ("| tokens | KV MB | window ms | prefill ms | KV cost ms | hidden | effective GB/s "
            "| raw NIXL GB/s (scattered / contig) | memcpy GB/s (index / contig) | effective / memcpy "
            "| raw / memcpy |")
    sep = "|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {f(r['kv_bytes'], '.1f', 1e-6)} | {f(r['kv_transfer_s'], '.1f', 1e3)} "
            f"| {f(r['prefill_s'], '.1f', 1e3)} | {f(r.get('kv_cost_s'), '.1f', 1e3)} "
            f"| {f(r['hidden_share'], '.0%')} | {f(r['effective_gbps'], 'g3')} "
            f"| {f(r['raw_scattered_gbps'], '.2f')} / {f(r['raw_contig_gbps'], '.2f')} "
            f"| {f(r['memcpy_index_gbps'], '.2f')} / {f(r['memcpy_contig_gbps'], '.2f')} "
            f"| {f(r['effective_over_memcpy'], 'g3')} "
            f"| {f(r['raw_over_memcpy'], '.2f')} / {f(r['raw_contig_over_memcpy_contig'], '.2f')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series = (("effective_gbps", "served: effective (bytes / time inside writes + exposed)", "o-", "C0"),
              ("raw_scattered_gbps", "raw NIXL, scattered blocks", "s--", "C1"),
              ("raw_contig_gbps", "raw NIXL, contiguous blocks", "s:", "C1"),
              ("memcpy_index_gbps", "memcpy, index_select + index_copy_", "^--", "C2"),
              ("memcpy_contig_gbps", "memcpy, contiguous copy_", "^:", "C2"))
    for key, label, style, color in series:
        pts = [(r["tokens"], r[key]) for r in rows if r.get(key)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["tokens"] for r in rows])
    ax.set_xticklabels([str(r["tokens"]) for r in rows])
    ax.set_xlabel("prompt tokens")
    ax.set_yscale("log")  # the served effective rate is 3 orders of magnitude below the others on a CPU
    ax.set_ylabel("GB/s (log scale)")
    ax.set_title("KV transfer prefill -> decode, SmolLM2-135M fp32, CPU (UCX)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from epd.models.checkpoints import resolve_model

    model_dir = resolve_model(None)
    geo = Geometry(model_dir, args.block_size, args.num_kv_blocks)
    if geo.blocks(max(args.lengths)) > args.num_kv_blocks:
        print(f"--num-kv-blocks {args.num_kv_blocks} cannot hold {max(args.lengths)} tokens", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "kv_transfer.json"
    if args.report_only:
        data = json.loads(json_path.read_text())
        rows = build_rows(data, data.get("lengths") or args.lengths)
        plot(rows, args.out_dir / "kv_transfer.png")
        print(format_table(rows))
        return 0
    data: dict = {}
    if json_path.exists():
        try:
            data = json.loads(json_path.read_text())
        except ValueError:
            data = {}
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    data["machine"] = {"platform": platform.platform(), "cores": len(os.sched_getaffinity(0)),
                       "torch": torch.__version__, "python": platform.python_version()}
    data["model"] = {"dir": str(model_dir), "layers": geo.layers, "kv_heads": geo.kv_heads,
                     "head_dim": geo.head_dim, "dtype": "float32", "block_size": geo.block_size,
                     "block_bytes": geo.block_bytes, "num_kv_blocks": geo.num_blocks,
                     "max_position_embeddings": geo.max_pos}
    print(f"KV of one 16-token block: {geo.block_bytes} B per layer for K (same for V); "
          f"{geo.kv_bytes(8192) / 1e6:.0f} MB for 8192 tokens", flush=True)
    if geo.max_pos <= max(args.lengths):
        print(f"note: prompts of >= {geo.max_pos} tokens are sent as {geo.max_pos - 1} tokens "
              f"(max_position_embeddings {geo.max_pos}; same number of blocks)", flush=True)

    def _term(signum, frame):  # `timeout` / kill: unwind so that workers are stopped and results saved
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    def merge(section: str, new: dict) -> None:
        """New per-length results replace old ones of the same length; other lengths are kept."""
        old = data.get(section) or {}
        results = dict(old.get("results") or {})
        for key, row in (new.get("results") or {}).items():
            results[key] = dict(row, measured_at=stamp)
        data[section] = dict(old, **{k: v for k, v in new.items() if k != "results"}, results=results)

    if not args.raw:
        print("served mode: p:1,d:1", flush=True)
        served: dict = {}
        try:
            measure_served(args, geo, model_dir, served)
        except BaseException:
            if served.get("results"):
                merge("served", served)
                json_path.write_text(json.dumps(data, indent=2))
                print(f"partial served results saved to {json_path}", file=sys.stderr)
            raise
        merge("served", served)
    if args.raw or args.all:
        print("raw mode: NIXL between two processes", flush=True)
        merge("raw", {"results": measure_raw(geo, args.lengths, args.seed)})
    print("memcpy baseline (1 thread)", flush=True)
    merge("memcpy", {"results": measure_memcpy(geo, args.lengths, args.seed)})

    lengths = sorted(set(args.lengths) | {int(k) for sec in ("served", "raw", "memcpy")
                                          for k in (data.get(sec) or {}).get("results", {})})
    data["lengths"] = lengths
    rows = build_rows(data, lengths)
    data["table"] = rows
    big = [r for r in rows if r["tokens"] >= TARGET_MIN_TOKENS and r["effective_over_memcpy"] is not None]
    if big:
        data["target"] = {"ratio": TARGET_RATIO, "min_tokens": TARGET_MIN_TOKENS,
                          "met": all(r["effective_over_memcpy"] >= TARGET_RATIO for r in big),
                          "baseline": "memcpy index_select + index_copy_ (1 thread)"}
    json_path.write_text(json.dumps(data, indent=2))
    plot(rows, args.out_dir / "kv_transfer.png")
    print()
    print(format_table(rows))
    if "target" in data:
        print(f"\ntarget effective >= {TARGET_RATIO:.0%} of memcpy at >= {TARGET_MIN_TOKENS} tokens: "
              f"{'met' if data['target']['met'] else 'NOT met'}")
    print(f"wrote {json_path} and {args.out_dir / 'kv_transfer.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
