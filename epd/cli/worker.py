"""``epd worker``: one worker process that joins a router (``epd serve`` or ``epd launch``) from any host."""

from __future__ import annotations

import argparse
import os
import sys

from epd.cli.args import KV_AGENTS_HELP, KV_CACHE_DTYPE_HELP, QUANTIZATION_HELP
from epd.cli.validators import non_negative_float, non_negative_int, positive_int
from epd.launch.config import (
    DTYPE_NAMES,
    KV_AGENTS,
    KV_CACHE_DTYPE_NAMES,
    QUANTIZATION_NAMES,
    WORKER_ENGINE_FLAGS,
    int_list,
)
from epd.roles import ROLE_NAMES, Role


def _tts_engine(text: str) -> str:
    """argparse type of ``--tts-engine``: an engine name or a voice directory (epd.tts.check_engine)."""
    from epd.tts import check_engine

    try:
        return check_engine(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub) -> None:
    """Register ``epd worker`` on the subparsers ``sub``."""
    w = sub.add_parser("worker", help="one worker process: joins a router (`epd serve`) from any host")
    w.add_argument("--role", required=True, choices=list(ROLE_NAMES))
    w.add_argument("--instance-id", default=os.environ.get("EPD_INSTANCE_ID"),
                   help="unique per instance, e.g. prefill-0 or the pod name; the TP ranks of an instance share it "
                        "(default: $EPD_INSTANCE_ID)")
    w.add_argument("--rank", type=int, default=0,
                   help="TP rank inside the instance: 0 (rank 0 starts ranks 1..tp-1 itself, on this host)")
    w.add_argument("--tp", type=positive_int, default=1, help="TP ranks of the instance")
    w.add_argument("--router", default=os.environ.get("EPD_ROUTER"),
                   help="router's ZeroMQ endpoint, e.g. tcp://10.0.0.5:5557 (default: $EPD_ROUTER)")
    w.add_argument("--advertise-host", default=os.environ.get("EPD_ADVERTISE_HOST", "127.0.0.1"),
                   help="this host's address peers reach it on: the command socket and UCX bind there; anything "
                        "but loopback needs --cluster-keys (default: $EPD_ADVERTISE_HOST, else 127.0.0.1)")
    w.add_argument("--cluster-keys", default=None,
                   help="directory of the cluster's CURVE keys (`epd keys generate`) (default: $EPD_CLUSTER_KEYS)")
    w.add_argument("--http-port", type=int, default=0,
                   help="serve GET /health (200 once the router has this worker, 503 while draining), /live and "
                        "/metrics on the advertised address (default: 0, off)")
    w.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                   help="seconds a SIGTERM'd worker may take to finish or hand off its requests before it exits "
                        "(default: %(default)s; 0: stop at once)")
    w.add_argument("--stall-timeout", type=non_negative_float, default=60.0,  # epd.workers.base.STALL_TIMEOUT_S
                   help="seconds the main loop may spend in one iteration (the longest engine step) before the "
                        "worker counts as wedged: the router routes nothing to it and /live answers 503 "
                        "(default: %(default)s; 0: never)")
    w.add_argument("--ucx-net-devices", default=None,
                   help="UCX network devices for NIXL transfers, e.g. eth0 or mlx5_0:1 (default: $UCX_NET_DEVICES, "
                        "else the interface holding --advertise-host); UCX_TLS passes through from the environment")
    w.add_argument("--model", default=None,
                   help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct")
    w.add_argument("--threads", type=positive_int, default=None,
                   help="fixed torch threads (default: the thread budget: this host's cores shared by the "
                        "workers that have work, see epd.workers.thread_budget)")
    w.add_argument("--kv-timeout", type=float, default=30.0,
                   help="seconds one NIXL transfer (KV, embeddings) may take before it fails (default: %(default)s)")
    w.add_argument("--embedding-ttl", type=float, default=1.0,
                   help="seconds an encode worker keeps a request's embeddings after the router ended the request "
                        "(its reader released them or is gone) before reclaiming them; never while the request "
                        "runs (default: %(default)s)")
    w.add_argument("--block-size", type=positive_int, default=16)
    w.add_argument("--max-num-seqs", type=positive_int, default=64)
    w.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    w.add_argument("--max-prefill-tokens-with-decodes", type=non_negative_int, default=256,
                   help="prefill tokens per step while requests decode (stall-free batching; 0: off; "
                        "default: %(default)s)")
    w.add_argument("--target-step-ms", type=non_negative_float, default=100.0,
                   help="while requests decode, keep each step's predicted time under this many ms by "
                        "bounding its prefill tokens (stall-free batching on a step-time model fitted to "
                        "the worker's own steps; 0: off, tokens capped only; default: %(default)s)")
    w.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                   help="model and KV cache dtype (default: auto: bfloat16 where the device computes it "
                        "natively (AVX512_BF16/AMX CPUs, bf16 GPUs), else float32); every prefill and decode "
                        "worker of a deployment must use the same")
    w.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto", help=KV_CACHE_DTYPE_HELP)
    w.add_argument("--quantization", choices=QUANTIZATION_NAMES, default=None, help=QUANTIZATION_HELP)
    w.add_argument("--tts-engine", default="espeak", type=_tts_engine,
                   help="a tts worker's synthesizer: espeak (eSpeak NG, embedded; default), or the directory "
                        "of a Piper voice, NAME.onnx + NAME.onnx.json (needs epd[piper]; see epd.tts.load_synthesizer)")
    w.add_argument("--compile", action="store_true",
                   help="run the model through torch.compile (slower start, faster steps on GPUs)")
    w.add_argument("--enforce-eager", action="store_true",
                   help="every step on the eager modules: no fused CPU decode step, no CUDA graphs")
    w.add_argument("--cuda-graph-sizes", type=int_list, default=None,
                   help="decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (default: 1,2,4 and multiples "
                        "of 8 up to --max-num-seqs; CUDA at TP 1 only)")
    w.add_argument("--speculative-config", default=None,
                   help="speculative decoding, as vLLM takes it: a JSON object, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (n-gram prompt lookup; greedy "
                        "requests without penalties, grammar or logprobs speculate; default: off)")
    w.add_argument("--no-decode-kv-reuse", action="store_true",
                   help="decode: do not look reservations up in this instance's prefix cache, so the prefill "
                        "worker writes every prompt block (default: only the blocks after the cached prefix)")
    w.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    w.add_argument("--kv-host-cache-gb", type=float, default=0.0,
                   help="host memory (GiB) for the prefix cache's host tier: evicted full blocks are kept there "
                        "and loaded back on a later hit instead of recomputed (default 0: off; TP 1 only)")
    w.add_argument("--kv-disk-cache-dir", default=None,
                   help="directory for the prefix cache's disk tier under the host tier: blocks the host tier "
                        "evicts are written to one anonymous file there (gone with the process) and read back "
                        "on a hit (needs --kv-host-cache-gb and --kv-disk-cache-gb)")
    w.add_argument("--kv-disk-cache-gb", type=float, default=0.0,
                   help="size (GiB) of the disk tier's file (default 0: off)")
    w.add_argument("--num-kv-blocks", type=positive_int, default=None,
                   help="KV cache size in blocks (overrides --kv-cache-memory-gb)")
    w.add_argument("--max-model-len", type=positive_int, default=None)
    w.add_argument("--kv-staging-mb", type=int, default=0,
                   help="staging pool (MiB) for KV transfers between different TP layouts (0: none)")
    w.add_argument("--kv-agents", choices=KV_AGENTS, default="rank0", help=KV_AGENTS_HELP)
    w.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    """Run the worker until it shuts down or drains; its exit code (2: a missing or refused flag)."""
    import logging
    import signal

    from epd.cluster_auth import MEMBER, load_keys, require_keys
    from epd.workers import WorkerArgs, run_worker

    for name, env in (("instance_id", "EPD_INSTANCE_ID"), ("router", "EPD_ROUTER")):
        if not getattr(args, name):
            print(f"epd worker: --{name.replace('_', '-')} (or ${env}) is required", file=sys.stderr)
            return 2
    if args.rank != 0:
        print("epd worker: --rank must be 0: rank 0 of an instance starts its other TP ranks itself (--tp N); "
              "TP ranks on other hosts are not supported", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.instance_id} %(levelname)s %(message)s")
    keys = load_keys(args.cluster_keys, MEMBER)
    require_keys(args.advertise_host, keys, "worker's command socket", "--advertise-host")
    _set_ucx_devices(args.advertise_host, args.ucx_net_devices)
    engine_kwargs = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                     for flag, _ in WORKER_ENGINE_FLAGS}
    role = Role(args.role)
    tts_engine = engine_kwargs.pop("tts_engine")  # the tts pool's; the engine pools' are the rest
    early_signals = args.early_signals
    if early_signals:
        print(f"epd worker {args.instance_id}: {signal.Signals(early_signals[0]).name} while starting: "
              "drained in 0.00 s (it had joined nothing)", flush=True)
        return 0
    return run_worker(WorkerArgs(role=role, instance_id=args.instance_id, router=args.router, model=args.model,
                                 rank=args.rank, tp=args.tp, threads=args.threads, host=args.advertise_host,
                                 kv_timeout_s=args.kv_timeout, embedding_ttl_s=args.embedding_ttl,
                                 kv_staging_mb=args.kv_staging_mb, keys=keys,
                                 kv_agents=args.kv_agents,
                                 http_port=args.http_port, drain_timeout_s=args.drain_timeout,
                                 stall_timeout_s=args.stall_timeout,
                                 engine_kwargs=(engine_kwargs if role not in (Role.ENCODE, Role.TTS) else
                                                {"tts_engine": tts_engine} if role == Role.TTS else {}),
                                 early_signals=early_signals))


def _set_ucx_devices(host: str, devices: str | None) -> None:
    """UCX (NIXL's data plane) uses ``devices`` (``--ucx-net-devices``), else what
    ``$UCX_NET_DEVICES`` says, else the interface that holds ``host``: a worker's
    NIXL traffic goes where its control socket is advertised, never every interface."""
    from epd.cluster_auth import is_loopback

    if devices:
        os.environ["UCX_NET_DEVICES"] = devices
        return
    if os.environ.get("UCX_NET_DEVICES"):
        return
    if is_loopback(host):
        os.environ["UCX_NET_DEVICES"] = "lo"
        return
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == host.strip("[]") for a in addrs):
            os.environ["UCX_NET_DEVICES"] = name
            return
    raise ValueError(f"no network interface of this host has the address {host} (--advertise-host): "
                     "pass one of its own addresses")
