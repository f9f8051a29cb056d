"""Per-rank NIXL agents (``--kv-agents per-rank``): every TP rank writes its own KV heads.

Real `epd launch`, real NIXL: greedy parity with transformers on p:2,d:1, p:1,d:2 and
p:2,d:2 (tiny Llama; tiny LLaVA on 2 -> 1), NIXL writes per request = layers x
max(prefill TP, decode TP) whatever the block count, staging and KV blocks all free
after cancels, and a killed TP rank takes its decode instance down, its streams
migrating to the other instance.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from tests.conftest import stream_text
from tests.serving.conftest import launch
from tests.serving.test_failures import _metric
from tests.serving.test_hetero_tp import (  # noqa: F401 (fixtures)
    BLOCK,
    MAX_TOKENS,
    NUM_LAYERS,
    TEXT_PROMPTS,
    _cancel_at_every_stage_then_check_free,
    _check_parity,
    _staging_all_free,
    _wait_idle,
    expected,
    models,
)

pytestmark = pytest.mark.slow
PER_RANK = ("--kv-agents", "per-rank")


def _writes(server, prompt) -> int:
    """NIXL requests the prefill instance (all its ranks) posted for one request."""
    n0 = server.workers()["prefill-0"]["kv_transfer_requests"]
    server.client().completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    for _ in range(50):  # ranks' counts reach rank 0 with its next poll of them
        n = server.workers()["prefill-0"]["kv_transfer_requests"] - n0
        if n:
            return n
        time.sleep(0.1)
    return 0


CASES = [("llama", "p:2,d:1", 2), ("llama", "p:1,d:2", 2), ("llama", "p:2,d:2", 2), ("llava", "e:1,p:2,d:1", 2)]


@pytest.mark.parametrize("kind,pools,writes_per_layer", CASES, ids=[f"{k}-{p}" for k, p, _ in CASES])
def test_per_rank_parity_and_transfer_counts(kind, pools, writes_per_layer, models, expected):
    tp = pools.removeprefix("e:1,")
    with launch(models[kind], pools, "--tp", tp, "--block-size", str(BLOCK), *PER_RANK,
                "--max-num-batched-tokens", "16") as server:
        before = {k: v for k, v in server.workers().items() if "num_free_blocks" in v}  # not the encoder
        assert before["prefill-0"]["num_staging_blocks"] > 0
        _check_parity(server, *expected[kind])
        for prompt in (TEXT_PROMPTS[1], TEXT_PROMPTS[0]):  # 6 blocks over 3 chunks, then 1 block
            assert _writes(server, prompt) == NUM_LAYERS * writes_per_layer
        after = _wait_idle(server, before)
        assert _staging_all_free(after)
        for inst in before:
            assert after[inst]["num_free_blocks"] == before[inst]["num_free_blocks"], (inst, after[inst])


def test_per_rank_cancels_free_staging_and_blocks(models, expected):
    """Requests cancelled at every stage (reserve, prefill, transfer, decode) on p:2 -> d:1:
    every staging range and KV block of both instances is free again, and it still serves."""
    with launch(models["llama"], "p:2,d:1", "--tp", "p:2,d:1", "--block-size", str(BLOCK), *PER_RANK,
                "--max-num-batched-tokens", "16") as server:
        client = server.client()
        client.completions.create(model=server.model, prompt=TEXT_PROMPTS[0], max_tokens=2, temperature=0)
        before = _wait_idle(server, server.workers())
        after = _cancel_at_every_stage_then_check_free(server, before)
        for inst in before:
            assert not after[inst].get("num_held", 0) and not after[inst].get("num_quarantined", 0)
        _check_parity(server, expected["llama"][0], None)


def test_killed_decode_tp_rank_takes_its_instance_down_and_streams_migrate(models, expected):
    """p:1 -> two decode instances of TP 2: SIGKILL rank 1 of the busy one mid-stream. Its
    rank 0 exits, the streams migrate to the other instance, and every request ends equal
    to the undisturbed run. The launcher restarts the instance, and it serves again."""
    prompts = [TEXT_PROMPTS[1], TEXT_PROMPTS[2], list(range(100, 130)), list(range(200, 240))]
    long = 60
    with launch(models["llama"], "p:1,d:4", "--tp", "p:1,d:2", "--block-size", str(BLOCK), *PER_RANK,
                "--max-num-seqs", "8") as server:
        def complete(prompt, on_chunk=None) -> str:
            return stream_text(server.url, server.model, prompt, long, on_chunk)

        with ThreadPoolExecutor(4) as pool:
            want = list(pool.map(complete, prompts))
        streamed = [0] * len(prompts)
        def attempt(prompt, on_chunk) -> str:
            try:
                return complete(prompt, on_chunk)
            except Exception as e:  # reported with the server's log below
                return repr(e)

        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(attempt, p, lambda n, i=i: streamed.__setitem__(i, n)) for i, p in enumerate(prompts)]
            deadline = time.monotonic() + 120
            while min(streamed) < 3:
                assert time.monotonic() < deadline, streamed
                time.sleep(0.05)
            stats = server.workers()
            victim = max(("decode-0", "decode-1"), key=lambda d: stats[d].get("num_running", 0))
            rank0 = server.worker_process(victim)
            rank1 = [c for c in rank0.children() if "spawn_main" in " ".join(c.cmdline())]
            assert len(rank1) == 1
            rank1[0].send_signal(signal.SIGKILL)
            got = [f.result(timeout=300) for f in futs]
        assert max(streamed) < long  # killed mid-stream
        assert got == want, "".join(line for line in server.lines if "NIXL INFO" not in line)[-4000:]
        gone, alive = psutil.wait_procs([rank0], timeout=30)
        assert not alive, "rank 0 outlived its killed TP rank"
        assert _metric(server, "epd_migrated_requests_total", instance=victim) >= 1
        # The launcher restarts the instance under its old agent names (new NIXL metadata):
        # the prefill ranks' agents must drop the dead ones and load the new, else every write
        # to it fails (NIXL_ERR_NOT_ALLOWED) while /health says 200.
        deadline = time.monotonic() + 180
        while _metric(server, "epd_worker_restarts_total", instance=victim) < 1 or victim not in server.workers():
            assert time.monotonic() < deadline, "the killed instance was not restarted"
            time.sleep(0.5)
        routed = _metric(server, "epd_routing_decisions_total", pool="decode", instance=victim)
        failed = [_metric(server, m) for m in ("epd_kv_transfer_failures_total", "epd_request_retries_total")]
        for _ in range(3):
            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(complete, prompts)) == want
            if _metric(server, "epd_routing_decisions_total", pool="decode", instance=victim) > routed:
                break
        assert _metric(server, "epd_routing_decisions_total", pool="decode", instance=victim) > routed, \
            "the restarted instance got no request"
        # ... and reached it: no write failed and no request was retried around it
        assert [_metric(server, m) for m in ("epd_kv_transfer_failures_total", "epd_request_retries_total")] == failed


@pytest.fixture(scope="module")
def four_heads(tiny_model_dirs, tmp_path_factory):
    """(path, TEXT_PROMPTS texts) of a tiny random Llama with 4 KV heads (TP 4 divides them),
    the texts from the TP=1 offline engine, whose tokens equal transformers' here."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from epd import LLM, SamplingParams
    from tests.conftest import hf_greedy

    src = Path(tiny_model_dirs["llama"])
    out = tmp_path_factory.mktemp("tp4") / "llama-4kv"
    cfg = LlamaConfig.from_pretrained(src)
    cfg.num_attention_heads = cfg.num_key_value_heads = 4
    cfg.head_dim = cfg.hidden_size // 4
    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(out))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    llm = LLM(str(out), dtype="float32")
    outs = llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(out), TEXT_PROMPTS, MAX_TOKENS)
    return str(out), [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("tp", ["p:2,d:4", "p:4,d:2"])
def test_per_rank_two_to_four_and_four_to_two(tp, four_heads):
    """2 -> 4: each prefill rank's heads split over two decode ranks; 4 -> 2: two prefill
    ranks fill each decode rank. max(TP) = 4 writes per layer either way."""
    path, texts = four_heads
    with launch(path, tp, "--tp", tp, "--block-size", str(BLOCK), *PER_RANK,
                "--max-num-batched-tokens", "16") as server:
        before = server.workers()
        _check_parity(server, texts, None)
        for prompt in (TEXT_PROMPTS[1], TEXT_PROMPTS[0]):
            assert _writes(server, prompt) == NUM_LAYERS * 4
        after = _wait_idle(server, before)
        assert _staging_all_free(after)
        for inst in before:
            assert after[inst]["num_free_blocks"] == before[inst]["num_free_blocks"], (inst, after[inst])


def test_killed_prefill_tp_rank_takes_its_instance_down_and_requests_finish(models, expected):
    """Two prefill instances of TP 2 (per-rank agents) -> d:1, under a stream of requests:
    SIGKILL rank 1 of prefill-0 after the first answers. Its rank 0 exits, the requests it
    held or is routed before the router sees it gone are prefilled on the other instance,
    and every answer equals the undisturbed run."""
    prompts = [list(range(10, 10 + n)) for n in (60, 70, 80, 90)] * 3
    with launch(models["llama"], "p:4,d:1", "--tp", "p:2,d:1", "--block-size", str(BLOCK), *PER_RANK,
                "--max-num-batched-tokens", "16", "--max-prefill-tokens-with-decodes", "16") as server:
        client = server.client()

        def complete(prompt) -> str:
            try:
                return client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            except Exception as e:  # reported with the server's log below
                return repr(e)

        with ThreadPoolExecutor(4) as pool:
            want = list(pool.map(complete, prompts))
        assert not any(w.startswith(("APIError", "InternalServerError")) for w in want), want
        rank0 = server.worker_process("prefill-0")
        rank1 = [c for c in rank0.children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(rank1) == 1
        done = [0]

        def counted(prompt) -> str:
            out = complete(prompt)
            done[0] += 1
            return out

        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(counted, p) for p in prompts]
            deadline = time.monotonic() + 120
            while done[0] < 2:
                assert time.monotonic() < deadline, "no answers"
                time.sleep(0.01)
            rank1[0].send_signal(signal.SIGKILL)
            got = [f.result(timeout=300) for f in futs]
        assert got == want, "".join(line for line in server.lines if "NIXL INFO" not in line)[-4000:]
        gone, alive = psutil.wait_procs([rank0], timeout=30)
        assert not alive, "rank 0 outlived its killed TP rank"
        # the instance leaves the pool; the other one takes new requests
        assert complete(prompts[0]) == want[0]


def test_prefill_tp_ranks_reach_a_restarted_decode_instance(models, expected):
    """p:2 (per-rank agents) -> d:1: SIGKILL the decode worker. The launcher restarts it
    under its old agent name with new NIXL metadata, and each prefill rank's own agent
    replaces the dead one, so requests are served again without a failed write or a retry
    (before, rank 1's agent kept the dead agent and every request failed with 503)."""
    with launch(models["llama"], "p:2,d:1", "--tp", "p:2,d:1", "--block-size", str(BLOCK), *PER_RANK) as server:
        _check_parity(server, expected["llama"][0], None)
        server.worker_process("decode-0").send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 180
        while _metric(server, "epd_worker_restarts_total", instance="decode-0") < 1 \
                or "decode-0" not in server.workers():
            assert time.monotonic() < deadline, "the killed decode instance was not restarted"
            time.sleep(0.5)
        failed = [_metric(server, m) for m in ("epd_kv_transfer_failures_total", "epd_request_retries_total")]
        _check_parity(server, expected["llama"][0], None)
        assert [_metric(server, m) for m in ("epd_kv_transfer_failures_total", "epd_request_retries_total")] == failed
