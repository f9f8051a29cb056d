"""Tensor parallelism inside launched pools and heterogeneous prefill/decode TP.

Real `epd launch` (rank 0 of each instance spawns its other TP ranks), real NIXL,
the openai SDK. Parity: greedy output equals transformers ``generate`` and the
TP=1 offline engine. Staged KV moves with one NIXL write per layer, whatever the
number of blocks; staging pools return to all-free after requests and aborts.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from epd import LLM, SamplingParams
from epd.models.tiny import IMAGE_TOKEN, create_tiny_model
from tests.conftest import hf_greedy
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
BLOCK = 8
NUM_LAYERS = 2  # every tiny kind
# 5 tokens (1 block), 41 tokens (6 blocks of 8), 50 tokens (7 blocks)
TEXT_PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61)), list(range(10, 60))]
IMAGE_PROMPT = f"{IMAGE_TOKEN} What is this?"


def _png() -> bytes:
    rng = np.random.default_rng(7)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _image_messages() -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": IMAGE_PROMPT.replace(IMAGE_TOKEN, "")}]}]


@pytest.fixture(scope="module")
def models(tiny_model_dirs, tmp_path_factory):
    dirs = {"llama": tiny_model_dirs["llama"], "qwen2": tiny_model_dirs["qwen2"],
            "llava": str(create_tiny_model("llava", tmp_path_factory.mktemp("tp") / "llava"))}
    return dirs


@pytest.fixture(scope="module")
def expected(models):
    """kind -> (texts of TEXT_PROMPTS, text of the image chat or None), from the TP=1
    offline engine, whose text-model tokens are checked here against transformers."""
    out = {}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for kind, path in models.items():
        llm = LLM(path, dtype="float32")
        outs = llm.generate(TEXT_PROMPTS, params)
        if kind != "llava":  # llava's LM parity with transformers: tests/encoders/test_mm_parity.py
            assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, TEXT_PROMPTS, MAX_TOKENS)
        image = None
        if kind == "llava":
            tok = llm.get_tokenizer()
            rendered = tok.apply_chat_template([{"role": "user", "content": IMAGE_PROMPT}],
                                               add_generation_prompt=True, tokenize=False)
            ids = tok.encode(rendered, add_special_tokens=False)
            image = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [_png()]}},
                                 params)[0].outputs[0].text
        out[kind] = ([o.outputs[0].text for o in outs], image)
        llm.shutdown()
    return out


def _check_parity(server, texts, image) -> None:
    client = server.client()
    for prompt, want in zip(TEXT_PROMPTS, texts):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.completion_tokens == MAX_TOKENS
    if image is not None:
        stream = client.chat.completions.create(model=server.model, messages=_image_messages(), max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in stream) == image


def _rank_processes(server, role: str) -> tuple[psutil.Process, list[psutil.Process]]:
    """(rank 0 process of ``role``-0, the TP rank processes it spawned)."""
    for p in psutil.Process(server.proc.pid).children():
        if f"{role}-0" in p.cmdline():
            return p, [c for c in p.children() if "spawn_main" in " ".join(c.cmdline())]
    raise AssertionError(f"no {role}-0 process")


def _staging_all_free(stats: dict) -> bool:
    return all(s.get("num_free_staging_blocks") == s.get("num_staging_blocks") for s in stats.values()
               if "num_staging_blocks" in s)


def _wait_idle(server, before: dict) -> dict:
    stats = server.workers()
    for _ in range(100):  # aborts and frees are asynchronous
        stats = server.workers()
        if _staging_all_free(stats) and all(stats[k]["num_free_blocks"] == before[k]["num_free_blocks"]
                                            and stats[k].get("num_reserved", 0) == 0 for k in before):
            break
        time.sleep(0.2)
    return stats


# ---------------------------------------------------------------- parity
CASES = [  # (kind, pools, tp): every kind on 2 -> 1 (llama: in the next test) and 1 -> 2, 2 -> 2, aggregated TP 2
    ("qwen2", "p:2,d:1", "p:2,d:1"), ("llava", "e:1,p:2,d:1", "p:2,d:1"),
    ("llama", "p:1,d:2", "p:1,d:2"), ("qwen2", "p:1,d:2", "p:1,d:2"), ("llava", "e:1,p:1,d:2", "p:1,d:2"),
    ("qwen2", "p:2,d:2", "p:2,d:2"), ("llava", "e:1,pd:2", "pd:2"),
]


@pytest.mark.parametrize("kind,pools,tp", CASES, ids=[f"{k}-{t}" for k, _, t in CASES])
def test_tp_parity(kind, pools, tp, models, expected):
    with launch(models[kind], pools, "--tp", tp, "--block-size", str(BLOCK)) as server:
        _check_parity(server, *expected[kind])
        role = "pd" if pools.endswith("pd:2") else "prefill" if "p:2" in pools else "decode"
        rank0, ranks = _rank_processes(server, role)
        assert len(ranks) == 1  # TP 2: rank 0 (launched) spawned rank 1
        if role != "pd":
            assert _staging_all_free(server.workers())


# ---------------------------------------------------------------- transfer counts, leaks, rank death
def _cancel_at_every_stage_then_check_free(server, before: dict) -> dict:
    """12 streamed requests cancelled at every stage: half at once (reserve / prefill /
    transfer), half after their first streamed chunk (decode). Then every staging range is
    free and every instance has ``before``'s free KV blocks again; returns /epd/workers."""

    async def cancelled(i: int, http: httpx.AsyncClient) -> None:
        body = {"prompt": list(range(30 + i, 90 + i)), "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        if i % 2:  # cancel at once (reserve / prefill / transfer) ...
            try:
                await asyncio.wait_for(http.post(server.url + "/v1/completions", json=body), 0.05 * (i % 5))
            except TimeoutError:
                pass
            return
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():  # ... or after the first streamed chunk (decode)
                if line.strip():
                    return

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(cancelled(i, http) for i in range(12)))

    asyncio.run(run())
    after = _wait_idle(server, before)
    assert _staging_all_free(after), after
    for inst in before:
        assert after[inst]["num_free_blocks"] == before[inst]["num_free_blocks"], (inst, after[inst])
    return after


def test_staged_transfer_counts_leaks_and_rank_death(models, expected):
    """p:2 -> d:1 on tiny Llama, prompts prefilled in 16-token chunks: parity; one NIXL
    write per layer per request whatever the block or chunk count; staging and KV
    blocks all free again after requests and aborts; a TP rank dies with its
    instance's rank 0."""
    with launch(models["llama"], "p:2,d:1", "--tp", "p:2,d:1", "--block-size", str(BLOCK),
                "--max-num-batched-tokens", "16") as server:
        client = server.client()
        before = server.workers()
        _check_parity(server, *expected["llama"])
        assert before["prefill-0"]["num_staging_blocks"] > 0 and before["decode-0"]["num_staging_blocks"] > 0
        for prompt in (TEXT_PROMPTS[1], TEXT_PROMPTS[0]):  # 6 blocks, then 1 block
            n0 = server.workers()["prefill-0"]["kv_transfer_requests"]
            client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
            assert server.workers()["prefill-0"]["kv_transfer_requests"] - n0 == NUM_LAYERS
        after = _wait_idle(server, before)
        assert _staging_all_free(after)
        # 5 requests so far (3 parity + 2 above), 2 writes each; the prefill worker's
        # counter reaches /metrics once per heartbeat.
        assert after["prefill-0"]["kv_transfer_requests"] == 5 * NUM_LAYERS
        pattern = r'^epd_kv_transfer_requests_total\{[^}]*pool="prefill"[^}]*\} ([0-9.e+]+)$'
        total = 0.0
        for _ in range(30):
            total = sum(float(v) for v in re.findall(pattern, httpx.get(server.url + "/metrics").text, re.M))
            if total >= 5 * NUM_LAYERS:
                break
            time.sleep(0.2)
        assert total == 5 * NUM_LAYERS

        _cancel_at_every_stage_then_check_free(server, before)
        # Still serving, same answer.
        r = client.completions.create(model=server.model, prompt=TEXT_PROMPTS[2], max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")

        rank0, ranks = _rank_processes(server, "prefill")
        assert len(ranks) == 1
        os.kill(rank0.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, "TP rank 1 outlived its instance's rank 0"


# ---------------------------------------------------------------- launch-time rejection
def test_unsplittable_tp_pair_rejected_at_launch(models):
    """Tiny Llama has 2 KV heads: prefill TP 2 -> decode TP 4 cannot split them on the
    decode side; launch refuses before starting any process."""
    r = subprocess.run([sys.executable, "-m", "epd.cli", "launch", "--model", models["llama"], "--pools", "p:2,d:4",
                        "--tp", "p:2,d:4", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--tp d:4: TP 4 must divide" in r.stderr and "2 KV heads" in r.stderr and "allows: 1, 2" in r.stderr
    assert "prefill and decode TP may differ" in r.stderr


# ---------------------------------------------------------------- a small staging pool
def test_small_staging_pool_caps_max_model_len(tmp_path_factory):
    """Tiny Llama with 8 layers: 2 KiB of fp32 KV per token, so --kv-staging-mb 1 holds 64 blocks
    of 8 = 512 tokens < the model's 2048. Every instance with a staging pool lowers its
    max_model_len to 512 (a warning names --kv-staging-mb) and the API validates against it:
    a longer prompt is the usual max_model_len 400 before anything is reserved, not a
    reservation failure on decode; the longest prompt that fits still answers."""
    path = str(create_tiny_model("llama", tmp_path_factory.mktemp("staging") / "llama8", num_hidden_layers=8))
    with launch(path, "p:2,d:1", "--tp", "p:2,d:1", "--block-size", str(BLOCK), "--kv-staging-mb", "1") as server:
        before = server.workers()
        for inst in ("prefill-0", "decode-0"):
            assert before[inst]["num_staging_blocks"] == 64 and before[inst]["max_model_len"] == 512, before[inst]
        log = "".join(server.lines)
        assert "epd launch: warning: --kv-staging-mb 1 holds 64 staging blocks = 512 tokens" in log, log[-3000:]
        # each instance's own warning (prefill and decode)
        assert log.count("--kv-staging-mb: the KV staging pool holds 64 blocks = 512 tokens < max_model_len 2048: "
                         "max_model_len lowered to 512") >= 2, log[-3000:]
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == 512
        too_long = [5 + i % 500 for i in range(600)]  # 75 staging blocks
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": server.model, "prompt": too_long, "max_tokens": 1})
        assert r.status_code == 400 and "max_model_len is 512" in r.text and "staging" not in r.text, r.text
        after = server.workers()
        assert after["decode-0"].get("num_reserved", 0) == 0 and _staging_all_free(after)
        assert after["decode-0"]["num_free_blocks"] == before["decode-0"]["num_free_blocks"]
        client = server.client()
        r = client.completions.create(model=server.model, prompt=too_long[:511], max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == 511 and r.usage.completion_tokens == 1  # 64 staging blocks: all of them
        r = client.completions.create(model=server.model, prompt=TEXT_PROMPTS[1], max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
        assert _staging_all_free(_wait_idle(server, before))


# ---------------------------------------------------------------- quantized KV cache
def _kv_bytes_moved(server) -> float:
    """``epd_kv_transfer_bytes_total`` over every prefill instance (it reaches /metrics with
    the workers' heartbeats: polled until it stops changing)."""
    pattern = r'^epd_kv_transfer_bytes_total\{[^}]*\} ([0-9.e+]+)$'
    last = -1.0
    for _ in range(30):
        total = sum(float(v) for v in re.findall(pattern, httpx.get(server.url + "/metrics").text, re.M))
        if total > 0 and total == last:
            return total
        last = total
        time.sleep(0.3)
    return last


QBLOCK = 16  # int8 keeps full K blocks per channel from 16-token blocks on (kv_quant.channel_k)


def _offline_int8(model: str, block_size: int) -> list[tuple[str, list[float]]]:
    llm = LLM(model, dtype="float32", kv_cache_dtype="int8", kv_cache_memory_gb=0.05, block_size=block_size)
    try:
        outs = llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                         logprobs=0))
        return [(o.outputs[0].text, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("pools", ["p:2,d:1", "p:1,d:2"])
def test_quantized_kv_staged_across_tp(pools, models, expected):
    """``--kv-cache-dtype int8`` with heterogeneous TP on tiny Llama (2 KV heads, head_dim
    16: rows of 16 codes + 4 bytes of float16 scale and min) and 16-token blocks, so full K
    blocks are per channel (their scales in the head's rows) and the decode worker keeps its
    own K rows of the open block exact: the staging pack/unpack moves each head's rows with
    its scales, so the decode side's greedy tokens and their logprobs equal the TP=1 offline
    engine's with the same cache (the 41- and 50-token prompts fill two blocks on the
    prefill side and one more while decoding); the bytes moved are the full-precision run's
    times 20 / 64 (int8 row / fp32 row), and the blocks per GiB grow by 64 / 20."""
    want = _offline_int8(models["llama"], QBLOCK)
    assert [t for t, _ in want] != expected["llama"][0]  # the int8 cache changes this model's greedy text
    rows = _offline_int8(models["llama"], 8)  # per-row K scales: logprobs far from the per-channel layout's
    assert max(abs(a - b) for (_, x), (_, y) in zip(want, rows) for a, b in zip(x, y)) > 0.05
    moved, per_gb = {}, {}
    for kv in ("int8", "auto"):
        with launch(models["llama"], pools, "--tp", pools, "--block-size", str(QBLOCK), "--kv-cache-dtype",
                    kv) as server:
            if kv == "int8":
                client = server.client()
                for prompt, (text, lps) in zip(TEXT_PROMPTS, want):
                    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, logprobs=0, extra_body={"ignore_eos": True})
                    assert r.choices[0].text == text
                    got = r.choices[0].logprobs.token_logprobs
                    assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3, (got, lps)
            else:
                _check_parity(server, expected["llama"][0], None)
            moved[kv] = _kv_bytes_moved(server)
            stats = server.workers()
            assert _staging_all_free(stats)
            per_gb[kv] = {k: s["kv_blocks_per_gb"] for k, s in stats.items() if "kv_blocks_per_gb" in s}
    assert moved["auto"] > 0 and moved["int8"] * 64 == moved["auto"] * 20, moved
    assert per_gb["int8"].keys() == per_gb["auto"].keys() and per_gb["int8"]
    for inst, n in per_gb["int8"].items():  # 2**30 // block bytes, which shrink 64 -> 20 a row
        assert abs(n * 20 / 64 - per_gb["auto"][inst]) <= 1, (inst, n, per_gb["auto"][inst])
