"""``epd generate``: text for one prompt, offline (an in-process ``epd.LLM``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from epd.cli.args import add_engine_args


def add_parser(sub) -> None:
    """Register ``epd generate`` on the subparsers ``sub``."""
    g = sub.add_parser("generate", help="generate text offline for one prompt")
    add_engine_args(g)
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


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate and print the completion (``--json``: one JSON object); 2 on invalid sampling settings."""
    from epd import LLM, SamplingParams
    from epd.errors import InvalidRequestError

    t0 = time.monotonic()
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
              kv_cache_memory_gb=args.kv_cache_memory_gb, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, device=args.device)
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
