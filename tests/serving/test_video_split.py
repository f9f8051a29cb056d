"""One long Qwen2.5-VL video encoded in chunks of temporal patches across two encode
instances, served (e:2,p:1,d:1, real worker processes, the official ``openai`` SDK, tiny
random checkpoint built here): the router cuts the video (4 temporal patches at 2 fps)
in two, each encoder encodes its chunk, the prefill (or pd) worker reads from both and
joins the chunks in temporal order; the greedy answer equals transformers' ``generate``. A repeat
meets both encoders' caches, ``--video-encode-split off`` gives the same answer from one
encoder, and an encoder SIGSTOPped then SIGKILLed under split requests is retried around
with the same answers and no embedding buffer left held."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from epd import LLM, SamplingParams
from tests.engine.test_mrope_engine import _reference
from tests.serving.conftest import launch
from tests.serving.test_failures import _assert_idle, _metric
from tests.serving.test_kv_routing import _counter
from tests.serving.test_qwen_vl import CASES, MAX_TOKENS, MEDIA, qwen_dir  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow
FPS = 2.0  # the 4 s clip: 8 frames, 4 temporal patches
SPLIT = ("video", "image and video")
ENCODERS = ("encode-0", "encode-1")
ARGS = ("--block-size", "8", "--num-kv-blocks", "128", "--video-fps", str(FPS))


@pytest.fixture(scope="module")
def expected(qwen_dir):
    """(text, prompt tokens) per case at 2 fps; the offline engine's tokens equal
    transformers' ``generate`` (the mrope engine test's reference)."""
    llm = LLM(qwen_dir, dtype="float32", kv_cache_memory_gb=0.05, video_fps=FPS)
    tok = llm.get_tokenizer()
    out = {}
    for name in SPLIT:
        content = [{"type": "text", "text": p["text"]} if p["type"] == "text" else
                   {"type": "image" if p["type"] == "image_url" else "video"} for p in CASES[name]]
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)
        items = llm.mm_processor.process(tok.encode(text), MEDIA[name]).items
        assert [int(it.data["video_grid_thw"][0]) for it in items if it.modality == "video"] == [4]
        r = llm.generate({"prompt": text, "multi_modal_data": MEDIA[name]},
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
        assert list(r.outputs[0].token_ids) == _reference(qwen_dir, llm, [(text, MEDIA[name])])[0], name
        out[name] = (r.outputs[0].text, len(r.prompt_token_ids))
    llm.shutdown()
    return out


def _chat(server, name: str) -> tuple[str, int]:
    r = server.client().chat.completions.create(model=server.model, messages=[{"role": "user",
                                                                              "content": CASES[name]}],
                                                max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def _per_encoder(server, at_least: float) -> dict[str, dict[str, float]]:
    """Each encoder's video chunks, encoder cache queries and hits, once the queries of
    both reach ``at_least`` in sum (workers publish counters with their heartbeat)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        got = {e: {k: _counter(text, f"epd_{k}_total", pool="encode", instance=e)
                   for k in ("encode_video_chunks", "encoder_cache_queries", "encoder_cache_hits")}
               for e in ENCODERS}
        if sum(g["encoder_cache_queries"] for g in got.values()) >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _no_held_embeddings(server) -> dict:
    """/epd/workers once no encode or prefill instance holds an embedding buffer (or after 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        workers = server.workers()
        if not any(w.get("num_held_requests", 0) for w in workers.values()) or time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


@pytest.mark.parametrize("pools", ["e:2,p:1,d:1", "e:2,pd:1"])
def test_a_long_video_is_split_across_both_encoders_and_equals_transformers(qwen_dir, expected, pools):
    """Disaggregated (the prefill worker joins the chunks) and aggregated (the pd worker does)."""
    with launch(qwen_dir, pools, *ARGS) as server:
        assert _chat(server, "video") == expected["video"]
        first = _per_encoder(server, 2)
        for e in ENCODERS:  # each encoder encoded one chunk (two of the four temporal patches)
            assert first[e] == {"encode_video_chunks": 1, "encoder_cache_queries": 1, "encoder_cache_hits": 0}, first

        assert _chat(server, "video") == expected["video"]
        again = _per_encoder(server, 4)
        for e in ENCODERS:  # the same split: both chunks from the encoder caches
            assert again[e] == {"encode_video_chunks": 2, "encoder_cache_queries": 2, "encoder_cache_hits": 1}, again

        # the image goes to the policy's pick beside its chunk; the video's chunks hit again
        assert _chat(server, "image and video") == expected["image and video"]
        mixed = _per_encoder(server, 7)
        assert [mixed[e]["encode_video_chunks"] for e in ENCODERS] == [3, 3], mixed
        assert sum(m["encoder_cache_queries"] for m in mixed.values()) == 7, mixed
        assert sum(m["encoder_cache_hits"] for m in mixed.values()) == 4, mixed

        workers = _no_held_embeddings(server)
        assert set(ENCODERS) <= set(workers), sorted(workers)
        for inst, w in workers.items():
            assert w.get("num_held_requests", 0) == 0, (inst, w)
        text = httpx.get(server.url + "/metrics", timeout=30).text
        assert _counter(text, "epd_routing_decisions_total", pool="encode", policy="video-split") == 3


def test_split_off_sends_the_video_to_one_encoder_with_the_same_answer(qwen_dir, expected):
    with launch(qwen_dir, "e:2,p:1,d:1", *ARGS, "--video-encode-split", "off") as server:
        assert _chat(server, "video") == expected["video"]
        got = _per_encoder(server, 1)
        assert sum(g["encoder_cache_queries"] for g in got.values()) == 1, got
        assert sum(g["encode_video_chunks"] for g in got.values()) == 0, got


def test_an_encoder_killed_under_split_requests_is_retried_around(qwen_dir, expected):
    """SIGSTOP encode-1 while split requests are sent (it holds their second chunks),
    then SIGKILL it: every request is retried on the live encoder, whole, and answers
    as before; no instance is left holding embeddings or blocks."""
    with launch(qwen_dir, "e:2,p:1,d:1", *ARGS, "--max-retries", "3") as server:
        assert _chat(server, "video") == expected["video"]
        assert _per_encoder(server, 2)["encode-1"]["encode_video_chunks"] == 1  # it was split
        before = {k: v for k, v in server.workers().items() if k != "encode-1"}
        victim = server.worker_process("encode-1")
        victim.send_signal(signal.SIGSTOP)
        names = [SPLIT[i % 2] for i in range(6)]
        with ThreadPoolExecutor(len(names)) as pool:
            futs = [pool.submit(_chat, server, n) for n in names]
            time.sleep(1.0)
            victim.send_signal(signal.SIGKILL)
            got = [f.result(timeout=300) for f in futs]
        assert got == [expected[n] for n in names]
        assert _metric(server, "epd_request_retries_total", pool="encode", instance="encode-1") >= 1
        _assert_idle(server, before)
