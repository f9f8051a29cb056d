"""``epd`` command line: generate, model create-tiny (launch/worker/bench arrive with later issues)."""

from __future__ import annotations

import argparse
import json
import sys
import time


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


def cmd_create_tiny(args: argparse.Namespace) -> int:
    from epd.tiny import create_tiny_model

    path = create_tiny_model(args.kind, args.dir, seed=args.seed)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

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

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    ct = msub.add_parser("create-tiny", help="write a tiny random checkpoint for tests and benchmarks")
    ct.add_argument("kind", choices=["llama", "qwen2", "qwen3", "llava", "llava-siglip", "qwen2-audio"])
    ct.add_argument("dir")
    ct.add_argument("--seed", type=int, default=0)
    ct.set_defaults(func=cmd_create_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from epd.config import ConfigError
    from epd.model_files import ModelLoadError, ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, ModelLoadError, ConfigError) as e:
        print(f"epd {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
