"""Failure recovery with real processes: SIGKILL / SIGSTOP workers of a running
`epd launch` while requests are in flight, and check what the client gets.

Every request that can complete must complete with the tokens of an undisturbed
run (greedy; the outputs are compared as text, produced by the same tokenizer);
requests that cannot (no live instance left) fail with a clear 503 quickly; no
block, reservation or buffer leaks on a surviving worker; a killed worker is
restarted and serving resumes.
"""

from __future__ import annotations

import base64
import io
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from epd.models.tiny import create_tiny_model
from tests.conftest import metric_sum
from tests.serving.conftest import Server, launch

pytestmark = pytest.mark.slow

LONG = 320  # tokens per streamed answer: long enough to kill a worker mid-stream, even on an idle machine


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("fail") / "llama"))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("fail") / "llava"))


def _prompt(i: int) -> list[int]:
    return [100 + 7 * i + k for k in range(12 + i)]


def _complete(server: Server, prompt, max_tokens: int = LONG, stream: bool = True, on_chunk=None) -> str:
    """Greedy completion; with ``stream`` the text is the concatenated chunks."""
    client = server.client()
    kw = dict(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].text
    parts = []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            if on_chunk is not None:
                on_chunk(len(parts))
    return "".join(parts)


def _metric(server: Server, name: str, **labels) -> float:
    """Sum of a counter's samples whose labels include ``labels``."""
    return metric_sum(httpx.get(server.url + "/metrics", timeout=30).text, name, **labels)


def _wait_idle(server: Server, before: dict, timeout_s: float = 60.0) -> dict:
    """Poll worker stats until every instance in ``before`` is back to its free-block
    count with nothing reserved, held or quarantined; return the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = server.workers()
        if all(inst in after and after[inst].get("num_free_blocks") == stats.get("num_free_blocks")
               and not any(after[inst].get(k, 0) for k in ("num_reserved", "num_held", "num_held_requests",
                                                            "num_quarantined", "num_running", "num_waiting"))
               for inst, stats in before.items()):
            return after
        if time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def _assert_idle(server: Server, before: dict) -> None:
    after = _wait_idle(server, before)
    for inst, stats in before.items():
        assert inst in after, f"{inst} did not come back: {sorted(after)}"
        assert after[inst].get("num_free_blocks") == stats.get("num_free_blocks"), (inst, after[inst])
        for k in ("num_reserved", "num_held", "num_held_requests", "num_quarantined", "num_running"):
            assert not after[inst].get(k, 0), (inst, k, after[inst])


def _wait_healthy(server: Server, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the server did not become healthy again"
        time.sleep(0.25)


@pytest.mark.parametrize("pools,role", [("p:1,d:2", "decode"), ("pd:2", "pd")])
def test_decode_killed_mid_stream_migrates_every_request(llama_dir, pools, role):
    """SIGKILL the decode (or aggregated) worker that streams 8 requests: every
    request completes, token for token equal to the undisturbed run, and the kill
    shows up as migrations, a worker failure and a restart."""
    with launch(llama_dir, pools, "--max-num-seqs", "16") as server:
        prompts = [_prompt(i) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            expected = list(pool.map(lambda p: _complete(server, p), prompts))
        assert all(expected)
        before = server.workers()

        streamed = [0] * 8
        started = threading.Event()

        def progress(i, n):
            streamed[i] = n
            if min(streamed) >= 5:
                started.set()

        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(_complete, server, p, LONG, True, lambda n, i=i: progress(i, n))
                    for i, p in enumerate(prompts)]
            assert started.wait(120), f"requests did not start streaming: {streamed}"
            stats = server.workers()
            victim = max((f"{role}-0", f"{role}-1"), key=lambda d: stats[d].get("num_running", 0))
            assert stats[victim]["num_running"] > 0
            server.worker_process(victim).send_signal(signal.SIGKILL)
            got = [f.result(timeout=300) for f in futs]
        assert max(streamed) < LONG  # the kill really happened mid-stream
        assert got == expected
        assert _metric(server, "epd_migrated_requests_total", pool=role, instance=victim) >= 1
        assert _metric(server, "epd_worker_failures_total", instance=victim) >= 1
        _wait_healthy(server)
        assert _metric(server, "epd_worker_restarts_total", instance=victim) == 1
        # The restarted worker serves again, and nothing leaked anywhere.
        _assert_idle(server, before)
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: _complete(server, p, stream=False), prompts[:4])) == expected[:4]



#: sampling that depends on the output so far: penalties (greedy), a seeded generator (sampled)
MIGRATED_SAMPLING = [dict(temperature=0, frequency_penalty=1.5), dict(temperature=0.8, seed=4242),
                     dict(temperature=0.8, seed=7, presence_penalty=1.0, frequency_penalty=0.5)]


def _sampled_stream(server: Server, prompt, sampling: dict, on_chunk=None) -> str:
    """A streamed completion of ``LONG`` tokens with ``sampling``: the concatenated text."""
    text = ""
    stream = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=LONG, stream=True,
                                                extra_body={"ignore_eos": True}, **sampling)
    for n, chunk in enumerate(c for c in stream if c.choices and c.choices[0].text):
        text += chunk.choices[0].text
        if on_chunk is not None:
            on_chunk(n + 1)
    return text


def test_migration_keeps_penalties_and_seeded_generator(llama_dir):
    """p:1,d:2: SIGKILL the decode worker streaming penalized greedy and seeded sampled
    requests: each migrated request continues exactly as the undisturbed run, since the
    tokens streamed before the kill still count as output for the penalties and the
    seeded generator resumes after their draws."""
    with launch(llama_dir, "p:1,d:2", "--max-num-seqs", "16") as server:
        jobs = [(_prompt(i), MIGRATED_SAMPLING[i % len(MIGRATED_SAMPLING)]) for i in range(6)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            expected = list(pool.map(lambda job: _sampled_stream(server, *job), jobs))
        assert all(expected)
        counts = [0] * len(jobs)
        going = threading.Event()

        def seen(i: int, n: int) -> None:
            counts[i] = n
            if min(counts) >= 5:
                going.set()

        with ThreadPoolExecutor(len(jobs)) as pool:
            futs = [pool.submit(_sampled_stream, server, p, kw, lambda n, i=i: seen(i, n))
                    for i, (p, kw) in enumerate(jobs)]
            assert going.wait(120), f"requests did not start streaming: {counts}"
            running = {d: server.workers()[d].get("num_running", 0) for d in ("decode-0", "decode-1")}
            victim = max(running, key=running.get)
            assert running[victim] > 0
            server.worker_process(victim).send_signal(signal.SIGKILL)
            got = [f.result(timeout=300) for f in futs]
        assert max(counts) < LONG  # killed mid-stream
        assert _metric(server, "epd_migrated_requests_total", pool="decode", instance=victim) >= 1
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, (i, jobs[i][1])

def test_only_prefill_killed_fails_fast_then_restart_serves(llama_dir):
    """The only prefill worker dies with requests queued on it: they fail with a
    clear 503 well within the stage timeout, new requests fail at once while it is
    down, and the launcher's restart brings serving back."""
    with launch(llama_dir, "p:1,d:1", "--stage-timeout", "60") as server:
        ref = _complete(server, _prompt(1), max_tokens=8, stream=False)
        before = server.workers()
        victim = server.worker_process("prefill-0")
        victim.send_signal(signal.SIGSTOP)  # requests pile up on it ...
        errors: list[BaseException] = []

        def one():
            try:
                _complete(server, _prompt(1), max_tokens=8, stream=False)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL)  # ... and it dies
        for t in threads:
            t.join(60)
        waited = time.monotonic() - t0
        assert len(errors) == 3, errors
        for e in errors:
            assert isinstance(e, openai.APIStatusError) and e.status_code == 503, e
            assert "prefill" in str(e)
        assert waited < 60  # failed before the stage deadline, not at it
        _wait_healthy(server)
        assert _complete(server, _prompt(1), max_tokens=8, stream=False) == ref
        assert _metric(server, "epd_worker_restarts_total", instance="prefill-0") == 1
        _assert_idle(server, {k: v for k, v in before.items() if k != "prefill-0"})


def _png(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(server: Server, seed: int) -> str:
    r = server.client().chat.completions.create(
        model=server.model, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(seed)}},
                                               {"type": "text", "text": "What is this?"}]}])
    return r.choices[0].message.content


def test_encode_worker_killed_mid_encode_retries_on_the_other(llava_dir):
    """e:2: an encode worker is frozen with encode requests on it, then killed:
    every request completes on the other encoder with the undisturbed answer."""
    with launch(llava_dir, "e:2,p:1,d:1") as server:
        seeds = list(range(8))
        with ThreadPoolExecutor(4) as pool:
            expected = list(pool.map(lambda s: _image_chat(server, s), seeds))
        before = {k: v for k, v in server.workers().items() if k != "encode-0"}
        victim = server.worker_process("encode-0")
        victim.send_signal(signal.SIGSTOP)
        with ThreadPoolExecutor(8) as pool:
            # new images (the encoder caches would answer repeats without encoding)
            futs = [pool.submit(_image_chat, server, 100 + s) for s in seeds]
            time.sleep(1.0)
            victim.send_signal(signal.SIGKILL)
            got = [f.result(timeout=300) for f in futs]
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda s: _image_chat(server, 100 + s), seeds))
        assert got == again and all(got)
        assert _metric(server, "epd_request_retries_total", pool="encode", instance="encode-0") >= 1
        assert [_image_chat(server, s) for s in seeds[:2]] == expected[:2]
        _assert_idle(server, before)


def test_hung_prefill_is_retried_and_fenced(llama_dir):
    """SIGSTOP one of two prefill workers with requests on it: they are retried on
    the other within the heartbeat timeout; when it wakes up it writes no stale KV
    (later answers are still exact) and it serves again."""
    with launch(llama_dir, "p:2,d:1") as server:
        prompts = [_prompt(i) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            expected = list(pool.map(lambda p: _complete(server, p, 24, False), prompts))
        before = server.workers()
        victim = server.worker_process("prefill-0")
        victim.send_signal(signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(6) as pool:
                got = list(pool.map(lambda p: _complete(server, p, 24, False), prompts))
            assert got == expected
            assert _metric(server, "epd_request_retries_total", pool="prefill", instance="prefill-0") >= 1
            stats = server.workers()  # still answers while a worker is frozen
            assert "num_free_blocks" in stats["prefill-1"] and "num_free_blocks" in stats["decode-0"]
            assert "num_free_blocks" not in stats.get("prefill-0", {})
        finally:
            victim.send_signal(signal.SIGCONT)
        _wait_healthy(server)
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(lambda p: _complete(server, p, 24, False), prompts)) == expected
        _assert_idle(server, before)


@pytest.mark.parametrize("policy", ["retry", "recompute"])
def test_kv_transfer_failure_policy(llama_dir, policy):
    """The first KV transfer fails (injected as a dead link would fail it): the request
    is retried through prefill or recomputed on the decode worker, and completes exactly."""
    with launch(llama_dir, "p:1,d:1", "--kv-failure-policy", policy,
                env={"EPD_INJECT_KV_FAILURES": "1"}) as server:
        before = server.workers()
        first = _complete(server, _prompt(3), 32)
        second = _complete(server, _prompt(3), 32)  # no failure injected any more
        assert first == second and first
        assert _metric(server, "epd_kv_transfer_failures_total") == 1
        assert _metric(server, "epd_kv_transfer_retries_total") == 1
        _assert_idle(server, before)


def test_leak_check_cancels_at_every_stage_and_a_decode_kill(llava_dir):
    """200 requests (text and image), about a third cancelled right away, after a delay
    or after some chunks, and one decode worker killed half-way: every surviving
    worker's blocks and buffers return to their start values, and every request
    that was not cancelled completes."""
    import asyncio
    import random

    with launch(llava_dir, "e:1,p:1,d:2", "--max-num-seqs", "32") as server:
        before = server.workers()
        rng = random.Random(0)
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        model = server.model
        results: dict[int, str] = {}
        # Drawn up front: the coroutines' later draws interleave by timing, the kinds must not.
        kinds = [rng.choice(["none", "none", "instant", "delay", "chunks"]) for _ in range(200)]

        async def one(i: int) -> None:
            kind = kinds[i]
            content = ([{"type": "image_url", "image_url": {"url": _png(i % 7)}}] if i % 3 == 0 else [])
            content.append({"type": "text", "text": f"Tell me about {i}"})
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                    max_tokens=40, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
            if kind == "instant":
                task = asyncio.ensure_future(stream)
                await asyncio.sleep(0)
                task.cancel()
                return
            if kind == "delay":
                task = asyncio.ensure_future(stream)
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                task.cancel()
                return
            s = await stream
            n, cut = 0, rng.randint(1, 6)
            async for _chunk in s:
                n += 1
                if kind == "chunks" and n >= cut:
                    await s.close()
                    return
            results[i] = "done"

        async def main():
            tasks = []
            for i in range(200):
                tasks.append(asyncio.ensure_future(one(i)))
                await asyncio.sleep(0.01)
                if i == 100:
                    server.worker_process("decode-1").send_signal(signal.SIGKILL)
            out = await asyncio.gather(*tasks, return_exceptions=True)
            return [o for o in out if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]

        errors = asyncio.run(main())
        assert not errors, errors[:3]
        assert len(results) >= 80
        _wait_healthy(server)
        _assert_idle(server, {k: v for k, v in before.items() if k != "decode-1"})
        enc = server.workers()["encode-0"]
        assert not enc.get("num_held", 0) and not enc.get("num_held_requests", 0), enc
