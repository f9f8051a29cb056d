"""Which int8 KV-cache layout keeps SmolLM2's greedy output: agreement with the fp32 cache.

The measure is tests/engine/test_kv_cache_dtype.py's: 100 chat prompts (two sets of 50),
32 greedy tokens each with ``ignore_eos``, fp32 model, 16-token blocks; a layout's score is
the share of generated tokens equal, position by position, to the full-precision cache's.

Each layout but the shipped one is *simulated*: the engine keeps an fp32 cache, and the
attention layer's store is swapped for one that writes what the layout would read back
(quantize, then dequantize, with kernels.kv_quant's own functions). The simulation of the
shipped layout (``kivi``) reads back exactly what the real int8 cache does (checked: equal
logprobs), and ``int8`` runs the real cache. Layouts:

* ``bf16``: K and V rounded to bfloat16 (no quantization; the noise floor of this measure);
* ``rows``: int8 rows with a float16 (scale, min) per 16 values, K and V (no per-channel K);
* ``rows_g8``: the same per 8 values (96-byte rows instead of 80);
* ``rows_resid``: ``rows``, but each sequence's open block kept exact until it fills;
* ``chan_no_resid``: V ``rows``; K rows until a block fills, then per channel (from exact
  values), no residual;
* ``kivi``: the shipped layout, ``chan_no_resid`` plus the decode residual: a decode step's
  K stays exact in its open block until the block fills;
* ``kivi_exact_tail``: ``kivi`` with the prompt's rows of the open block exact too (a
  residual that would have to travel P->D);
* ``int8``: the real ``--kv-cache-dtype int8`` engine.

    python benchmarks/kv_quant_schemes.py                # all layouts, both prompt sets
    python benchmarks/kv_quant_schemes.py rows kivi int8

About 15 s a layout and set on 2 cores. Prints a table; writes
benchmarks/results/kv_quant_schemes.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

import epd.layers.attention as attention
from epd import LLM, SamplingParams
from epd.kernels.kv_quant import dequantize_channels, dequantize_kv, quantize_channels, quantize_kv
from epd.kernels.store_kv import store_kvcache
from epd.models.checkpoints import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from test_kv_cache_dtype import FORMS, FORMS_2, NEW_TOKENS, SUBJECTS, SUBJECTS_2

BLOCK = 16
SETS = {"first 50": [f.format(s) for s, f in itertools.product(SUBJECTS, FORMS)],
        "other 50": [f.format(s) for s, f in itertools.product(SUBJECTS_2, FORMS_2)]}
LAYOUTS = ["bf16", "rows", "rows_g8", "rows_resid", "chan_no_resid", "kivi", "kivi_exact_tail", "int8"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """int8 rows, a float16 (scale, min) per 16 values, read back."""
    return dequantize_kv(quantize_kv(x, "int8"), "int8", x.dtype)


def _rows_g8(x: torch.Tensor) -> torch.Tensor:
    """int8 rows, a float16 (scale, min) per 8 values, read back (as quantize_kv's rounding)."""
    t, h, d = x.shape
    return _rows(x.reshape(t, h * d // 8, 8)).reshape(t, h, d)


def _chan(x: torch.Tensor) -> torch.Tensor:
    """Full K blocks ``[n, block, heads, dim]`` per channel, read back."""
    return dequantize_channels(quantize_channels(x), x.dtype)


def _store_for(layout: str):
    """The attention layer's store for ``layout``: (k, v, k_cache, v_cache, slot_mapping)."""
    def flat(cache):
        return cache.view(-1, *cache.shape[2:])

    def write(cache, x, slots, rows):
        m = slots >= 0
        flat(cache)[slots[m]] = x[m] if rows is None else rows(x)[m]

    def fill(cache, slots, decode, exact, k):
        """Blocks this step filled, per channel: from the cache as it holds them, with this
        step's rows exact (``exact``: all of them, else the prefill's only, as the real
        store, whose decode rows reach the block through the residual kept in the cache)."""
        done = torch.unique(slots[(slots >= 0) & (slots % BLOCK == BLOCK - 1)] // BLOCK)
        if not len(done):
            return
        x = cache[done].clone()
        blocks = slots.clamp(min=0) // BLOCK
        idx = torch.searchsorted(done, blocks).clamp(max=len(done) - 1)
        hit = (slots >= 0) & (done[idx] == blocks) & (exact | ~decode)
        x[idx[hit], slots[hit] % BLOCK] = k[hit]
        cache[done] = _chan(x)

    def store(k, v, k_cache, v_cache, slot_mapping):
        slots = slot_mapping.to(torch.long)
        nd = attention._METADATA.num_decode_tokens
        decode = torch.arange(len(slots)) < nd
        if layout == "bf16":
            return store_kvcache(k.bfloat16().to(k.dtype), v.bfloat16().to(v.dtype), k_cache, v_cache, slot_mapping)
        if layout in ("rows", "rows_g8"):
            f = _rows if layout == "rows" else _rows_g8
            return store_kvcache(f(k), f(v), k_cache, v_cache, slot_mapping)
        write(v_cache, v, slots, _rows)
        if layout == "rows_resid":  # exact until the block fills, then rows
            write(k_cache, k, slots, None)
            write(v_cache, v, slots, None)
            for cache in (k_cache, v_cache):
                done = torch.unique(slots[(slots >= 0) & (slots % BLOCK == BLOCK - 1)] // BLOCK)
                for b in done.tolist():
                    cache[b] = _rows(cache[b])
            return
        if layout == "chan_no_resid":  # rows read back; filled blocks per channel from exact values
            exact = getattr(k_cache, "_exact", None)
            if exact is None:
                exact = k_cache._exact = torch.zeros_like(k_cache)
            write(exact, k, slots, None)
            write(k_cache, k, slots, _rows)
            done = torch.unique(slots[(slots >= 0) & (slots % BLOCK == BLOCK - 1)] // BLOCK)
            if len(done):
                k_cache[done] = _chan(exact[done])
            return
        # kivi: decode rows exact in the cache (the residual), prefill rows as rows;
        # kivi_exact_tail: every row exact until its block fills
        tail_exact = layout == "kivi_exact_tail"
        m = slots >= 0
        flat(k_cache)[slots[m & decode]] = k[m & decode]
        flat(k_cache)[slots[m & ~decode]] = (k if tail_exact else _rows(k))[m & ~decode]
        fill(k_cache, slots, decode, tail_exact, k)

    return store


def generate(layout: str, prompts: list[str], model: str) -> list[list[int]]:
    """Greedy token ids of ``prompts`` under ``layout`` ("": the fp32 cache)."""
    real = layout == "int8"
    attention.store_kvcache = _store_for(layout) if layout and not real else store_kvcache
    llm = LLM(model, dtype="float32", kv_cache_dtype="int8" if real else "auto", kv_cache_memory_gb=0.25,
              target_step_ms=0, block_size=BLOCK)
    try:
        texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=False) for p in prompts]
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
        attention.store_kvcache = store_kvcache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("layouts", nargs="*", help=f"any of {', '.join(LAYOUTS)} (default: all)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_quant_schemes.json"))
    args = ap.parse_args()
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown:
        ap.error(f"unknown layouts {unknown}: choose from {LAYOUTS}")
    model = str(resolve_model(None))
    results: dict[str, dict[str, float]] = {}
    for name, prompts in SETS.items():
        ref = generate("", prompts, model)
        for layout in args.layouts or LAYOUTS:
            got = generate(layout, prompts, model)
            same = sum(a == b for r, q in zip(ref, got) for a, b in zip(r, q))
            results.setdefault(layout, {})[name] = same / (len(prompts) * NEW_TOKENS)
            results[layout][name + " diverging"] = sum(r != q for r, q in zip(ref, got))
    print(f"{'layout':16s} " + " ".join(f"{n:>10s}" for n in SETS) + f" {'all 100':>8s}  diverging")
    for layout, r in results.items():
        r["all"] = sum(r[n] for n in SETS) / len(SETS)
        print(f"{layout:16s} " + " ".join(f"{r[n]:10.1%}" for n in SETS) + f" {r['all']:8.1%}  "
              + " + ".join(str(r[n + ' diverging']) for n in SETS))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"new_tokens": NEW_TOKENS, "block_size": BLOCK, "agreement": results},
                                         indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
