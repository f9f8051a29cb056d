"""``epd diagnose --json`` against real servers (`epd launch`, real workers, CPU): a healthy
server (idle, then lightly loaded) reports no symptom; each induced bottleneck is named.

- idle and light load on ``p:1,d:1``: no symptom; idle exits 3 (no traffic), light load 0 (healthy);
- long prompts on ``pd:1`` while short ones stream: ``prefill_steals_decode``;
- a flood of long prompts on ``p:1,d:2``: ``prefill_queue_dominates_ttft``,
  ``pool_ratio_mismatch`` (p:2,d:1) and, under a 0.5 s TTFT SLO, ``goodput_low``;
- the same flood with a 128-token step budget: ``prefill_budget_small`` instead;
- a tiny KV cache with many concurrent requests: ``decode_kv_short`` (preemptions) and
  ``decode_tpot_jitter`` (the preempted streams stall, the cache is full);
- clients that disconnect mid-stream: every block comes back, so no ``cancel_leak``
  (the check is evaluated, on the idle end of the window);
- random prompts against prompts that share a system prompt: ``prefix_cache_miss``
  only for the random ones;
- KV writes failing (fault injection): ``kv_transfer_slow``.

The load runs in threads (httpx streams against /v1/completions with token-id prompts)
while the command's window is open. The model is the tiny random llama family, widened
(hidden 256, 4 layers) so that a long prompt's prefill takes long enough on this CPU to
stall the streams that share its steps.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from epd.models.tiny import create_tiny_model
from tests.serving.conftest import launch

pytestmark = pytest.mark.slow

#: the server processes' threads (2-core machine: one thread each keeps the timings readable)
THREADS = ("--threads-per-worker", "1")


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """The tiny llama checkpoint (its tokenizer and config), widened to hidden 256 x 4 layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = create_tiny_model("llama", tmp_path_factory.mktemp("diagnose") / "llama")
    cfg = AutoConfig.from_pretrained(path)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 768, 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


def diagnose(server, window_s: float, *extra: str) -> tuple[int, dict]:
    """Run ``epd diagnose --json`` on ``server``; returns (exit code, its JSON)."""
    r = subprocess.run([sys.executable, "-m", "epd.cli", "diagnose", "--url", server.url, "--window", str(window_s),
                        "--interval", "0.5", "--json", *extra], capture_output=True, text=True,
                       timeout=window_s + 60)
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def start_diagnose(server, window_s: float, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "epd.cli", "diagnose", "--url", server.url, "--window",
                             str(window_s), "--interval", "0.5", "--json", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 90) -> tuple[int, dict]:
    out, err = proc.communicate(timeout=timeout_s)
    assert out, err
    return proc.returncode, json.loads(out)


def check(data: dict, cid: str, pool: str | None = "any") -> dict:
    got = [c for c in data["checks"] if c["id"] == cid and (pool == "any" or c["pool"] == pool)]
    assert len(got) == 1, got
    return got[0]


def symptoms(data: dict) -> set[str]:
    return {s["id"] for s in data["symptoms"]}


def summary(data: dict) -> str:
    return json.dumps({"symptoms": [(s["id"], s["pool"], s["detail"]) for s in data["symptoms"]],
                       "checks": [(c["id"], c["pool"], c["status"], c["detail"]) for c in data["checks"]]}, indent=1)


class Load:
    """``threads`` threads, each calling ``one(rng)`` in a loop until :meth:`stop`."""

    def __init__(self, one, threads: int, seed: int = 0) -> None:
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self.count = 0

        def loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while not self.done.is_set():
                try:
                    one(rng)
                    self.count += 1
                except BaseException as e:  # reported by stop()
                    self.errors.append(e)
                    return

        self.threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def stop(self) -> int:
        self.done.set()
        for t in self.threads:
            t.join(120)
        assert not self.errors, self.errors[:3]
        return self.count


def stream_model(server, model: str, prompt: list[int], max_tokens: int, cut_after: int | None = None) -> int:
    """Stream one completion of token-id ``prompt``; with ``cut_after``, disconnect after that
    many chunks. Returns the chunks read."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    n = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += 1
                if cut_after is not None and n >= cut_after:
                    break  # leaving the block closes the connection: the server cancels the request
    return n


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 400) for _ in range(n)]


SYSTEM = tokens(random.Random(7), 96)  # a shared system prompt: 6 blocks of 16


# ---- healthy ------------------------------------------------------------------------------------------
def test_idle_and_lightly_loaded_server_is_healthy(small_llama):
    with launch(small_llama, "p:1,d:1", "--kv-cache-memory-gb", "0.05", *THREADS) as server:
        rc, data = diagnose(server, 3)  # idle: nothing judged, so not called healthy (exit 3)
        assert rc == 3 and data["status"] == "no_traffic" and not data["symptoms"], summary(data)
        assert all(c["status"] in ("not_evaluated", "not_applicable") for c in data["checks"]), summary(data)

        model = server.model
        load = Load(lambda rng: stream_model(server, model, SYSTEM + tokens(rng, 8), 24), threads=2)
        time.sleep(1.0)
        rc, data = diagnose(server, 10)
        load.stop()
        assert rc == 0 and data["status"] == "healthy" and not data["symptoms"], summary(data)
        evaluated = {c["id"] for c in data["checks"] if c["status"] == "ok"}
        assert {"kv_transfer_slow", "decode_kv_short", "prefix_cache_miss", "goodput_low",
                "prefill_queue_dominates_ttft", "decode_tpot_jitter"} <= evaluated, summary(data)
        assert data["pools"]["api"]["stages"]["ttft"]["count"] > 0
        assert data["pools"]["prefill"]["caches"]["prefix_hit_rate"] > 0.5


# ---- prefill steals decode ---------------------------------------------------------------------------------
def test_long_prompts_on_an_aggregated_pool_steal_decode_steps(small_llama):
    """pd:1: three short prompts stream 64 tokens each (alone: healthy), then a fourth client
    sends 1,500-token prompts; the steps that carry those prefills (stall-free batching off)
    stall every stream."""
    with launch(small_llama, "pd:1", "--kv-cache-memory-gb", "0.1", "--max-prefill-tokens-with-decodes", "0",
                "--target-step-ms", "0", *THREADS) as server:
        model = server.model
        short = Load(lambda rng: stream_model(server, model, tokens(rng, 16), 64), threads=3, seed=1)
        time.sleep(1.0)
        rc, alone = diagnose(server, 5, "--ignore", "prefix_cache_miss")  # the control: short prompts only
        assert rc == 0 and check(alone, "prefill_steals_decode")["status"] == "ok", summary(alone)
        long = Load(lambda rng: (stream_model(server, model, tokens(rng, 1500), 1), time.sleep(0.3)), threads=1,
                    seed=2)
        time.sleep(1.0)
        rc, data = diagnose(server, 10, "--ignore", "prefix_cache_miss")
        long.stop()
        short.stop()
        assert rc == 1 and "prefill_steals_decode" in symptoms(data), summary(data)
        assert check(data, "prefill_steals_decode")["pool"] == "pd"


# ---- prefill queue -----------------------------------------------------------------------------------------
FLOOD_CLIENTS, FLOOD_PROMPT = 16, 900  # closed loop: 16 prompts of 900 tokens always waiting


def flood(server, window_s: float, *extra: str) -> tuple[int, dict]:
    model = server.model
    load = Load(lambda rng: stream_model(server, model, tokens(rng, FLOOD_PROMPT), 4), threads=FLOOD_CLIENTS, seed=8)
    time.sleep(2.0)
    try:
        return diagnose(server, window_s, "--ignore", "prefix_cache_miss", *extra)
    finally:
        load.stop()


def test_a_flood_of_long_prompts_on_one_prefill_instance_queues(small_llama):
    """p:1,d:2 under 16 clients sending 900-token prompts: the prefill instance batches several
    prompts per step and still the queue dominates TTFT (add prefill instances), while both
    decode instances idle (the pools are out of proportion: p:2,d:1); and few requests meet a
    0.5 s TTFT SLO (goodput far below throughput)."""
    with launch(small_llama, "p:1,d:2", "--kv-cache-memory-gb", "0.05", *THREADS) as server:
        rc, data = flood(server, 8, "--ttft-slo", "0.5")
    assert rc == 1 and {"prefill_queue_dominates_ttft", "goodput_low"} <= symptoms(data), summary(data)
    assert check(data, "prefill_budget_small")["status"] == "ok", summary(data)
    ratio = check(data, "pool_ratio_mismatch")
    assert ratio["status"] == "symptom" and ratio["evidence"]["suggested_pools"] == "p:2,d:1", summary(data)


def test_a_small_step_token_budget_leaves_prefill_under_used(small_llama):
    """The same flood on p:1,d:1 with --max-num-batched-tokens 128: each prompt is prefilled
    alone over 8 steps while the others queue: prefill_budget_small, not more instances."""
    with launch(small_llama, "p:1,d:1", "--kv-cache-memory-gb", "0.05", "--max-num-batched-tokens", "128",
                *THREADS) as server:
        rc, data = flood(server, 8)
    assert rc == 1 and "prefill_budget_small" in symptoms(data), summary(data)
    assert check(data, "prefill_queue_dominates_ttft")["status"] == "ok", summary(data)
    assert check(data, "pool_ratio_mismatch")["status"] == "ok", summary(data)


# ---- decode KV short ------------------------------------------------------------------------------------------
def test_a_tiny_decode_kv_cache_preempts(small_llama):
    """p:1,d:1 with 24 KV blocks of 16 tokens per worker and 8 clients streaming 120 tokens of
    32-token prompts (10 blocks each at the end): the decode worker preempts (decode_kv_short),
    and the streams it preempts stall while the cache is full (decode_tpot_jitter)."""
    with launch(small_llama, "p:1,d:1", "--num-kv-blocks", "24", "--max-model-len", "256", *THREADS) as server:
        model = server.model
        load = Load(lambda rng: stream_model(server, model, tokens(rng, 32), 120), threads=8, seed=3)
        time.sleep(1.0)
        rc, data = diagnose(server, 10, "--ignore", "prefix_cache_miss")
        load.stop()
        assert rc == 1 and "decode_kv_short" in symptoms(data), summary(data)
        kv = check(data, "decode_kv_short", "decode")
        assert kv["status"] == "symptom" and kv["evidence"]["preemptions"] >= 2, summary(data)
        # the preempted streams stall (their KV is recomputed) while the cache is full
        jitter = check(data, "decode_tpot_jitter", "decode")
        assert jitter["status"] == "symptom" and jitter["evidence"]["kv_usage_max"] >= 0.9, summary(data)


# ---- cancelled streams -----------------------------------------------------------------------------------------
def test_disconnecting_clients_leave_no_blocks_behind(small_llama):
    """Clients that drop their streams after a few tokens, then an idle end of the window:
    the cancellations are counted and the leak check finds every block free."""
    with launch(small_llama, "p:1,d:1", "--kv-cache-memory-gb", "0.05", *THREADS) as server:
        model = server.model
        proc = start_diagnose(server, 12)
        time.sleep(1.0)
        load = Load(lambda rng: stream_model(server, model, SYSTEM + tokens(rng, 8), 64,
                                             cut_after=rng.randint(1, 4)), threads=4, seed=4)
        time.sleep(5.0)
        n = load.stop()
        rc, data = finish(proc)
        assert n >= 10
        leak = check(data, "cancel_leak")
        assert leak["status"] == "ok", summary(data)
        assert leak["evidence"]["cancelled"] >= 5
        assert "cancel_leak" not in symptoms(data)


# ---- prefix cache ---------------------------------------------------------------------------------------------------
def test_random_prompts_miss_the_prefix_cache_shared_system_prompts_hit_it(small_llama):
    with launch(small_llama, "pd:1", "--kv-cache-memory-gb", "0.05", *THREADS) as server:
        model = server.model
        random_prompts = Load(lambda rng: stream_model(server, model, tokens(rng, 160), 2), threads=2, seed=5)
        time.sleep(1.0)
        rc, random_data = diagnose(server, 8)
        random_prompts.stop()
        shared = Load(lambda rng: stream_model(server, model, SYSTEM + tokens(rng, 64), 2), threads=2, seed=6)
        time.sleep(1.0)
        rc_shared, shared_data = diagnose(server, 8)
        shared.stop()
    miss = check(random_data, "prefix_cache_miss", "pd")
    assert rc == 1 and miss["status"] == "symptom" and miss["evidence"]["hit_rate"] < 0.1, summary(random_data)
    hit = check(shared_data, "prefix_cache_miss", "pd")
    assert hit["status"] == "ok" and hit["evidence"]["hit_rate"] > 0.4, summary(shared_data)
    assert "prefix_cache_miss" not in symptoms(shared_data)


# ---- KV transfer ---------------------------------------------------------------------------------------
def test_failing_kv_writes_name_the_transfer(small_llama):
    """EPD_INJECT_KV_FAILURES fails the first two KV writes of the prefill worker (the request
    is retried, within --max-retries 2, and completes): kv_transfer_slow, with the failures as
    evidence."""
    with launch(small_llama, "p:1,d:1", "--kv-cache-memory-gb", "0.05", *THREADS,
                env={"EPD_INJECT_KV_FAILURES": "2"}) as server:
        model = server.model
        proc = start_diagnose(server, 6, "--ignore", "prefix_cache_miss")
        time.sleep(1.0)
        for i in range(5):
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": tokens(random.Random(i), 32), "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        rc, data = finish(proc)
    kv = check(data, "kv_transfer_slow")
    assert rc == 1 and kv["status"] == "symptom" and kv["evidence"]["failures"] >= 1, summary(data)
