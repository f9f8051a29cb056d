"""Public bug reports of disaggregated serving systems, replayed against a real server.

Each test names its row of /work/shared/bug-log.md (``test_rowNN_...``) and replays the
row's trigger; it asserts the exact behaviour the reported bug broke (greedy output equal
to the monolithic run, every block back, the HTTP status and message, cached_tokens).
Tests of other rows may join this file: each keeps its own fixtures. One server per
configuration, shared by the rows it serves (a class-scoped fixture, so it stops when its
class is done; the LLaVA server, module-scoped, serves the last tests), on tiny random
checkpoints with small KV caches.

Rows covered elsewhere (row-named there, or replayed exactly):

- rows 1 and 3 (client disconnect while decode waits for remote KV / during the NIXL
  transfer): tests/serving/test_stale_kv_writes.py
  ``test_bug_log_rows_1_and_3_disconnect_during_transfer_leaks_nothing`` (and
  ``test_aborted_prefill_never_writes_into_reused_blocks``);
- row 15 (dynamo#13088, requests hang under heavy worker add/remove churn): replayed by
  the worker-churn test of another issue, not here;
- row 22, offline part (a clip over the 30 s window through ``generate``):
  tests/encoders/test_processor.py ``test_audio_longer_than_window_is_split`` (Qwen2-Audio's
  tower, 31 s: two windows, 775 audio tokens) and tests/encoders/test_whisper.py
  ``test_long_audio_uses_both_windows`` (Whisper, 40 s); the online chat replay (Whisper
  front end, 35 s, e:1,p:1,d:1) is here;
- row 23 (stop string spanning two stream chunks): tests/serving/test_api.py
  ``test_stop_string_spanning_two_chunks_is_never_sent_in_part`` (/v1/completions,
  e:1,p:1,d:1); the chat-endpoint replay is here;
- rows 17 and 25, in part: tests/serving/test_disaggregated.py ``test_llava_parity_across_pools``
  ("Compare <image><image> now": adjacent placeholders) and tests/serving/test_api.py
  ``test_every_bad_request_gets_400_with_openai_body`` (n over --max-n); the rows' own
  triggers (adjacent parts swapped or repeated; n=10**7) are here.

Rows that cannot apply to epd:

- row 12 (sglang#12157, DeepSeek-V3.1 PD output wrong while TP=8 is fine): epd serves no
  MLA / DeepSeek model (Llama, Qwen2, Qwen3, LLaVA, Qwen2-Audio only); its P/D-vs-
  monolithic parity for the models it has is tests/serving/test_disaggregated.py and
  tests/serving/test_hetero_tp.py (and row 10 here);
- row 24 (Mooncake#1088, vllm-ascend#7846: transfer timeouts from a Mooncake RDMA
  misconfiguration or saturation): epd has no Mooncake transport (KV moves over NIXL /
  UCX); a transfer that fails or passes --kv-timeout is retried or recomputed, which
  tests/serving/test_failures.py ``test_kv_transfer_failure_policy`` replays with an
  injected transfer failure.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from PIL import Image
from transformers import AutoConfig, AutoTokenizer

from epd import LLM, SamplingParams
from epd.encoders.processor import MultiModalProcessor
from epd.models.tiny import IMAGE_TOKEN, create_tiny_model
from tests.serving.conftest import launch
from tests.serving.media import data_url, png
from tests.serving.public_bugs_helpers import (
    Reference,
    assert_error,
    assert_idle,
    check_idle,
    complete,
    metric,
    post,
    sse_events,
    streamed_text,
    wait_healthy,
    wait_idle,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 8


def _ids(seed: int, n: int) -> list[int]:
    """``n`` seeded random token ids, ordinary tokens of the tiny vocab (no special or media
    token): a prompt no other test sends, so it starts cold."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _body(prompt, max_tokens: int, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(create_tiny_model("llama", tmp_path_factory.mktemp("bugs") / "llama"))


@pytest.fixture(scope="module")
def llama_ref(llama_dir):
    ref = Reference(llama_dir)
    yield ref
    ref.close()


# ==== tiny Llama on e:1,p:1,d:1: rows 8, 9, 11, 13, 22 (Whisper), 23, 25, then 14 ===================
ROW14_MIN_BLOCKS = 200  # prompts of >= 200 blocks (1600 tokens) have their KV write held: only row 14's


@pytest.fixture(scope="class")
def text_pd(llama_dir):
    """Tiny Llama on e:1,p:1,d:1 (the encode worker is the Whisper speech front end of a
    text-only model), 8-token blocks, 64-token prefill chunks. Fault injection holds the
    last layer's KV write of >= 200 blocks for 30 s; only row 14 sends a prompt that long
    (and none of it is cached on the decode worker, which would then take fewer blocks)."""
    env = {"EPD_INJECT_KV_WRITE_DELAY_S": "30", "EPD_INJECT_KV_WRITE_DELAY_MIN_BLOCKS": str(ROW14_MIN_BLOCKS)}
    with launch(llama_dir, "e:1,p:1,d:1", "--block-size", str(BLOCK), "--max-num-batched-tokens", "64",
                env=env) as server:
        yield server


class TestTextPD:
    def test_row08_prompts_longer_than_the_prefill_chunk(self, text_pd, llama_ref):
        """Row 8 (sglang#6320): PD hung on any prompt longer than chunked_prefill_size
        (16,384) with a newer NIXL. Here the prefill chunk is 64 tokens
        (--max-num-batched-tokens 64) and four prompts of 65, 128, 129 and 300 tokens (2 to
        5 chunks, every chunk's KV written into the decode worker's blocks) stream at once:
        each answer equals the offline engine's (whose tokens are checked equal to
        transformers'), finished by length, and every worker is idle afterwards."""
        server = text_pd
        before = server.workers()
        prompts = [_ids(800 + n, n) for n in (65, 128, 129, 300)]
        llama_ref.check_transformers(prompts, 12)
        expected = llama_ref.texts(prompts, 12)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: sse_events(server, "/v1/completions", _body(p, 12)), prompts))
        for (status, events), want in zip(got, expected):
            assert status == 200 and events[-1] == "[DONE]", events[-2:]
            text, _, reason = streamed_text(events)
            assert (text, reason) == (want, "length")
        assert_idle(server, before)

    def test_row09_500_token_prompts(self, text_pd, llama_ref):
        """Row 9 (vllm#20440): a ~500-token prompt segfaulted with the NixlConnector while
        short prompts passed. Prompts of 499, 500, 512 and 513 tokens (a token short of, at,
        and past block boundaries) each equal the offline engine's answer (tokens checked
        against transformers), and a 5-token prompt still does afterwards; no worker died
        (same pids, no worker failure counted)."""
        server = text_pd
        pids = {i: server.worker_process(i).pid for i in ("prefill-0", "decode-0")}
        prompts = [_ids(900 + n, n) for n in (499, 500, 512, 513)] + [_ids(905, 5)]
        llama_ref.check_transformers(prompts, 8)
        for prompt, want in zip(prompts, llama_ref.texts(prompts, 8)):
            out = complete(server, prompt, 8)
            assert out["choices"][0]["text"] == want
            assert out["usage"]["prompt_tokens"] == len(prompt)
        assert {i: server.worker_process(i).pid for i in pids} == pids
        assert metric(server, "epd_worker_failures_total") == 0

    def test_row11_repeated_prompt_full_prefix_hit_equals_monolithic(self, text_pd, llama_ref):
        """Row 11 (vllm#52617, LMCache P/D): a long repeated "alpha beta gamma ..." prompt with
        the instruction at the end reported a full KV hit, yet its output diverged from the
        monolithic run at token 0. Replayed with such a prompt (its 8-token repeating unit
        fills whole blocks, so dozens of blocks hold the same tokens at different positions):
        cold, then again (every full block a prefix-cache hit), then the same repetition with
        another instruction, then a block-aligned variant twice (the second a hit of every
        block but the last). Every greedy answer, token 0 included, equals the offline
        engine's, whose tokens equal transformers'; cached_tokens is 0 cold, then exactly the
        full blocks of the longest cached prefix, short of the prompt's last token."""
        server = text_pd
        tok = llama_ref.tokenizer
        unit = tok.encode(" alpha beta gamma delta epsilon zeta eta theta", add_special_tokens=False)[:BLOCK]
        assert len(unit) == BLOCK
        rep = unit * 40  # 320 tokens, 40 identical blocks
        first = rep + tok.encode(" Now name the first word of this text.", add_special_tokens=False)
        other = rep + tok.encode(" Which word came last?", add_special_tokens=False)
        aligned = first[:len(first) // BLOCK * BLOCK - BLOCK] + first[-BLOCK:]
        assert len(aligned) % BLOCK == 0 and len(first) % BLOCK != 0
        prompts = [first, other, aligned]
        llama_ref.check_transformers(prompts, 16)
        want = dict(zip(("first", "other", "aligned"), llama_ref.texts(prompts, 16)))
        # (answer, prompt, cached tokens: every full block of the longest cached prefix, and
        # never the prompt's last token, which must be computed to sample token 0)
        full_hit = lambda p: (len(p) - 1) // BLOCK * BLOCK  # noqa: E731
        runs = [("first", first, 0), ("first", first, full_hit(first)), ("other", other, len(rep)),
                ("aligned", aligned, len(aligned) - BLOCK), ("aligned", aligned, full_hit(aligned))]
        for name, prompt, want_cached in runs:
            status, events = sse_events(server, "/v1/completions",
                                        _body(prompt, 16, stream_options={"include_usage": True}))
            assert status == 200
            text, pieces, _ = streamed_text(events)
            assert want[name].startswith(pieces[0]) and text == want[name], name
            usage = events[-2]["usage"]
            assert usage["prompt_tokens"] == len(prompt)
            assert usage["prompt_tokens_details"]["cached_tokens"] == want_cached, name

    def test_row13_cached_tokens_cold_and_repeated_prefix(self, text_pd):
        """Row 13 (vllm#43370; sglang#25972): usage.prompt_tokens_details.cached_tokens was
        prompt - 1 on a cold prompt, or double-counted past prompt_tokens (3968 vs 2023)
        when a 2k prefix repeated with the decode side's radix cache on (epd's decode
        worker caches the prompt blocks it received too). Here a unique prompt reports 0
        (completions, chat, streamed usage); a 1000-token prefix (125 blocks) repeated with
        other 5-token suffixes reports exactly 1000, for n=3 too, and 2000 for a batch of two
        such prompts (prompt_tokens 2010: each prompt once); never more than prompt_tokens."""
        server = text_pd

        def cached(body: dict, path: str = "/v1/completions") -> tuple[int, int]:
            r = post(server, path, body)
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            assert u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
            return u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]

        assert cached(_body(_ids(1300, 40), 2)) == (0, 40)
        chat = {"messages": [{"role": "user", "content": "Zürich 7193 quartz jalapeño, cold and unique."}],
                "max_tokens": 2, "temperature": 0}
        assert cached(chat, "/v1/chat/completions")[0] == 0
        cold = [{"role": "user", "content": "Tokyo 4406 café naïve, also cold."}]
        _, events = sse_events(server, "/v1/chat/completions",
                               {**chat, "messages": cold, "stream_options": {"include_usage": True}})
        assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        prefix = _ids(1301, 1000)
        suffixes = [[11 + i] + _ids(1310 + i, 4) for i in range(6)]
        assert cached(_body(prefix + suffixes[0], 2)) == (0, 1005)
        assert cached(_body(prefix + suffixes[1], 2)) == (1000, 1005)
        assert cached(_body(prefix + suffixes[2], 2, n=3, temperature=0.5, seed=1)) == (1000, 1005)
        assert cached(_body([prefix + suffixes[3], prefix + suffixes[4]], 2)) == (2000, 2010)
        _, events = sse_events(server, "/v1/completions",
                               _body(prefix + suffixes[5], 2, stream_options={"include_usage": True}))
        assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 1000

    def test_row23_stop_string_across_two_chunks_on_chat(self, text_pd):
        """Row 23 (dynamo PR #12562): a stop string spanning two stream chunks (e.g. "beta
        gamma") had its first part leaked to the client. The completions case is
        tests/serving/test_api.py::test_stop_string_spanning_two_chunks_is_never_sent_in_part;
        here the chat endpoint, with n=2: a stop string made of the end of one streamed
        chunk and the start of the next (its first occurrence) ends both choices' streams
        exactly before it, finish_reason "stop", as the non-streamed answer does."""
        server = text_pd
        stop = None
        for k in range(8):
            body = {"messages": [{"role": "user", "content": f"Tell a story about ships, number {k}."}],
                    "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            _, events = sse_events(server, "/v1/chat/completions", body)
            text, pieces, _ = streamed_text(events)
            pos = 0
            for a, b in zip(pieces, pieces[1:]):
                pos += len(a)
                cand = a[-2:] + b[:2]
                if len(a) >= 2 and len(b) >= 2 and text.find(cand) == pos - 2 and cand.strip() == cand:
                    stop = cand
                    break
            if stop is not None:
                break
        assert stop is not None, "no chunk boundary to put a stop string on"
        before = text[:text.index(stop)]
        _, events = sse_events(server, "/v1/chat/completions", {**body, "stop": [stop, "zzzz"], "n": 2})
        for index in (0, 1):
            got, _, reason = streamed_text(events, index)
            assert (got, reason) == (before, "stop"), (index, stop)
        r = post(server, "/v1/chat/completions", {**body, "stop": stop})
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (before, "stop")

    def test_row25_huge_n_is_refused_before_any_work(self, text_pd):
        """Row 25 (CVE-2026-34756): n=10**7 had the server build per-choice state until it
        ran out of memory, before scheduling. Here n=10**7 (completions and chat, streamed or
        not, one prompt or a batch) gets a 400 naming the limit (--max-n, 8) and param "n"
        (a batch: "prompt", its prompts x n being what is limited) at once; no worker sees a
        request (the prefill worker's prefix-cache lookups and the
        decode worker's free blocks do not move), and the server serves on."""
        server = text_pd
        before = server.workers()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        cases = [("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "n"),
                 ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, "prompt"),  # prompts x n
                 ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}, "n"),
                 ("/v1/chat/completions", chat, "n"), ("/v1/chat/completions", {**chat, "stream": True}, "n")]
        for path, body, param in cases:
            for n in (10**7, 9):
                assert_error(post(server, path, {**body, "n": n}, timeout=60), 400, "at most 8", param)
        after = server.workers()
        assert after["prefill-0"]["prefix_cache_query_tokens"] == before["prefill-0"]["prefix_cache_query_tokens"]
        assert after["decode-0"]["num_free_blocks"] == before["decode-0"]["num_free_blocks"]
        assert complete(server, "hi", 2, n=8)["usage"]["completion_tokens"] == 16

    def test_row22_35s_clip_through_online_chat_to_whisper(self, text_pd, llama_ref):
        """Row 22 (vllm PR #57769; same cause #56912): Whisper given a 35 s clip (over its
        30 s window) died with a tensor-size mismatch; the row leaves the online chat impact
        unverified. Here a 35 s clip of real speech goes through online chat to a text-only
        model, whose encode worker transcribes it with the Whisper tiny.en front end: 200;
        the prompt is exactly the chat template around the front end's offline transcript
        of the whole clip (both windows: it has words spoken after 0:30); the answer equals
        the offline engine's on that prompt; the encode worker lives on. (Qwen2-Audio's own
        tower over 30 s: tests/encoders/test_processor.py, offline.)"""
        from epd.encoders.audio import decode_audio
        from epd.encoders.speech import SpeechFrontEnd

        server = text_pd
        encoder_pid = server.worker_process("encode-0").pid
        pcm, sr = sf.read(str(ROOT / "tests/data/speech/long_40s.wav"), dtype="int16")
        assert sr == 16000
        buf = io.BytesIO()
        sf.write(buf, pcm[:35 * sr], sr, format="WAV", subtype="PCM_16")
        clip = buf.getvalue()
        front = SpeechFrontEnd()
        samples = decode_audio(clip, target_sample_rate=16000)
        transcript = front.transcribe(samples)
        assert "reading books" in transcript  # spoken after 0:30: the second window's words are there
        question = " Answer in one word."
        ids = llama_ref.chat_ids(transcript + question)
        want = llama_ref.text(ids, 8)
        r = post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
                {"type": "text", "text": question}]}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert r.json()["choices"][0]["message"]["content"] == want
        assert server.worker_process("encode-0").pid == encoder_pid
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200

    def test_row14_replaced_prefill_worker_is_taken_by_decode(self, text_pd, llama_ref):
        """Row 14 (vllm#58063; llm-d PR #2187 -> vllm#49238): a replaced prefill pod could not
        start (the decoders pinned memory for the old one) and decode segfaulted on the old
        prefill's stale NIXL agent. Replayed: the prefill worker is SIGKILLed while a
        1700-token prompt's KV is being written into the decode worker (fault injection
        holds its last layer's write), and the launcher starts a new one under the same
        instance id. The request fails with a 503 naming the prefill pool (or, retried on
        the new worker, equals the offline answer); the decode worker lives on (same pid,
        no failure counted), releases the dead writer's fenced reservation (every block
        back) and takes KV from the new worker: answers after the replacement equal the
        offline engine's, and no KV transfer failed."""
        server = text_pd
        before = server.workers()
        decode_pid = server.worker_process("decode-0").pid
        victim = server.worker_process("prefill-0")
        restarts = metric(server, "epd_worker_restarts_total", instance="prefill-0")
        long = _ids(7700, 1700)  # (a seed no other prompt here shares a prefix with: none of it is cached on decode)
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(r=post(server, "/v1/completions", _body(long, 4))))
        t.start()
        # Mid-transfer: decode holds the reservation, and the prefill worker is stuck in the
        # step whose layer hook is writing (it cannot answer a stats request: "unresponsive").
        deadline = time.monotonic() + 120
        while True:
            stats = server.workers()
            if stats["decode-0"].get("num_reserved") == 1 and stats["prefill-0"].get("unresponsive"):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        victim.send_signal(signal.SIGKILL)
        t.join(300)
        r = got["r"]
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == llama_ref.text(long, 4)
        else:
            assert_error(r, 503, "prefill")
        wait_healthy(server)
        assert metric(server, "epd_worker_restarts_total", instance="prefill-0") == restarts + 1
        assert server.worker_process("prefill-0").pid != victim.pid
        prompts = [_ids(1401 + i, 40 + 30 * i) for i in range(3)]
        for prompt, want in zip(prompts, llama_ref.texts(prompts, 8)):
            assert complete(server, prompt, 8)["choices"][0]["text"] == want
        assert_idle(server, before)
        assert server.worker_process("decode-0").pid == decode_pid
        assert metric(server, "epd_worker_failures_total", instance="decode-0") == 0
        assert metric(server, "epd_kv_transfer_failures_total") == 0


# ==== tiny Llama on p:1,d:1 with 24 KV blocks and injected faults: rows 2, 6, then 4, 5, 7 ==========
NUM_BLOCKS = 24  # 192 tokens: each worker holds one long prompt at a time
BROKEN_TEMPLATE = "{{ raise_exception('this chat template rejects every conversation') }}"


@pytest.fixture(scope="class")
def small_kv(llama_dir, tmp_path_factory):
    """Tiny Llama (same weights as ``llama_dir``; a chat template that rejects every
    conversation) on p:1,d:1 with 24 KV blocks of 8 per worker (max_model_len 192), no
    retries, and injected faults: the first PrefillRequest fails (an internal error) and
    the first two KV transfers fail."""
    d = tmp_path_factory.mktemp("bugs") / "llama-broken-template"
    shutil.copytree(llama_dir, d, dirs_exist_ok=True)
    (d / "chat_template.jinja").write_text(BROKEN_TEMPLATE)
    env = {"EPD_INJECT_HANDLER_ERROR": "PrefillRequest:internal:1", "EPD_INJECT_KV_FAILURES": "2"}
    with launch(str(d), "p:1,d:1", "--block-size", str(BLOCK), "--num-kv-blocks", str(NUM_BLOCKS),
                "--max-retries", "0", env=env) as server:
        yield server


@pytest.fixture(scope="class")
def spent_faults(small_kv) -> dict:
    """The triggers of rows 2 and 6, run once before any other request to ``small_kv`` (they
    spend its injected faults, so rows 4, 5 and 7, which ask for this fixture too, meet
    none): the responses and worker stats, for rows 2 and 6 to check."""
    server = small_kv
    rec: dict = {"before": server.workers()}
    body = _body(_ids(2000, 30), 8)
    # Row 2: requests rejected before any leg admits them, then a prefill leg rejected after
    # the decode leg reserved blocks for it.
    rec["unknown_model"] = post(server, "/v1/completions", {**body, "model": "no-such-model"})
    rec["bad_template"] = post(server, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    rec["invalid"] = post(server, "/v1/completions", {**body, "max_tokens": 500})
    rec["untouched"] = server.workers()
    rec["prefill_rejected"] = post(server, "/v1/completions", body)
    rec["after_reject"] = wait_idle(server, rec["before"])
    # Row 6: the KV transfer fails (a server-side abort mid-transfer), streamed and not.
    rec["kv_failed"] = post(server, "/v1/completions", _body(_ids(2001, 30), 8))
    rec["kv_failed_stream"] = sse_events(server, "/v1/completions", _body(_ids(2002, 30), 8))
    rec["after_kv"] = wait_idle(server, rec["before"])
    return rec


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict, on_line=None) -> str:
    """A streamed /v1/completions answer's text (choice 0); ``on_line(n)`` after each data line."""
    text, n = "", 0
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n += 1
            for ch in json.loads(line[6:]).get("choices", []):
                text += ch.get("text") or ""
            if on_line is not None and on_line(n):
                return text
    return text


class TestSmallKV:
    def test_row02_rejected_leg_strands_no_blocks(self, small_kv, spent_faults):
        """Row 2 (vllm PR #41269): a decode leg rejected before admission (bad chat template,
        validation error, unknown model) after the prefill succeeded stranded the prefill
        worker's blocks for up to 480 s. epd renders and validates in the API, before either
        leg: an unknown model (404), a chat template that raises (400) and max_tokens over
        the context (400) reach no worker (free blocks, prefix-cache lookups and KV writes
        unchanged everywhere). The leg order is decode (reserve) then prefill, so the
        replay of one leg rejected after the other admitted is a prefill worker failing the
        PrefillRequest (injected) after the decode worker reserved the blocks: the client
        gets a 500 at once, and every block on both workers is back, with no KV written."""
        rec = spent_faults
        assert_error(rec["unknown_model"], 404, "does not exist")
        assert_error(rec["bad_template"], 400, "chat template rejected", "messages")
        assert_error(rec["invalid"], 400, "exceeds max_model_len", "max_tokens")
        for inst, start in rec["before"].items():
            now = rec["untouched"][inst]
            for k in ("num_free_blocks", "prefix_cache_query_tokens", "kv_transfer_requests", "num_preemptions"):
                assert now.get(k) == start.get(k), (inst, k, now)
        err = assert_error(rec["prefill_rejected"], 500, "injected internal fault")
        assert err["type"] == "server_error"
        check_idle(rec["after_reject"], rec["before"])
        assert rec["after_reject"]["prefill-0"]["kv_transfer_requests"] == 0

    def test_row06_failed_transfer_or_overlong_input_is_an_error_not_length(self, small_kv, spent_faults):
        """Row 6 (sglang#33507): a request aborted mid-transfer (input over the max length,
        or a client abort during the KV transfer) came back as HTTP 200 with
        finish_reason "length". Here a KV transfer that fails with no retry left (injected,
        --max-retries 0) gives a 503 (with Retry-After) and no choices; streamed, an error
        event then [DONE], no choice and no finish_reason; the decode worker's reservation
        comes back. A prompt over max_model_len gets a 400 naming the limit, streamed or not.
        (A client abort has no client left to answer: rows 1 and 3 check what it leaves.)"""
        server = small_kv
        rec = spent_faults
        r = rec["kv_failed"]
        err = assert_error(r, 503, "KV write to decode-0")
        assert err["type"] == "service_unavailable_error" and "Retry-After" in r.headers
        assert "choices" not in r.json()
        status, events = rec["kv_failed_stream"]
        assert status == 200 and events[-1] == "[DONE]", events
        assert "KV write to decode-0" in events[-2]["error"]["message"]
        assert not any(isinstance(e, dict) and e.get("choices") for e in events), events
        check_idle(rec["after_kv"], rec["before"])
        assert metric(server, "epd_kv_transfer_failures_total") == 2
        for stream in (False, True):
            r = post(server, "/v1/completions", _body(_ids(2003, 200), 1, stream=stream))
            assert_error(r, 400, "max_model_len is 192", "prompt")

    def test_row07_input_just_above_the_limit(self, small_kv, spent_faults, llama_ref):
        """Row 7 (sglang#30233): an input just above max_req_input_len (284,937 vs 284,928)
        aborted the prefill while the decode side emitted garbage from the partial KV.
        Here max_model_len is 192 (the KV cache of 24 blocks of 8 lowered it): prompts of
        192 and 193 tokens, or 191 tokens with max_tokens 2, get a 400 naming the limit and
        reach no worker; prompts of 191 tokens (max_tokens 1: the first token, sampled on
        the prefill worker) and 190 tokens (max_tokens 2: one decode step on the whole
        transferred KV, every block of the cache) equal the offline engine's answers."""
        server = small_kv
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
        limit = models["max_model_len"]
        assert limit == NUM_BLOCKS * BLOCK
        before = server.workers()
        for n, max_tokens, match, param in ((limit, 1, "max_model_len is 192", "prompt"),
                                            (limit + 1, 1, "max_model_len is 192", "prompt"),
                                            (limit - 1, 2, "exceeds max_model_len", "max_tokens")):
            assert_error(post(server, "/v1/completions", _body(_ids(2100 + n, n), max_tokens)), 400, match, param)
        looked_up = "prefix_cache_query_tokens"
        assert server.workers()["prefill-0"][looked_up] == before["prefill-0"][looked_up]
        for n, max_tokens in ((limit - 1, 1), (limit - 2, 2)):
            prompt = _ids(2200 + n, n)
            out = complete(server, prompt, max_tokens)
            assert out["choices"][0]["text"] == llama_ref.text(prompt, max_tokens)
            assert out["usage"]["completion_tokens"] == max_tokens
        assert_idle(server, before)

    def test_row04_burst_of_long_prompts_with_cancels_does_not_wedge(self, small_kv, spent_faults, llama_ref):
        """Row 4 (TensorRT-LLM PR #13713): a burst of long prompts plus client cancels wedged
        the deployment: health 200 while every request timed out. Here 12 prompts of 150
        tokens (19 of each worker's 24 blocks: one at a time, the others queue for blocks)
        arrive at once and 6 of them are cancelled (before sending, after 0.05 to 0.6 s, or
        after their first streamed chunk). The other 6 complete, each equal to the offline
        answer; afterwards every block is back with nothing queued or reserved, and a new
        long prompt is served exactly."""
        server = small_kv
        before = server.workers()
        prompts = [_ids(4000 + i, 150) for i in range(13)]
        expected = llama_ref.texts(prompts, 16)
        cancels = {1: 0.0, 3: 0.05, 5: 0.2, 7: 0.6, 9: "chunk", 11: "chunk"}

        async def one(i: int, client: httpx.AsyncClient):
            body = _body(prompts[i], 16)
            how = cancels.get(i)
            if how is None:
                return await _stream_text(client, server.url, body)
            if how == "chunk":
                return await _stream_text(client, server.url, body, on_line=lambda n: True)
            try:
                return await asyncio.wait_for(_stream_text(client, server.url, body), how)
            except TimeoutError:
                return None

        async def burst():
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=16)) as client:
                return await asyncio.gather(*(one(i, client) for i in range(12)))

        got = asyncio.run(burst())
        for i in range(0, 12, 2):
            assert got[i] == expected[i], i
        assert_idle(server, before)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert complete(server, prompts[12], 16)["choices"][0]["text"] == expected[12]

    def test_row05_abort_while_decode_requests_are_preempted(self, small_kv, spent_faults, llama_ref):
        """Row 5 (sglang#18701; PR #9817; PR #21652): decode memory leaked when requests were
        aborted after load had retracted (preempted) some of them. Here 6 streams of
        16-token prompts decode up to 170 tokens each on a decode worker of 24 blocks, so it
        has to preempt (by recompute) to go on; once a preempted request waits there, every
        client hangs up. Every block comes back, nothing is left running, waiting or
        reserved, and a new request equals the offline answer. (epd has no KV offload: the
        row's "abort while offload is in flight" has no counterpart.)"""
        server = small_kv
        before = server.workers()
        preemptions = before["decode-0"]["num_preemptions"]
        prompts = [_ids(5000 + i, 16) for i in range(7)]
        seen: dict = {}

        async def run():
            async with httpx.AsyncClient(timeout=300) as client:
                streams = [asyncio.ensure_future(_stream_text(client, server.url, _body(p, 170)))
                           for p in prompts[:6]]
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not all(s.done() for s in streams):
                    d = (await client.get(server.url + "/epd/workers")).json()["decode-0"]
                    if d.get("num_preemptions", 0) > preemptions and d.get("num_waiting", 0) > 0:
                        seen.update(d)
                        break
                    await asyncio.sleep(0.02)
                for s in streams:
                    s.cancel()
                await asyncio.gather(*streams, return_exceptions=True)

        asyncio.run(run())
        assert seen, "the decode worker never had a preempted request waiting"
        assert_idle(server, before)
        assert complete(server, prompts[6], 24)["choices"][0]["text"] == llama_ref.text(prompts[6], 24)


# ==== row 10: prefill TP 2 -> decode TP 1 under concurrency ===========================================
@pytest.fixture(scope="class")
def tp_server(llama_dir):
    """Tiny Llama, one prefill instance of TP 2 (one KV head per rank) and one decode
    instance of TP 1, KV through staging pools of 1 MiB (256 blocks of 8 tokens each)."""
    with launch(llama_dir, "p:2,d:1", "--tp", "p:2,d:1", "--block-size", str(BLOCK), "--kv-staging-mb", "1") as s:
        yield s


class TestHeteroTP:
    def test_row10_prefill_tp2_decode_tp1_under_concurrent_load(self, tp_server, llama_ref):
        """Row 10 (sglang#15674): prefill TP 2 -> decode TP 1 with a non-MLA model (Qwen3-32B)
        crashed under load (128 concurrent requests). Here tiny Llama (4 attention heads, 2
        KV heads: one per prefill rank), whose staged KV moves through 1 MiB staging pools
        (256 blocks), takes 16 concurrent requests (not 128: a 2-core test machine) of 130
        tokens, 17 blocks each, 272 together: more than a staging pool holds. Every answer
        equals the offline TP-1 engine's (two checked against transformers), no worker
        died, and every KV and staging block is free afterwards."""
        server = tp_server
        before = server.workers()
        assert before["prefill-0"]["num_staging_blocks"] == 256
        prompts = [_ids(6000 + i, 130) for i in range(16)]
        llama_ref.check_transformers(prompts[:2], 12)
        expected = llama_ref.texts(prompts, 12)
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda p: complete(server, p, 12)["choices"][0]["text"], prompts))
        assert got == expected
        assert metric(server, "epd_worker_failures_total") == 0
        assert_idle(server, before)


# ==== tiny LLaVA on e:1,p:1,d:1: rows 16, 17, 20, 21, then 18 and 19 (its server lives to the end) ===
@pytest.fixture(scope="module")
def placeholder_llava(tmp_path_factory):
    """A tiny LLaVA with the string-only chat template (media become placeholder text inline,
    16 tokens each once expanded: the layout where a typed "<image>" and a real image's slot
    look alike) and its server: e:1,p:1,d:1, 8-token blocks."""
    d = str(create_tiny_model("llava", tmp_path_factory.mktemp("bugs") / "llava"))
    with launch(d, "e:1,p:1,d:1", "--block-size", "8", "--max-model-len", "512") as server:
        yield d, server


@pytest.fixture(scope="module")
def llava_ref(placeholder_llava):
    ref = Reference(placeholder_llava[0])
    yield ref
    ref.close()


def _image_chat(server, images: list[bytes], text: str, max_tokens: int = 8) -> dict:
    """A greedy chat answer (JSON body) to the image parts ``images``, back to back, then ``text``."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts + [
        {"type": "text", "text": text}]}], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _image_ref(ref: Reference, images: list[bytes], text: str) -> dict:
    """The offline prompt of ``_image_chat(server, images, text)``."""
    return {"prompt_token_ids": ref.chat_ids(IMAGE_TOKEN * len(images) + text), "multi_modal_data": {"image": images}}


def _png_of(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _rgba_png(rgb: np.ndarray, alpha: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.dstack([rgb, alpha]).astype(np.uint8), "RGBA").save(buf, format="PNG")
    return buf.getvalue()


class TestLlavaEPD:
    def test_row16_many_concurrent_large_image_requests_none_dropped(self, placeholder_llava, llava_ref):
        """Row 16 (sglang#23082): EPD silently dropped requests among ~200 concurrent ones
        with large images. Here 48 requests (fewer, for a 2-core test machine), each with its
        own 640x480 random-pixel PNG (~0.9 MB), are sent at once: every one gets a 200 with
        all its 8 tokens, equal to the offline engine's answer for its image, and afterwards
        no worker holds a block, an embedding buffer or a request."""
        _, server = placeholder_llava
        before = server.workers()
        images = [png(16000 + i, (480, 640)) for i in range(48)]
        text = "What is in this picture?"
        expected = llava_ref.texts([_image_ref(llava_ref, [b], text) for b in images], 8)
        with ThreadPoolExecutor(48) as pool:
            got = list(pool.map(lambda b: _image_chat(server, [b], text), images))
        assert [g["choices"][0]["message"]["content"] for g in got] == expected
        assert all(g["usage"]["completion_tokens"] == 8 for g in got)
        assert_idle(server, before)

    def test_row17_adjacent_image_placeholders(self, placeholder_llava, llava_ref):
        """Row 17 (sglang PR #35799; vllm#49692): two adjacent image placeholders in an EPD
        prompt failed with "Failed to assemble multimodal inputs" or drifted. Also replayed
        by tests/serving/test_disaggregated.py (IMAGE_CASES "Compare <image><image> now").
        Here two image parts with nothing between them, the same pair swapped, and one image
        twice in a row, each at the very start of the prompt's content: each answer equals
        the offline engine's on the same prompt (two 16-token image spans that touch), the
        prompt counts both spans, and the pair and the swapped pair answer differently (so
        a mix-up of the two spans' embeddings would show)."""
        llava_dir, server = placeholder_llava
        a, b = png(1701), png(1702)
        text = "Compare the two."
        cases = [[a, b], [b, a], [a, a]]
        expected = llava_ref.texts([_image_ref(llava_ref, imgs, text) for imgs in cases], 8)
        assert expected[0] != expected[1]
        proc = MultiModalProcessor(llava_dir, AutoConfig.from_pretrained(llava_dir))
        for imgs, want in zip(cases, expected):
            out = _image_chat(server, imgs, text)
            assert out["choices"][0]["message"]["content"] == want
            processed = proc.process(llava_ref.chat_ids(IMAGE_TOKEN * 2 + text), {"image": imgs})
            spans = processed.placeholders
            assert spans[1].offset == spans[0].offset + spans[0].length == spans[0].offset + 16
            assert out["usage"]["prompt_tokens"] == len(processed.prompt_token_ids)

    def test_row20_same_question_other_image_gets_its_own_kv(self, placeholder_llava, llava_ref):
        """Row 20 (LMCache#4086, #3301; PR #4783): with the same question text, a second image
        was served the cached KV of the first (a 16-bit multimodal hash collided). Here the
        same question goes with image A, then image B, then a copy of A with one pixel
        changed, then A again: each answer equals the offline engine's for its own image
        (A's and B's differ); B and the one-pixel variant report 0 cached tokens (their first
        block already holds image tokens, keyed by the image's full sha256: nothing of A's KV
        matches), while the repeat of A hits the prefix cache."""
        llava_dir, server = placeholder_llava
        text = "Describe the image in detail."
        a = np.random.default_rng(2001).integers(0, 256, (30, 40, 3), dtype=np.uint8)
        near = a.copy()
        near[15, 20] = 255 - near[15, 20]  # in the centre: a corner pixel is cropped away
        img_a, img_b, img_near = _png_of(a), png(2002), _png_of(near)
        proc = MultiModalProcessor(llava_dir, AutoConfig.from_pretrained(llava_dir))
        hashes = [proc.image_item(x).item_hash for x in (img_a, img_b, img_near)]
        assert len(set(hashes)) == 3 and all(len(x) == 64 for x in hashes)
        runs = [(img_a, None), (img_b, 0), (img_near, 0), (img_a, "hit")]
        expected = llava_ref.texts([_image_ref(llava_ref, [img], text) for img, _ in runs], 8)
        assert expected[0] != expected[1]
        for (img, want_cached), want in zip(runs, expected):
            out = _image_chat(server, [img], text)
            assert out["choices"][0]["message"]["content"] == want
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            if want_cached == "hit":
                assert cached >= 16, cached
            elif want_cached is not None:
                assert cached == want_cached

    def test_row21_same_rgba_bytes_other_background(self, placeholder_llava, llava_ref):
        """Row 21 (vllm PR #49975): the same RGBA bytes with a different
        rgba_background_color got the features cached for the first. In epd the background
        is the processor's setting (not a request field) and part of the item hash: one
        half-transparent RGBA PNG composited on white and on black gives different pixels
        and different hashes. Online, two RGBA PNGs with the same RGB bytes but different
        alpha (so different composited pixels) each get the offline engine's answer for
        itself (the two differ); the second reports 0 cached tokens."""
        llava_dir, server = placeholder_llava
        rng = np.random.default_rng(2101)
        rgb = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
        opaque = _rgba_png(rgb, np.full((30, 40), 255))
        translucent = _rgba_png(rgb, rng.integers(0, 128, (30, 40)))
        cfg = AutoConfig.from_pretrained(llava_dir)
        white = MultiModalProcessor(llava_dir, cfg).image_item(translucent)
        black = MultiModalProcessor(llava_dir, cfg, background=(0, 0, 0)).image_item(translucent)
        assert white.item_hash != black.item_hash
        assert not np.allclose(white.data["pixel_values"].numpy(), black.data["pixel_values"].numpy())
        text = "What colour is the background?"
        expected = llava_ref.texts([_image_ref(llava_ref, [x], text) for x in (opaque, translucent)], 8)
        assert expected[0] != expected[1]
        first = _image_chat(server, [opaque], text)
        second = _image_chat(server, [translucent], text)
        assert first["choices"][0]["message"]["content"] == expected[0]
        assert second["choices"][0]["message"]["content"] == expected[1]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# ---- rows 18 and 19: a client's typed placeholder text is text ---------------------------------------
def _ids_with_plain_literals(tok, messages: list[dict], literal: str) -> list[int]:
    """The chat prompt of ``messages`` in which each "\\0" is ``literal`` tokenized as plain text."""
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = rendered.split("\0")
    plain = tok.encode(literal, add_special_tokens=False, split_special_tokens=True)
    ids = tok.encode(pieces[0], add_special_tokens=False)
    for piece in pieces[1:]:
        ids += plain + tok.encode(piece, add_special_tokens=False)
    return ids


def _offline(model_dir: str, prompt: dict, max_tokens: int) -> str:
    llm = LLM(model_dir, dtype="float32")
    try:
        return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text
    finally:
        llm.shutdown()


def _chat(server, messages: list[dict]) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=300,
                      json={"messages": messages, "max_tokens": 8, "temperature": 0})


def test_row18_literal_image_text_in_history_plus_one_real_image(placeholder_llava):
    """Row 18 (sglang#37579): literal image-placeholder text in the history plus one real
    image gave HTTP 500 "More IMAGE tokens than data" and wedged retries. In epd the
    typed text is text: the answer equals the offline engine's on that prompt, with the
    one real image in its slot, and the server keeps serving."""
    model_dir, server = placeholder_llava
    image = png(3)
    messages = [
        {"role": "user", "content": f"What does {IMAGE_TOKEN} mean?"},
        {"role": "assistant", "content": f"{IMAGE_TOKEN} marks an image."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                     {"type": "text", "text": "And this?"}]},
    ]
    r = _chat(server, messages)
    assert r.status_code == 200, r.text
    llm_messages = [{"role": "user", "content": "What does \0 mean?"},
                    {"role": "assistant", "content": "\0 marks an image."},
                    {"role": "user", "content": IMAGE_TOKEN + "And this?"}]
    ids = _ids_with_plain_literals(AutoTokenizer.from_pretrained(model_dir), llm_messages, IMAGE_TOKEN)
    expected = _offline(model_dir, {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}, 8)
    processed = MultiModalProcessor(model_dir, AutoConfig.from_pretrained(model_dir)).process(ids, {"image": [image]})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected
    assert body["usage"]["prompt_tokens"] == len(processed.prompt_token_ids)  # one image's slot, no more
    again = _chat(server, messages)  # nothing wedged: the same request again, same answer
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == expected


def test_row19_text_only_prompt_spelling_the_image_placeholder(placeholder_llava):
    """Row 19 (CVE-2026-44222): a text-only prompt spelling the vision placeholder, with
    no image, killed the worker (IndexError). In epd it is a normal 200 answer on the
    text, on chat and completions alike, and every worker stays up."""
    model_dir, server = placeholder_llava
    tok = AutoTokenizer.from_pretrained(model_dir)
    before = server.workers()
    r = _chat(server, [{"role": "user", "content": f"{IMAGE_TOKEN * 3} what is {IMAGE_TOKEN}?"}])
    assert r.status_code == 200, r.text
    ids = _ids_with_plain_literals(tok, [{"role": "user", "content": "\0\0\0 what is \0?"}], IMAGE_TOKEN)
    assert r.json()["choices"][0]["message"]["content"] == _offline(model_dir, {"prompt_token_ids": ids}, 8)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    c = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"prompt": f"{IMAGE_TOKEN} hello", "max_tokens": 4, "temperature": 0})
    assert c.status_code == 200, c.text
    assert c.json()["usage"]["prompt_tokens"] == len(tok.encode(f"{IMAGE_TOKEN} hello", split_special_tokens=True))
    after = server.workers()
    assert set(after) == set(before) and not any(w.get("unresponsive") for w in after.values())
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200

