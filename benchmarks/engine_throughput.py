"""Offline throughput: epd's engine vs transformers ``model.generate`` (static batch).

SmolLM2-135M-Instruct (the embedded default) on the device epd picks by default (the CPU
here, fp32; transformers runs on the same device, fp32), torch threads set to ``--threads``
(default: all cores) for both. For each concurrency C, C requests of ``--prompt-len`` random prompt
tokens and exactly ``--output-len`` greedy output tokens (ignore_eos / min_new_tokens):

* epd: all C prompts passed to one ``LLM.generate`` call (continuous batching, default
  engine settings); wall time of that call, after a short warm-up call.
* transformers: one ``model.generate`` call on the [C, prompt_len] batch (every prompt
  has the same length, so no padding; an all-ones attention_mask is passed), after one
  warm-up call.

Reported: output tokens/s (C * output_len / wall seconds) of each and epd/transformers.
Every run uses prompts no earlier call has seen, so epd's prefix cache never hits.
A sanity check compares the first 16 greedy tokens of both at concurrency 1.

Other busy processes distort CPU timings badly (torch's threads compete for the cores),
so each timed call records how many cores other processes kept busy meanwhile
(``other_cores``, from /proc/stat); above ``--max-other-load`` the call is repeated once
the machine is quiet (``--retries``) and the fastest attempt is reported.

    python benchmarks/engine_throughput.py              # 1 / 8 / 32, 128 + 128 tokens
    python benchmarks/engine_throughput.py --quick      # smoke run: 1 / 4, 32 + 32 tokens

``--dtype`` (default auto: bf16 on a CPU with AVX512_BF16/AMX) sets epd's dtype, and
transformers runs at the same one. Also reported: this machine's GEMM rate at that dtype
(an [1024, 1024] product) and the share of it epd's matmul FLOPs reach (prompt and output
tokens x 2 x matmul parameters / wall time).

Writes benchmarks/results/engine_throughput_<fp32|bf16>.json and .png (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from _common import machine_busy_s, self_cpu_s

NUM_SPECIAL_IDS = 17  # SmolLM2's ids 0..16 are special tokens: never drawn into prompts
SANITY_TOKENS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="numbers of concurrent requests (default 1 8 32; --quick: 1 4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 128)")
    p.add_argument("--quick", action="store_true", help="smoke run: concurrency 1 4, 32 prompt + 32 output tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch intra-op threads for both engines (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--retries", type=int, default=3,
                   help="time a call again (up to this many times) when other processes were busy during it; "
                        "the fastest attempt is reported")
    p.add_argument("--max-other-load", type=float, default=0.1,
                   help="cores other processes may keep busy (average) during a timed call (default 0.1)")
    p.add_argument("--skip-transformers", action="store_true", help="time epd only (e.g. for profiling)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="epd's dtype (auto: bf16 where the CPU computes it natively); transformers runs at the "
                        "same dtype")
    p.add_argument("--quantization", choices=("int8",), default=None,
                   help="epd's weight quantization (int8: weight-only, per output channel); transformers stays at "
                        "--dtype")
    p.add_argument("--enforce-eager", action="store_true",
                   help="epd without its fused CPU decode step (every step on the eager modules): the reference")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency = args.concurrency or [1, 4]
        args.prompt_len = args.prompt_len or 32
        args.output_len = args.output_len or 32
    args.concurrency = args.concurrency or [1, 8, 32]
    args.prompt_len = args.prompt_len or 128
    args.output_len = args.output_len or 128
    return args


class PromptPool:
    """Fresh random prompts on every call (one generator), so no two runs share a prefix."""

    def __init__(self, vocab_size: int, prompt_len: int, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab_size, self.prompt_len = vocab_size, prompt_len

    def take(self, n: int, length: int | None = None) -> list[list[int]]:
        ids = torch.randint(NUM_SPECIAL_IDS, self.vocab_size, (n, length or self.prompt_len), generator=self.gen)
        return ids.tolist()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_epd(llm, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from epd import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    bad = [len(t) for t in tokens if len(t) != output_len]
    if bad:
        raise RuntimeError(f"epd produced {bad[0]} tokens for a request, expected {output_len}")
    return wall, tokens


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], output_len: int, pad_id: int) -> tuple[float, list[list[int]]]:
    input_ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    attention_mask = torch.ones_like(input_ids)
    _sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad_id,
                         temperature=None, top_p=None, top_k=None)
    _sync()
    wall = time.perf_counter() - t0
    new = out[:, input_ids.shape[1]:]
    if new.shape[1] != output_len:
        raise RuntimeError(f"transformers produced {new.shape[1]} tokens, expected {output_len}")
    return wall, new.cpu().tolist()


def gemm_rate(dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    """This machine's GEMM rate (GFLOP/s) at ``dtype``: an [n, n] @ [n, n] product, best of 3."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n ** 3 / best / 1e9


def _linear_params(model) -> int:
    """Weights of the decoder's linear layers (packed on the CPU: their N x K)."""
    from epd.layers.linear import _Linear

    return sum(m.packed.out_features * m.packed.in_features if m.packed is not None else m.weight.numel()
               for m in model.modules() if isinstance(m, _Linear))


def _lm_head_params(llm) -> int:
    """Parameters of the LM head's matmul (a tied head shares the embedding's weight)."""
    cfg = llm.engine.config.text_config
    return cfg.vocab_size * cfg.hidden_size if getattr(cfg, "tie_word_embeddings", False) else 0


class OtherLoad:
    """CPU seconds other processes used while the block ran: a contention check.

    Another busy process on a machine with few cores slows torch's threads a lot, so every timed
    call records this as ``other_cpu_s`` (near 0 on an idle machine).
    """

    def __enter__(self):
        self.m0, self.s0 = machine_busy_s(), self_cpu_s()
        return self

    def __exit__(self, *exc):
        self.other_cpu_s = max(0.0, (machine_busy_s() - self.m0) - (self_cpu_s() - self.s0))
        return False


def wait_for_quiet(max_load: float, timeout_s: float = 120.0) -> float:
    """Wait (up to timeout_s) until other processes keep fewer than max_load cores busy."""
    deadline = time.monotonic() + timeout_s
    while True:
        with OtherLoad() as w:
            time.sleep(2.0)
        load = w.other_cpu_s / 2.0
        if load <= max_load or time.monotonic() > deadline:
            return load


def measure(fn, retries: int, max_load: float) -> tuple[list[dict], list[list[int]]]:
    """Time ``fn(attempt)``; while other processes used more than ``max_load`` cores on average
    during the call, wait for a quiet machine and time it again (at most ``retries`` more times).

    Returns every attempt (wall_s, other_cores) and the first attempt's tokens; the caller
    reports the fastest attempt.
    """
    attempts: list[dict] = []
    first_tokens = None
    for i in range(retries + 1):
        with OtherLoad() as load:
            wall, tokens = fn(i)
        other = load.other_cpu_s / wall
        attempts.append({"wall_s": wall, "other_cores": other})
        if first_tokens is None:
            first_tokens = tokens
        if other <= max_load:
            break
        if i < retries:
            print(f"  (other processes kept {other:.2f} cores busy during this {wall:.1f} s call: waiting for a "
                  f"quiet machine and timing it again)", flush=True)
            wait_for_quiet(max_load)
    return attempts, first_tokens


def _contended(attempts: list[dict], max_load: float) -> bool:
    """Whether the reported (fastest) attempt ran while other processes were busy."""
    return min(attempts, key=lambda a: a["wall_s"])["other_cores"] > max_load


def engine_settings(llm) -> dict:
    cfg = llm.engine.config
    keys = ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "enable_prefix_caching", "num_kv_blocks", "kv_cache_memory_gb", "dtype", "device", "seed")
    s = {k: getattr(cfg, k) for k in keys}
    s["torch_dtype"] = str(cfg.torch_dtype)
    s["resolved_num_kv_blocks"] = llm.engine.runner.num_blocks
    return s


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["concurrency"]) for r in results]
    x = range(len(results))
    w = 0.38
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(results), 4))
    epd = [r["epd_tok_s"] for r in results]
    bars = ax.bar([i - w / 2 for i in x], epd, w, label="epd")
    if all(r.get("hf_tok_s") for r in results):
        hf = [r["hf_tok_s"] for r in results]
        ax.bar([i + w / 2 for i in x], hf, w, label="transformers generate")
        for b, r in zip(bars, results):
            ax.annotate(f"{r['ratio']:.2f}x", (b.get_x() + w, max(r["epd_tok_s"], r["hf_tok_s"])),
                        ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_point(c: int, args, llm, pool: PromptPool, hf_model, pad_id: int, flops_per_token: int,
              gemm_gflops: float, sanity: dict | None) -> tuple[dict, dict | None]:
    """Time epd (and transformers, when loaded) at concurrency ``c``; returns the result row and
    the sanity check (made at concurrency 1 when it was still ``None``)."""
    n_out = c * args.output_len
    prompts = pool.take(c)
    # epd: warm-up on other prompts (a few tokens), then the timed call. A retry takes fresh
    # prompts (the same ones would hit epd's prefix cache); the compute does not depend on them.
    run_epd(llm, pool.take(c), min(4, args.output_len))
    epd_runs, epd_tokens = measure(lambda i: run_epd(llm, prompts if i == 0 else pool.take(c), args.output_len),
                                   args.retries, args.max_other_load)
    epd_s = min(r["wall_s"] for r in epd_runs)
    flops = c * (args.prompt_len + args.output_len) * flops_per_token
    row = {"concurrency": c, "output_tokens": n_out, "epd_s": epd_s, "epd_tok_s": n_out / epd_s,
           "epd_gflops": flops / epd_s / 1e9, "gemm_fraction": flops / epd_s / 1e9 / gemm_gflops,
           "epd_attempts": epd_runs, "contended": _contended(epd_runs, args.max_other_load)}
    if hf_model is not None:
        run_hf(hf_model, pool.take(c), min(8, args.output_len), pad_id)  # warm-up
        hf_runs, hf_tokens = measure(lambda i: run_hf(hf_model, prompts, args.output_len, pad_id),
                                     args.retries, args.max_other_load)
        hf_s = min(r["wall_s"] for r in hf_runs)
        row.update(hf_s=hf_s, hf_tok_s=n_out / hf_s, ratio=hf_s / epd_s, hf_attempts=hf_runs)
        row["contended"] = row["contended"] or _contended(hf_runs, args.max_other_load)
        if c == 1 and sanity is None:
            k = min(SANITY_TOKENS, args.output_len)
            sanity = {"tokens": k, "agree": epd_tokens[0][:k] == hf_tokens[0][:k],
                      "epd": epd_tokens[0][:k], "transformers": hf_tokens[0][:k]}
            print(f"sanity (concurrency 1): first {k} greedy tokens "
                  f"{'AGREE' if sanity['agree'] else 'DIFFER'}\n  epd          {sanity['epd']}\n"
                  f"  transformers {sanity['transformers']}", flush=True)
        print(f"C={c:3d}  epd {epd_s:7.2f} s {row['epd_tok_s']:8.1f} tok/s   transformers {hf_s:7.2f} s "
              f"{row['hf_tok_s']:8.1f} tok/s   epd/hf {row['ratio']:.2f}x   (attempts {len(epd_runs)} / "
              f"{len(hf_runs)})", flush=True)
    else:
        print(f"C={c:3d}  epd {epd_s:7.2f} s {row['epd_tok_s']:8.1f} tok/s   (attempts {len(epd_runs)})",
              flush=True)
    return row, sanity


def print_table(results: list[dict]) -> None:
    """The results as a plain-text table on stdout."""
    print()
    print(f"{'concurrency':>11} | {'epd tok/s':>9} | {'transformers tok/s':>18} | {'epd/transformers':>16} | "
          f"{'epd GFLOP/s (of GEMM peak)':>26}")
    print(f"{'-' * 11}-+-{'-' * 9}-+-{'-' * 18}-+-{'-' * 16}-+-{'-' * 26}")
    for r in results:
        hf = f"{r['hf_tok_s']:18.1f}" if "hf_tok_s" in r else f"{'-':>18}"
        ratio = f"{r['ratio']:15.2f}x" if "ratio" in r else f"{'-':>16}"
        print(f"{r['concurrency']:>11} | {r['epd_tok_s']:9.1f} | {hf} | {ratio} | "
              f"{r['epd_gflops']:17.1f} ({r['gemm_fraction']:4.0%})"
              + ("   * other processes were busy in every attempt: noisy" if r["contended"] else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    import transformers
    from transformers import AutoModelForCausalLM

    from epd import LLM
    from epd.models.checkpoints import resolve_model

    git_state = _git_state()  # before the run: the code that was imported
    model_dir = resolve_model(None)
    t0 = time.perf_counter()
    llm = LLM(model=None, dtype=args.dtype, quantization=args.quantization,
              enforce_eager=args.enforce_eager)  # default engine settings otherwise
    epd_load_s = time.perf_counter() - t0
    torch.set_num_threads(args.threads)  # in case construction changed it
    settings = engine_settings(llm)
    vocab = llm.engine.vocab_size
    pool = PromptPool(vocab, args.prompt_len, args.seed)

    hf_model = None
    pad_id = 0
    if not args.skip_transformers:
        hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=llm.engine.config.torch_dtype)
        hf_model = hf_model.to(settings["device"]).eval()
        tok = llm.get_tokenizer()
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"device {settings['device']}, dtype {settings['torch_dtype']}; prompt {args.prompt_len} + output "
          f"{args.output_len} tokens; epd engine: {settings}", flush=True)

    start_load = wait_for_quiet(args.max_other_load, timeout_s=60.0)
    gemm_gflops = gemm_rate(llm.engine.config.torch_dtype)
    flops_per_token = 2 * _linear_params(llm.engine.runner.model) + 2 * _lm_head_params(llm)
    print(f"GEMM rate at {llm.engine.config.torch_dtype} ({args.threads} threads): {gemm_gflops:.0f} GFLOP/s; "
          f"{flops_per_token / 1e6:.0f} MFLOP of matmuls per token", flush=True)
    if start_load > args.max_other_load:
        print(f"warning: other processes keep {start_load:.2f} cores busy; they slow both engines and make "
              f"the numbers noisy (see other_cores in the JSON)", flush=True)
    results: list[dict] = []
    sanity: dict | None = None
    for c in args.concurrency:
        row, sanity = run_point(c, args, llm, pool, hf_model, pad_id, flops_per_token, gemm_gflops, sanity)
        results.append(row)
    print_table(results)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "engine_throughput",
        "model": f"SmolLM2-135M-Instruct (embedded default, {llm.engine.config.torch_dtype})",
        "gemm_gflops": gemm_gflops,
        "matmul_flops_per_token": flops_per_token,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "greedy": True,
        "seed": args.seed,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": {"platform": platform.platform(), "processor": _cpu_name(), "python": sys.version.split()[0]},
        "git": git_state,
        "epd_engine_settings": settings,
        "quantization": args.quantization,
        "enforce_eager": args.enforce_eager,
        "epd_load_s": epd_load_s,
        "other_cores_busy_at_start": start_load,
        "sanity_first_tokens": sanity,
        "results": results,
    }
    short = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(llm.engine.config.torch_dtype, "other")
    stem = (f"engine_throughput_{short}" + ("_int8" if args.quantization else "")
            + ("_eager" if args.enforce_eager else "") + ("_quick" if args.quick else ""))
    json_path = args.out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    png_path = args.out_dir / f"{stem}.png"
    plot(results, png_path, f"SmolLM2-135M {short}, {torch.get_num_threads()} threads, "
                            f"{args.prompt_len} prompt + {args.output_len} output tokens / request")
    print(f"\nwrote {json_path} and {png_path}")
    llm.shutdown()
    return 0 if sanity is None or sanity["agree"] else 1


def _git_state() -> dict:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "epd", "kernels"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": head or None, "engine_files_modified": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "engine_files_modified": None}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
