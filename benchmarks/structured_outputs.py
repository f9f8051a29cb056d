"""The cost of constrained decoding: grammar mask time per token, and TPOT with and without a schema.

Part 1 (no server): per-token mask time of llguidance (epd's grammar engine,
``epd.engine.grammar``) on the SmolLM2 tokenizer, one matcher and a batch of 8, for a
nested JSON schema; xgrammar's too when it is importable (``--xgrammar-path``: a directory
with ``pip install --target DIR xgrammar apache-tvm-ffi``), the measurement the engine was
picked by.

Part 2: ``epd launch --pools pd:1`` on SmolLM2-135M-Instruct (the embedded default);
1 and 8 closed-loop streaming clients, greedy. ``free``: unconstrained, ``ignore_eos``,
200 tokens; ``schema``: ``response_format`` json_schema of an array of 100 digits (about
200 tokens, ended by the grammar). TPOT per request (first to last content chunk); the table
gives the median and the overhead of ``schema`` over ``free``.

    .venv/bin/python benchmarks/structured_outputs.py            # both parts
    .venv/bin/python benchmarks/structured_outputs.py --no-serve # mask times only

Writes ``benchmarks/results/structured_outputs.json``. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from _common import ROOT, free_port

RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                     "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "12345"}}
DIGITS = {"type": "object", "properties": {"digits": {"type": "array", "minItems": 100, "maxItems": 100,
                                                      "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
          "required": ["digits"], "additionalProperties": False}


def mask_times(model_dir: str, xgrammar_path: str | None) -> dict:
    """Mean / p99 mask time per token (µs) and compile time (ms) per engine and batch size."""
    import numpy as np
    from transformers import AutoTokenizer

    from epd.engine.grammar import GrammarCompiler
    from epd.structured_outputs import StructuredOutputs

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = 49152
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")))
    out = {}
    comp = GrammarCompiler(model_dir, vocab, frozenset({tok.eos_token_id}), tok)
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    comp.grammar(spec)  # the tokenizer, once
    for batch in (1, 8):
        t = time.perf_counter()
        comp._cache.clear()
        gs = [comp.grammar(spec) for _ in range(batch)]
        compile_ms = (time.perf_counter() - t) * 1e3
        ts = []
        for i in ids:
            t = time.perf_counter()
            comp.bitmask(gs)
            ts.append((time.perf_counter() - t) / batch)
            for g in gs:
                assert g.accept(i)
        out[f"llguidance/b{batch}"] = {"mask_us_mean": float(np.mean(ts) * 1e6),
                                       "mask_us_p99": float(np.percentile(ts, 99) * 1e6),
                                       "compile_ms": compile_ms, "tokens": len(ids)}
    if xgrammar_path:
        sys.path.insert(0, xgrammar_path)
        try:
            import xgrammar as xgr
        except Exception as e:  # optional comparison
            out["xgrammar"] = {"error": str(e)}
            return out
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        compiler = xgr.GrammarCompiler(info)
        t = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        compile_ms = (time.perf_counter() - t) * 1e3
        m = xgr.GrammarMatcher(cg)
        bm = xgr.allocate_token_bitmask(1, vocab)
        ts = []
        for i in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            ts.append(time.perf_counter() - t)
            assert m.accept_token(i)
        out["xgrammar/b1"] = {"mask_us_mean": float(np.mean(ts) * 1e6),
                              "mask_us_p99": float(np.percentile(ts, 99) * 1e6),
                              "compile_ms": compile_ms, "tokens": len(ids)}
    return out


async def _load(url: str, model: str, clients: int, rounds: int, constrained: bool) -> list[dict]:
    from openai import AsyncOpenAI

    from epd.bench.client import send_chat
    from epd.bench.metrics import RequestRecord
    from epd.bench.workloads import RequestSpec

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "digits", "schema": DIGITS}}}
    recs = []

    async def one_client(c: int) -> None:
        for r in range(rounds):
            spec = RequestSpec("chat", [{"role": "user", "content": f"list some digits ({c}, {r})"}],
                               400 if constrained else 200)
            rec = RequestRecord(index=len(recs), kind="schema" if constrained else "free", scheduled_s=0.0)
            await send_chat(client, model, spec, rec, ignore_eos=not constrained,
                            extra_body=fmt if constrained else None)
            recs.append(rec)

    try:
        await asyncio.gather(*(one_client(c) for c in range(clients)))
    finally:
        await client.close()
    return [{"ok": r.ok, "tpot_s": r.tpot_s, "n_out": r.n_out, "finish": r.finish_reason, "error": r.error}
            for r in recs]


def serving(rounds: int) -> dict:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "epd.cli", "launch", "--pools", "pd:1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("epd launch did not become healthy")
            time.sleep(1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(_load(url, model, 1, 1, True))  # warm-up (tokenizer of the grammar engine)
        out = {}
        for clients in (1, 8):
            for constrained in (False, True):
                recs = asyncio.run(_load(url, model, clients, rounds, constrained))
                tpots = [r["tpot_s"] for r in recs if r["ok"] and r["tpot_s"]]
                out[f"{'schema' if constrained else 'free'}/c{clients}"] = {
                    "tpot_ms_median": statistics.median(tpots) * 1e3 if tpots else None,
                    "n_out_median": statistics.median(r["n_out"] for r in recs),
                    "finish": sorted({r["finish"] for r in recs if r["finish"]}),
                    "failed": sum(not r["ok"] for r in recs)}
        return out
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-serve", action="store_true", help="mask times only")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client per load point")
    ap.add_argument("--xgrammar-path", default=None, help="a --target install of xgrammar to compare with")
    args = ap.parse_args()
    from epd.models.checkpoints import resolve_model

    model_dir = str(resolve_model(None))
    res = {"mask": mask_times(model_dir, args.xgrammar_path)}
    print(f"{'engine/batch':18} {'mask µs/token mean':>18} {'p99':>8} {'compile ms':>11}")
    for k, v in res["mask"].items():
        if "error" not in v:
            print(f"{k:18} {v['mask_us_mean']:18.1f} {v['mask_us_p99']:8.1f} {v['compile_ms']:11.1f}")
    if not args.no_serve:
        res["serving"] = serving(args.rounds)
        print(f"\n{'load':12} {'TPOT ms (median)':>17} {'tokens':>7} {'overhead':>9}  finish")
        for k, v in res["serving"].items():
            base = res["serving"].get("free/" + k.split("/")[1], {}).get("tpot_ms_median")
            over = (f"{(v['tpot_ms_median'] / base - 1) * 100:+.1f}%" if k.startswith("schema") and base
                    and v["tpot_ms_median"] else "")
            print(f"{k:12} {v['tpot_ms_median'] or float('nan'):17.1f} {v['n_out_median']:7.0f} {over:>9}  "
                  f"{','.join(v['finish'])}{' failed=' + str(v['failed']) if v['failed'] else ''}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "structured_outputs.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
