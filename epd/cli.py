"""``epd`` command line: generate, launch, worker, model create-tiny."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from epd.launch_config import KV_FAILURE_POLICIES, ROUTING_POLICIES, WORKER_ENGINE_FLAGS, LaunchConfig
from epd.roles import ROLE_NAMES, Role


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")


def cmd_generate(args: argparse.Namespace) -> int:
    from epd import LLM, SamplingParams
    from epd.errors import InvalidRequestError

    t0 = time.monotonic()
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
              kv_cache_memory_gb=args.kv_cache_memory_gb, dtype=args.dtype, device=args.device)
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


def _non_negative_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return x


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def cmd_worker(args: argparse.Namespace) -> int:
    import logging

    from epd.workers import WorkerArgs, run_worker

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.instance_id} %(levelname)s %(message)s")
    engine_kwargs = {k: getattr(args, k) for k in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                                                   "kv_cache_memory_gb", "num_kv_blocks", "max_model_len")}
    role = Role(args.role)
    run_worker(WorkerArgs(role=role, instance_id=args.instance_id, router=args.router, model=args.model,
                          rank=args.rank, tp=args.tp, threads=args.threads, kv_timeout_s=args.kv_timeout,
                          kv_staging_mb=args.kv_staging_mb,
                          engine_kwargs=engine_kwargs if role != Role.ENCODE else {}))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    import asyncio

    from transformers import AutoConfig

    from epd.launch_spec import build_launch_plan
    from epd.launcher import check_port_free
    from epd.model_files import resolve_model

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
        worker_args += ["--kv-staging-mb", str(config.kv_staging_mb)]
    from epd.api.serve import serve

    return asyncio.run(serve(plan, path, config, t0, worker_args, http_socket=http_socket))


def cmd_create_tiny(args: argparse.Namespace) -> int:
    from pathlib import Path

    from epd.tiny import create_tiny_model

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
    """``epd launch``; every default comes from :class:`~epd.launch_config.LaunchConfig`."""
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
    la.add_argument("--threads-per-worker", type=_positive_int, default=d.threads_per_worker,
                    help="torch threads per worker process (default: usable cores / processes, at least 1)")
    la.add_argument("--router-port", type=int, default=d.router_port,
                    help="router's ZeroMQ port on 127.0.0.1 (default 0: pick a free one)")
    la.add_argument("--ready-timeout", type=float, default=d.ready_timeout, help="seconds to wait for every worker")
    for flag, typ in WORKER_ENGINE_FLAGS:
        la.add_argument(flag, type=typ, default=getattr(d, flag[2:].replace("-", "_")),
                        help="forwarded to every worker (default: the worker's)")
    _add_routing_args(la.add_argument_group("routing"), d)
    _add_recovery_args(la.add_argument_group("failure recovery"), d)
    _add_api_args(la.add_argument_group("OpenAI API"), d)
    la.add_argument("--kv-staging-mb", type=_positive_int, default=d.kv_staging_mb,
                    help="staging pool per prefill/decode instance (MiB) for KV transfers when prefill or "
                         "decode is tensor-parallel (default: %(default)s)")
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
    rt.add_argument("--kv-overlap-weight", type=_non_negative_float, default=d.kv_overlap_weight,
                    help="weight of the blocks still to prefill against the open blocks in the kv policy's cost "
                         "(default: %(default)s; 0 ignores cached prefixes)")


def _add_recovery_args(fr, d: LaunchConfig) -> None:
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
    api.add_argument("--max-pending-requests", type=_positive_int, default=d.max_pending_requests,
                     help="requests in flight at once; more get 429 (default: %(default)s)")
    api.add_argument("--max-n", type=_positive_int, default=d.max_n,
                     help="largest n (choices per request) (default: %(default)s)")
    api.add_argument("--allowed-media-domains", default=d.allowed_media_domains,
                     help="comma-separated hosts whose http(s) image URLs are fetched (subdomains included); "
                          "addresses that resolve to private, loopback or link-local ranges are refused anyway "
                          "(default: none, only data: URLs)")
    api.add_argument("--media-fetch-timeout", type=float, default=d.media_fetch_timeout,
                     help="seconds one media URL fetch may take, redirects included (default: %(default)s)")
    api.add_argument("--max-media-mb", type=float, default=d.max_media_mb,
                     help="largest fetched media body in MiB (default: %(default)s)")
    api.add_argument("--max-realtime-sessions", type=_positive_int, default=d.max_realtime_sessions,
                     help="/v1/realtime sessions open at once; more are closed with code 1013 (default: %(default)s)")
    api.add_argument("--allowed-origins", default=d.allowed_origins,
                     help="comma-separated browser origins (scheme://host[:port], or *) allowed to open /v1/realtime; "
                          "other Origin headers get 403, clients sending none pass (default: none)")


def _add_worker_parser(sub) -> None:
    w = sub.add_parser("worker", help="one worker process (started by `epd launch`, not by hand)")
    w.add_argument("--role", required=True, choices=list(ROLE_NAMES))
    w.add_argument("--instance-id", required=True, help="e.g. prefill-0; the TP ranks of an instance share it")
    w.add_argument("--rank", type=int, default=0, help="TP rank inside the instance, 0..tp-1")
    w.add_argument("--tp", type=_positive_int, default=1, help="TP ranks of the instance")
    w.add_argument("--router", required=True, help="router's ZeroMQ endpoint, e.g. tcp://127.0.0.1:5555")
    w.add_argument("--model", default=None,
                   help="model dir, .gguf file, or omit for the embedded SmolLM2-135M-Instruct")
    w.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    w.add_argument("--kv-timeout", type=float, default=30.0,
                   help="seconds one NIXL transfer (KV, embeddings) may take before it fails (default: %(default)s)")
    w.add_argument("--block-size", type=_positive_int, default=16)
    w.add_argument("--max-num-seqs", type=_positive_int, default=64)
    w.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    w.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    w.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="KV cache size in blocks (overrides --kv-cache-memory-gb)")
    w.add_argument("--max-model-len", type=_positive_int, default=None)
    w.add_argument("--kv-staging-mb", type=int, default=0,
                   help="staging pool (MiB) for KV transfers between different TP layouts (0: none)")
    w.set_defaults(func=cmd_worker)


def _add_model_parser(sub) -> None:
    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    ct = msub.add_parser("create-tiny", help="write a tiny random checkpoint for tests and benchmarks")
    ct.add_argument("kind", choices=["llama", "qwen2", "qwen3", "llava", "llava-siglip", "qwen2-audio"])
    ct.add_argument("dir")
    ct.add_argument("--seed", type=int, default=0)
    ct.add_argument("--force", action="store_true", help="write into a non-empty directory")
    ct.set_defaults(func=cmd_create_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_launch_parser(sub)
    _add_worker_parser(sub)
    _add_model_parser(sub)
    from epd.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)  # `epd bench`: the serving benchmark (epd/bench/)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from epd.config import ConfigError
    from epd.launch_spec import LaunchSpecError
    from epd.model_files import ModelLoadError, ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, ModelLoadError, ConfigError, LaunchSpecError) as e:
        print(f"epd {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"epd {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a user mistake the checks above missed: a message, not a traceback
        if os.environ.get("EPD_DEBUG"):
            raise
        print(f"epd {args.command}: {type(e).__name__}: {e} (set EPD_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
