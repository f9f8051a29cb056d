"""``epd`` command line: generate, launch, serve, worker, keys generate, model create-tiny, bench, diagnose, plan."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from epd.launch.config import (DTYPE_NAMES, KV_CACHE_DTYPE_NAMES, KV_FAILURE_POLICIES, ROUTING_POLICIES,
                               TOOL_CALL_PARSERS, VIDEO_ENCODE_SPLITS, WORKER_ENGINE_FLAGS, KV_AGENTS, LaunchConfig,
                               int_list)
from epd.cli.validators import non_negative_float, non_negative_int, positive_float, positive_int
from epd.roles import ROLE_NAMES, Role

_KV_CACHE_DTYPE_HELP = ("KV cache: auto (the model's dtype), or quantized, int8 or fp8_e4m3 (fp8): 1 byte a value "
                        "plus 4 bytes per 16 values of each token and KV head (int8: a float16 scale and min, and a "
                        "full block's K per channel, KIVI-style; fp8: a float32 scale): 3.2x the fp32 blocks per GB "
                        "at head_dim 64; prefill and decode workers must use the same (the router refuses a mismatch)")


_KV_AGENTS_HELP = ("NIXL agents of a tensor-parallel prefill/decode instance: rank0 (one agent, rank 0's, moves a "
                   "staging pool every rank maps) or per-rank (every rank owns an agent, its KV and its own staging "
                   "buffer and writes its own KV heads, as vLLM's NixlConnector); prefill and decode must use the "
                   "same (default: %(default)s)")


def _tts_engine(text: str) -> str:
    """argparse type of ``--tts-engine``: an engine name or a voice directory (epd.tts.check_engine)."""
    from epd.tts import check_engine

    try:
        return check_engine(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                   help="model and KV cache dtype (default: auto: bfloat16 where the device computes it natively)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto", help=_KV_CACHE_DTYPE_HELP)
    p.add_argument("--device", default="auto")


def cmd_generate(args: argparse.Namespace) -> int:
    from epd import LLM, SamplingParams
    from epd.errors import InvalidRequestError

    t0 = time.monotonic()
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
              kv_cache_memory_gb=args.kv_cache_memory_gb, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, device=args.device)
    load_s = time.monotonic() - t0
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, stop=args.stop or None)
    except ValueError as e:
        print(f"epd generate: {e}", file=sys.stderr)
        return 2
    tok = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None))
    t1 = time.monotonic()
    try:
        if use_chat:
            out = llm.chat([{"role": "user", "content": p} for p in [args.prompt]], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
    except InvalidRequestError as e:
        print(f"epd generate: {e}", file=sys.stderr)
        return 2
    gen_s = time.monotonic() - t1
    comp = out.outputs[0]
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": comp.text, "token_ids": comp.token_ids,
                          "finish_reason": comp.finish_reason, "prompt_tokens": len(out.prompt_token_ids),
                          "completion_tokens": len(comp.token_ids), "load_s": round(load_s, 3),
                          "generate_s": round(gen_s, 3)}))
    else:
        print(comp.text)
        print(f"[{len(comp.token_ids)} tokens in {gen_s:.2f} s, finish_reason={comp.finish_reason}, "
              f"model loaded in {load_s:.1f} s]", file=sys.stderr)
    llm.shutdown()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import logging
    import signal

    from epd.workers import WorkerArgs, run_worker

    from epd.cluster_auth import load_keys, require_keys

    for name, env in (("instance_id", "EPD_INSTANCE_ID"), ("router", "EPD_ROUTER")):
        if not getattr(args, name):
            print(f"epd worker: --{name.replace('_', '-')} (or ${env}) is required", file=sys.stderr)
            return 2
    if args.rank != 0:
        print("epd worker: --rank must be 0: rank 0 of an instance starts its other TP ranks itself (--tp N); "
              "TP ranks on other hosts are not supported", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.instance_id} %(levelname)s %(message)s")
    keys = load_keys(args.cluster_keys)
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
                                 kv_timeout_s=args.kv_timeout, kv_staging_mb=args.kv_staging_mb, keys=keys,
                                 kv_agents=args.kv_agents,
                                 http_port=args.http_port, drain_timeout_s=args.drain_timeout,
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


def cmd_launch(args: argparse.Namespace) -> int:
    import asyncio

    from transformers import AutoConfig

    from epd.launch.spec import build_launch_plan
    from epd.launch.ports import check_port_free
    from epd.models.checkpoints import resolve_model

    t0 = time.monotonic()
    config = LaunchConfig.from_args(args)  # validates --pools and --tp
    http_socket = check_port_free(config.host, config.port, keep=True)  # held until uvicorn serves on it
    path = resolve_model(config.model)
    text_cfg = AutoConfig.from_pretrained(str(path)).get_text_config()
    plan = build_launch_plan(config.pools, config.tp, num_attention_heads=text_cfg.num_attention_heads,
                             num_kv_heads=getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads)
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


def cmd_serve(args: argparse.Namespace) -> int:
    """``epd serve``: the router and the API only; workers join with ``epd worker``."""
    import asyncio

    from epd.launch.api_process import serve
    from epd.cluster_auth import load_keys, require_keys
    from epd.launch.spec import parse_pools
    from epd.launch.ports import check_port_free
    from epd.models.checkpoints import resolve_model

    t0 = time.monotonic()
    config = LaunchConfig.from_args(args)
    require_keys(config.router_host, load_keys(config.cluster_keys), "router's control socket", "--router-host")
    min_pools = dict(parse_pools(config.pools))
    http_socket = check_port_free(config.host, config.port, keep=True)
    check_port_free(config.router_host, config.router_port, flag="--router-port")
    path = resolve_model(config.model)
    return asyncio.run(serve(config, path, t0, http_socket=http_socket, min_pools=min_pools))


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from epd.cluster_auth import generate_keys

    secret = generate_keys(args.dir, force=args.force)
    print(f"wrote {secret.parent / 'cluster.key'} and {secret} (keep the secret private; give the directory to "
          f"every epd process of the cluster with --cluster-keys {args.dir} or $EPD_CLUSTER_KEYS)")
    return 0


def cmd_create_tiny(args: argparse.Namespace) -> int:
    from pathlib import Path

    from epd.models.tiny import create_tiny_model

    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        print(f"epd model create-tiny: {out} exists and is not an empty directory; pick a new path "
              f"or pass --force to write into it", file=sys.stderr)
        return 2
    path = create_tiny_model(args.kind, args.dir, seed=args.seed)
    print(path)
    return 0


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text offline for one prompt")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)


def _add_launch_parser(sub) -> None:
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
    for flag, typ in WORKER_ENGINE_FLAGS:
        if typ is bool:
            la.add_argument(flag, action="store_true", default=getattr(d, flag[2:].replace("-", "_")),
                            help="forwarded to every worker (see `epd worker --help`)")
            continue
        la.add_argument(flag, type=typ, default=getattr(d, flag[2:].replace("-", "_")),
                        choices={"--dtype": DTYPE_NAMES, "--kv-cache-dtype": KV_CACHE_DTYPE_NAMES}.get(flag),
                        help="forwarded to every worker (default: the worker's)")
    _add_routing_args(la.add_argument_group("routing"), d)
    _add_recovery_args(la.add_argument_group("failure recovery"), d)
    _add_api_args(la.add_argument_group("OpenAI API"), d)
    la.add_argument("--kv-staging-mb", type=positive_int, default=d.kv_staging_mb,
                    help="staging pool per prefill/decode instance (MiB) for KV transfers when prefill or "
                         "decode is tensor-parallel (default: %(default)s)")
    la.add_argument("--kv-agents", choices=KV_AGENTS, default=d.kv_agents, help=_KV_AGENTS_HELP)
    la.set_defaults(func=cmd_launch)


def _add_routing_args(rt, d: LaunchConfig) -> None:
    rt.add_argument("--encode-routing", choices=ROUTING_POLICIES[Role.ENCODE], default=d.encode_routing,
                    help="encode pool: media-affinity sends a repeated image/clip to the encoder that cached it "
                         "(rendezvous hashing on the item hash; least-loaded when that one is overloaded) "
                         "(default: %(default)s)")
    rt.add_argument("--prefill-routing", choices=ROUTING_POLICIES[Role.PREFILL], default=d.prefill_routing,
                    help="prefill and pd pools: kv picks the lowest overlap-weight x blocks still to prefill + open "
                         "blocks, from the block hashes each instance's prefix cache reports (default: %(default)s)")
    rt.add_argument("--decode-routing", choices=ROUTING_POLICIES[Role.DECODE], default=d.decode_routing,
                    help="decode pool: free-kv picks the most free KV blocks after reservations, then the smallest "
                         "running batch (default: %(default)s)")
    rt.add_argument("--video-encode-split", choices=VIDEO_ENCODE_SPLITS, default=d.video_encode_split,
                    help="auto: with 2+ live encoders, a Qwen-VL video of 2+ temporal patches is encoded in "
                         "contiguous chunks of temporal patches, one per encoder (exact: the tower attends within "
                         "a patch); off: a request's items all go to one encoder (default: %(default)s)")
    rt.add_argument("--kv-overlap-weight", type=non_negative_float, default=d.kv_overlap_weight,
                    help="weight of the blocks still to prefill against the open blocks in the kv policy's cost "
                         "(default: %(default)s; 0 ignores cached prefixes)")


def _add_recovery_args(fr, d: LaunchConfig, launcher: bool = True) -> None:
    fr.add_argument("--max-retries", type=int, default=d.max_retries,
                    help="further attempts of a request on other instances after a worker dies, hangs or fails a "
                         "transfer; a decode worker lost mid-stream migrates its requests (default: %(default)s; "
                         "0 disables)")
    fr.add_argument("--kv-failure-policy", choices=list(KV_FAILURE_POLICIES), default=d.kv_failure_policy,
                    help="a failed or timed-out P->D KV transfer is retried through prefill (retry) or the decode "
                         "worker prefills the prompt itself (recompute) (default: %(default)s)")
    fr.add_argument("--stage-timeout", type=float, default=d.stage_timeout,
                    help="seconds a request may wait for one stage (encode, KV reservation, prefill) "
                         "(default: %(default)s)")
    fr.add_argument("--token-timeout", type=float, default=d.token_timeout,
                    help="seconds a request may wait between two tokens (default: %(default)s)")
    if not launcher:
        return
    fr.add_argument("--kv-timeout", type=float, default=d.kv_timeout,
                    help="seconds a worker waits for one NIXL transfer before failing it (default: the worker's, 30)")
    fr.add_argument("--max-worker-restarts", type=int, default=d.max_worker_restarts,
                    help="times the launcher restarts each crashed worker instance (default: %(default)s; "
                         "0: never)")


def _add_api_args(api, d: LaunchConfig) -> None:
    api.add_argument("--api-key", default=d.api_key,
                     help="require 'Authorization: Bearer KEY' on /v1 requests (default: $EPD_API_KEY, else none)")
    api.add_argument("--max-body-mb", type=float, default=d.max_body_mb,
                     help="largest request body in MiB; larger ones get 413 (default: %(default)s)")
    api.add_argument("--max-pending-requests", type=positive_int, default=d.max_pending_requests,
                     help="requests in flight at once; more get 429 (default: %(default)s)")
    api.add_argument("--max-n", type=positive_int, default=d.max_n,
                     help="largest n (choices per request) (default: %(default)s)")
    api.add_argument("--allowed-media-domains", default=d.allowed_media_domains,
                     help="comma-separated hosts whose http(s) image URLs are fetched (subdomains included); "
                          "addresses that resolve to private, loopback or link-local ranges are refused anyway "
                          "(default: none, only data: URLs)")
    api.add_argument("--media-fetch-timeout", type=float, default=d.media_fetch_timeout,
                     help="seconds one media URL fetch may take, redirects included (default: %(default)s)")
    api.add_argument("--max-media-mb", type=float, default=d.max_media_mb,
                     help="largest fetched media body in MiB (default: %(default)s)")
    api.add_argument("--video-fps", type=positive_float, default=d.video_fps,
                     help="frames sampled per second of a video_url's video; a request's "
                          "media_io_kwargs.video.fps overrides it (default: %(default)s)")
    api.add_argument("--max-video-frames", type=positive_int, default=d.max_video_frames,
                     help="most frames sampled from one video (longer videos are sampled more sparsely, uniformly "
                          "over their duration); a request's media_io_kwargs.video.num_frames may ask for fewer "
                          "(default: %(default)s)")
    api.add_argument("--max-video-seconds", type=positive_float, default=d.max_video_seconds,
                     help="longest video accepted, from its header and again while decoding; longer ones get "
                          "400 (default: %(default)s)")
    api.add_argument("--max-realtime-sessions", type=positive_int, default=d.max_realtime_sessions,
                     help="/v1/realtime sessions open at once; more are closed with code 1013 (default: %(default)s)")
    api.add_argument("--allowed-origins", default=d.allowed_origins,
                     help="comma-separated browser origins (scheme://host[:port], or *) allowed to open /v1/realtime; "
                          "other Origin headers get 403, clients sending none pass (default: none)")
    api.add_argument("--served-model-name", nargs="+", default=d.served_model_name, metavar="NAME",
                     help="the model names the API answers to (requests naming another get 404); the first is "
                          "the one it reports, in /v1/models and every response (default: the --model path, or "
                          "SmolLM2-135M-Instruct)")
    api.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=d.tool_call_parser,
                     help="the format the model writes tool calls in: hermes <tool_call>{...}</tool_call> "
                          "(Qwen2.5/3, SmolLM3, Hermes), llama3_json, mistral [TOOL_CALLS] "
                          "(default: detected from the chat template, else hermes)")


def _add_serve_parser(sub) -> None:
    """``epd serve``: the API and router; the pools join it (``epd worker``)."""
    d = LaunchConfig()
    s = sub.add_parser("serve", help="serve the HTTP API and the router; worker pools join from any host "
                                     "(`epd worker --router tcp://HOST:PORT`)")
    s.add_argument("--model", default=d.model,
                   help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct (the workers' model)")
    s.add_argument("--host", default=d.host, help="HTTP address (default: %(default)s)")
    s.add_argument("--port", type=int, default=d.port, help="HTTP port (default: %(default)s)")
    s.add_argument("--router-host", default=d.router_host,
                   help="address the router's ZeroMQ socket binds; anything but loopback needs --cluster-keys "
                        "(default: %(default)s)")
    s.add_argument("--router-port", type=int, default=5557, help="router's ZeroMQ port (default: %(default)s)")
    s.add_argument("--pools", default=d.pools,
                   help="live instances each pool needs before /health answers 200, e.g. e:1,p:1,d:1 or p:1,d:1 "
                        "(default: %(default)s)")
    s.add_argument("--cluster-keys", default=d.cluster_keys,
                   help="directory of the cluster's CURVE keys (`epd keys generate`) (default: $EPD_CLUSTER_KEYS)")
    s.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output served (default: the model's)")
    _add_routing_args(s.add_argument_group("routing"), d)
    _add_recovery_args(s.add_argument_group("failure recovery"), d, launcher=False)
    _add_api_args(s.add_argument_group("OpenAI API"), d)
    s.set_defaults(func=cmd_serve)


def _add_keys_parser(sub) -> None:
    k = sub.add_parser("keys", help="the cluster's CURVE keys")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    g = ksub.add_parser("generate", help="write a new cluster key pair into DIR (cluster.key, cluster.key_secret)")
    g.add_argument("dir")
    g.add_argument("--force", action="store_true", help="replace keys already there")
    g.set_defaults(func=cmd_keys_generate)


def _add_worker_parser(sub) -> None:
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
    w.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto", help=_KV_CACHE_DTYPE_HELP)
    w.add_argument("--tts-engine", default="espeak", type=_tts_engine,
                   help="a tts worker's synthesizer: espeak (eSpeak NG, embedded; default), or the directory "
                        "of a Piper voice, NAME.onnx + NAME.onnx.json (needs epd[piper]; see epd.tts.load_synthesizer)")
    w.add_argument("--compile", action="store_true",
                   help="run the model through torch.compile (slower start, faster steps on GPUs)")
    w.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    w.add_argument("--cuda-graph-sizes", type=int_list, default=None,
                   help="decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (default: 1,2,4 and multiples "
                        "of 8 up to --max-num-seqs; CUDA at TP 1 only)")
    w.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    w.add_argument("--num-kv-blocks", type=positive_int, default=None,
                   help="KV cache size in blocks (overrides --kv-cache-memory-gb)")
    w.add_argument("--max-model-len", type=positive_int, default=None)
    w.add_argument("--kv-staging-mb", type=int, default=0,
                   help="staging pool (MiB) for KV transfers between different TP layouts (0: none)")
    w.add_argument("--kv-agents", choices=KV_AGENTS, default="rank0", help=_KV_AGENTS_HELP)
    w.set_defaults(func=cmd_worker)


def _add_model_parser(sub) -> None:
    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    ct = msub.add_parser("create-tiny", help="write a tiny random checkpoint for tests and benchmarks")
    ct.add_argument("kind", choices=["llama", "qwen2", "qwen3", "llava", "llava-siglip", "qwen2-audio", "qwen2-vl", "qwen2.5-vl"])
    ct.add_argument("dir")
    ct.add_argument("--seed", type=int, default=0)
    ct.add_argument("--force", action="store_true", help="write into a non-empty directory")
    ct.set_defaults(func=cmd_create_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_launch_parser(sub)
    _add_serve_parser(sub)
    _add_worker_parser(sub)
    _add_keys_parser(sub)
    _add_model_parser(sub)
    from epd.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)  # `epd bench`: the serving benchmark (epd/bench/)
    from epd.diagnose import add_parser as add_diagnose_parser

    add_diagnose_parser(sub)  # `epd diagnose`: a running server's bottleneck from its /metrics (epd/diagnose.py)
    from epd.plan import add_parser as add_plan_parser

    add_plan_parser(sub)  # `epd plan`: profile a server, size the pools for a workload and SLOs (epd/plan.py)
    return parser


def _catch_signals_while_starting() -> list[int]:
    """SIGTERM / SIGINT caught from here on, before the slow imports (torch) and the
    model load: a worker signalled while it starts (a pod deleted, an autoscaler's
    churn) exits 0 instead of dying by the signal, and one signalled after its
    imports but before its loop runs has them replayed (it drains)."""
    import signal

    caught: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    return caught


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors that are the user's to fix (exit code 2). Imported only once one is raised:
    ``epd.config`` imports torch, which commands such as ``diagnose`` never need."""
    from epd.cluster_auth import ClusterKeysError
    from epd.config import ConfigError
    from epd.launch.spec import LaunchSpecError
    from epd.models.checkpoints import ModelLoadError, ModelNotFoundError

    return ModelNotFoundError, ModelLoadError, ConfigError, LaunchSpecError, ClusterKeysError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.func is cmd_worker:
        args.early_signals = _catch_signals_while_starting()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"epd {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(e, _user_errors()):
            print(f"epd {args.command}: {e}", file=sys.stderr)
            return 2
        # a user mistake the checks above missed: a message, not a traceback
        if os.environ.get("EPD_DEBUG"):
            raise
        print(f"epd {args.command}: {type(e).__name__}: {e} (set EPD_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1

