"""``epd launch``: the router, the HTTP API and every worker pool on this host."""

from __future__ import annotations

import argparse
import sys
import time

from epd.cli.args import KV_AGENTS_HELP, add_api_args, add_recovery_args, add_routing_args
from epd.cli.validators import positive_int
from epd.launch.config import (
    DTYPE_NAMES,
    KV_AGENTS,
    KV_CACHE_DTYPE_NAMES,
    QUANTIZATION_NAMES,
    WORKER_ENGINE_FLAGS,
    LaunchConfig,
)
from epd.roles import Role


def add_parser(sub) -> None:
    """``epd launch``; every default comes from :class:`~epd.launch.config.LaunchConfig`."""
    d = LaunchConfig()
    la = sub.add_parser("launch", help="serve a model over HTTP with encode/prefill/decode worker pools")
    la.add_argument("--pools", default=d.pools,
                    help="devices (on CPU: processes) per pool: e=encode, p=prefill, d=decode, pd=aggregated "
                         "prefill+decode; e.g. e:2,p:4,d:8 or e:1,pd:2; e:0 runs without an encode pool "
                         "(default: %(default)s)")
    la.add_argument("--tp", default=d.tp,
                    help="tensor-parallel ranks per instance of the p/d/pd pools, e.g. p:4,d:1 (default: 1; "
                         "must divide the pool's devices and the model's heads; encoders have no TP)")
    la.add_argument("--model", default=d.model,
                    help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct")
    la.add_argument("--host", default=d.host, help="HTTP address (default: %(default)s)")
    la.add_argument("--port", type=int, default=d.port, help="HTTP port (default: %(default)s)")
    la.add_argument("--threads-per-worker", type=positive_int, default=d.threads_per_worker,
                    help="fixed torch threads per worker process (default: the thread budget: the host's cores "
                         "go to the workers that have work, cores // busy workers each, step by step)")
    la.add_argument("--router-port", type=int, default=d.router_port,
                    help="router's ZeroMQ port on 127.0.0.1 (default 0: pick a free one)")
    la.add_argument("--ready-timeout", type=float, default=d.ready_timeout, help="seconds to wait for every worker")
    la.add_argument("--cluster-keys", default=d.cluster_keys,
                    help="directory of the CURVE keys every control socket uses (`epd keys generate`) "
                         "(default: $EPD_CLUSTER_KEYS, else fresh keys for this launch only)")
    helps = {"--kv-host-cache-gb": "GiB of host memory per worker for the prefix cache's host tier: evicted "
                                   "blocks are kept and loaded back on a hit (TP 1; default 0: off)",
             "--kv-disk-cache-dir": "directory for the disk tier under the host tier: each worker writes the "
                                    "blocks its host tier evicts to one anonymous file there",
             "--kv-disk-cache-gb": "GiB of disk per worker for that tier (with --kv-disk-cache-dir)",
             "--no-decode-kv-reuse": "decode workers write every prompt block instead of only those after "
                                     "their own cached prefix (A/B runs)",
             "--speculative-config": "speculative decoding for every worker, vLLM's JSON, e.g. '{\"method\": "
                                     "\"ngram\", \"num_speculative_tokens\": 4}' (default: off)"}
    for flag, typ in WORKER_ENGINE_FLAGS:
        if typ is bool:
            la.add_argument(flag, action="store_true", default=getattr(d, flag[2:].replace("-", "_")),
                            help=helps.get(flag, "forwarded to every worker (see `epd worker --help`)"))
            continue
        la.add_argument(flag, type=typ, default=getattr(d, flag[2:].replace("-", "_")),
                        choices={"--dtype": DTYPE_NAMES, "--kv-cache-dtype": KV_CACHE_DTYPE_NAMES,
                                 "--quantization": QUANTIZATION_NAMES}.get(flag),
                        help=helps.get(flag, "forwarded to every worker (default: the worker's)"))
    add_routing_args(la.add_argument_group("routing"), d)
    add_recovery_args(la.add_argument_group("failure recovery"), d)
    add_api_args(la.add_argument_group("OpenAI API"), d)
    la.add_argument("--kv-staging-mb", type=positive_int, default=d.kv_staging_mb,
                    help="staging pool per prefill/decode instance (MiB) for KV transfers when prefill or "
                         "decode is tensor-parallel (default: %(default)s)")
    la.add_argument("--kv-agents", choices=KV_AGENTS, default=d.kv_agents, help=KV_AGENTS_HELP)
    la.set_defaults(func=cmd_launch)


def cmd_launch(args: argparse.Namespace) -> int:
    """Validate the settings and the plan against the model, then serve until stopped; the exit code."""
    import asyncio

    from transformers import AutoConfig

    from epd.launch.ports import check_port_free
    from epd.launch.spec import build_launch_plan
    from epd.models.checkpoints import resolve_model

    t0 = time.monotonic()
    config = LaunchConfig.from_args(args)  # validates --pools and --tp
    http_socket = check_port_free(config.host, config.port, keep=True)  # held until uvicorn serves on it
    path = resolve_model(config.model)
    text_cfg = AutoConfig.from_pretrained(str(path)).get_text_config()
    num_kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
    plan = build_launch_plan(config.pools, config.tp, num_attention_heads=text_cfg.num_attention_heads,
                             num_kv_heads=num_kv_heads)
    worker_args = config.forwarded_worker_args()
    tp = {p.role: p.tp for p in plan}
    if Role.PREFILL in tp and (tp[Role.PREFILL], tp[Role.DECODE]) != (1, 1):
        # KV moves through staging buffers whenever a side is tensor-parallel.
        worker_args += ["--kv-staging-mb", str(config.kv_staging_mb), "--kv-agents", config.kv_agents]
        _check_kv_staging(config, path)
    from epd.launch.api_process import serve

    return asyncio.run(serve(config, path, t0, plan=plan, worker_args=worker_args, http_socket=http_socket))


def _check_kv_staging(config: LaunchConfig, path) -> None:
    """Refuse a ``--kv-staging-mb`` that holds no staging block (one block of K and V of every
    layer and KV head, the unit a staged transfer reserves); warn when the pool caps
    ``max_model_len`` (each prefill/decode instance then lowers its own: epd.engine.llm_engine).

    Raises:
        LaunchSpecError: the pool holds less than one block.
    """
    from epd.config import EngineConfig
    from epd.launch.spec import LaunchSpecError

    kwargs = {k: v for k, v in (("block_size", config.block_size), ("dtype", config.dtype),
                                ("kv_cache_dtype", config.kv_cache_dtype)) if v is not None}
    engine = EngineConfig(str(path), **kwargs)  # TP 1: a staging block holds every KV head
    per_block = engine.kv_bytes_per_block()
    blocks = config.kv_staging_mb * 2**20 // per_block
    if blocks < 1:
        raise LaunchSpecError(
            f"--kv-staging-mb {config.kv_staging_mb} holds no KV staging block: one block ({engine.block_size} tokens "
            f"of K and V, every layer and KV head, {engine.kv_storage_dtype}) is {per_block / 2**20:.2f} MiB; "
            f"use --kv-staging-mb {-(-per_block // 2**20)} or more")
    limit = config.max_model_len or engine.max_model_len
    if blocks * engine.block_size < limit:
        print(f"epd launch: warning: --kv-staging-mb {config.kv_staging_mb} holds {blocks} staging blocks = "
              f"{blocks * engine.block_size} tokens < max_model_len {limit}: max_model_len lowered to "
              f"{blocks * engine.block_size} (a prompt's KV must fit the staging pool)", file=sys.stderr, flush=True)
