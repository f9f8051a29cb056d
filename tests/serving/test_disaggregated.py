"""The disaggregated pipeline end to end: real `epd launch`, real workers, NIXL, the openai SDK.

Reference outputs come from the offline engine (``LLM``), whose greedy tokens the
engine/encoder tests prove equal to transformers ``generate``.
"""

from __future__ import annotations

import asyncio
import base64
import random
import re

import httpx
import pytest

from epd import LLM, SamplingParams
from epd.models.tiny import AUDIO_TOKEN, IMAGE_TOKEN, create_tiny_model
from tests.serving.conftest import launch
from tests.serving.media import data_url as _data_url
from tests.serving.media import png as _png
from tests.serving.media import wav as _wav

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("srv") / "llava"))


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    return str(create_tiny_model("qwen2-audio", tmp_path_factory.mktemp("srv") / "qa"))


TEXT_PROMPTS = [[5, 6, 7], list(range(10, 60)), [300, 301, 302, 303, 304] * 8]
IMAGE_CASES = [(f"{IMAGE_TOKEN} What is this?", [0]), (f"Compare {IMAGE_TOKEN}{IMAGE_TOKEN} now", [1, 2])]


def _chat_messages(text: str, images: list[bytes]) -> list[dict]:
    """Content parts in the order the placeholders appear in ``text``."""
    parts, rest = [], text
    for png in images:
        before, _, rest = rest.partition(IMAGE_TOKEN)
        if before:
            parts.append({"type": "text", "text": before})
        parts.append({"type": "image_url", "image_url": {"url": _data_url(png)}})
    if rest:
        parts.append({"type": "text", "text": rest})
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def llava_expected(llava_dir):
    llm = LLM(llava_dir, dtype="float32")
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    text = [o.outputs[0].text for o in llm.generate(TEXT_PROMPTS, params)]
    images = []
    for prompt, seeds in IMAGE_CASES:
        rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False)
        ids = tok.encode(rendered, add_special_tokens=False)
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [_png(s) for s in seeds]}},
                           params)[0]
        images.append(out.outputs[0].text)
    llm.shutdown()
    return text, images


def _check_llava(server, llava_expected) -> None:
    text_expected, image_expected = llava_expected
    client = server.client()
    for prompt, expected in zip(TEXT_PROMPTS, text_expected):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == expected
    for (prompt, seeds), expected in zip(IMAGE_CASES, image_expected):
        r = client.chat.completions.create(model=server.model,
                                           messages=_chat_messages(prompt, [_png(s) for s in seeds]),
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == expected
    # Streaming gives the same text.
    stream = client.chat.completions.create(model=server.model, messages=_chat_messages(*IMAGE_CASES[1][:1],
                                                                                [_png(s) for s in IMAGE_CASES[1][1]]),
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == image_expected[1]


@pytest.mark.parametrize("pools", ["e:1,p:1,d:1", "e:2,p:2,d:2", "e:1,pd:1"])
def test_llava_parity_across_pools(pools, llava_dir, llava_expected):
    with launch(llava_dir, pools, "--block-size", "8") as server:
        _check_llava(server, llava_expected)


def test_qwen2_audio_parity(audio_dir):
    llm = LLM(audio_dir, dtype="float32")
    tok = llm.get_tokenizer()
    wav = _wav(3)
    rendered = tok.apply_chat_template([{"role": "user", "content": f"{AUDIO_TOKEN} What was said?"}],
                                       add_generation_prompt=True, tokenize=False)
    ids = tok.encode(rendered, add_special_tokens=False)
    expected = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"audio": [wav]}},
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    llm.shutdown()
    with launch(audio_dir, "e:1,p:1,d:1") as server:
        r = server.client().chat.completions.create(
            model=server.model, max_tokens=MAX_TOKENS, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                {"type": "text", "text": " What was said?"}]}])
        assert r.choices[0].message.content == expected


def test_kv_bytes_moved_equal_request_kv_size(llava_dir):
    """The KV really crosses processes through NIXL: the transfer metric counts
    exactly the request's blocks (K and V, every layer)."""
    with launch(llava_dir, "e:1,p:1,d:1", "--block-size", "8") as server:
        prompt = list(range(20, 61))  # 41 tokens -> 6 blocks of 8
        server.client().completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0)
        metrics = httpx.get(server.url + "/metrics").text
        moved = sum(float(v) for v in re.findall(r'^epd_kv_transfer_bytes_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M))
        # tiny llama: 2 layers, 2 KV heads, head_dim 16, fp32; K and V.
        assert moved == 2 * 2 * 6 * 8 * 2 * 16 * 4
        prefilled = re.findall(r'^epd_prompt_tokens_total\{[^}]*pool="prefill"[^}]*\} ([0-9.e+]+)$', metrics, re.M)
        assert [float(v) for v in prefilled] == [41.0], prefilled  # counted with the prefill, not by a heartbeat
        for name in ("epd_kv_transfer_seconds_count", "epd_prefill_seconds_count", "epd_decode_step_seconds_count",
                     "epd_time_to_first_token_seconds_count", "epd_e2e_request_latency_seconds_count",
                     "epd_kv_cache_usage_ratio", "epd_prefill_queue_seconds_count"):
            assert re.search(rf"^{name}\{{[^}}]*\}} [0-9.e+]+$", metrics, re.M), name


def test_quantized_kv_crosses_as_its_bytes_and_decodes_as_offline(llava_dir):
    """``--kv-cache-dtype int8`` on p:1,d:1: the prefill worker's packed rows (values and
    scales) are what NIXL moves, and the decode worker reads them as the offline engine
    with the same cache does (greedy tokens equal)."""
    prompt = list(range(20, 61))  # 41 tokens -> 6 blocks of 8
    llm = LLM(llava_dir, dtype="float32", kv_cache_dtype="int8", block_size=8, kv_cache_memory_gb=0.05)
    expected = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8,
                                                                         ignore_eos=True))[0].outputs[0].text
    llm.shutdown()
    with launch(llava_dir, "e:1,p:1,d:1", "--block-size", "8", "--kv-cache-dtype", "int8") as server:
        r = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
        metrics = httpx.get(server.url + "/metrics").text
        stats = server.workers()
    moved = sum(float(v) for v in re.findall(r'^epd_kv_transfer_bytes_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M))
    # 2 layers x 6 blocks x 8 tokens x 2 KV heads x (16 int8 codes + a float16 scale and min), K and V:
    # 20 bytes a row where fp32 takes 64 (test_kv_bytes_moved_equal_request_kv_size)
    assert moved == 2 * 2 * 6 * 8 * 2 * (16 + 4)
    assert r.choices[0].text == expected
    decode = next(v for k, v in stats.items() if k.startswith("decode"))
    assert decode["kv_block_bytes"] == 2 * 2 * 8 * 2 * (16 + 4)  # one block, every layer, K and V


def test_cancel_at_every_stage_leaks_nothing(llava_dir):
    """100 streamed requests, a third cancelled at random points: every worker's
    free-block count returns to its start value and the server still answers."""
    with launch(llava_dir, "e:1,p:1,d:1", "--block-size", "8") as server:
        before = server.workers()
        rng = random.Random(0)
        seen_by_server: list[int] = []

        async def one(i: int, client: httpx.AsyncClient) -> str:
            cancel = i % 3 == 0
            # Requests to cancel run long (no EOS, 1,000 tokens: the tiny model streams 200
            # in under 0.3 s), so every cancel lands
            # before the end: right away (encode / reserve / prefill), after a short
            # random delay (prefill, transfer), or after k streamed chunks (decode).
            body = {"messages": _chat_messages(f"{IMAGE_TOKEN} number {i}", [_png(i % 5)]) if i % 2 else
                    [{"role": "user", "content": f"tell me about {i} " * (1 + i % 7)}],
                    "max_tokens": 1000 if cancel else 8 + i % 16, "ignore_eos": cancel, "temperature": 0,
                    "stream": True}
            mode, delay, chunks = rng.choice(["delay", "chunks"]), rng.uniform(0.0, 0.3), rng.randint(1, 6)
            if cancel and mode == "chunks":
                seen_by_server.append(i)  # it read chunks, so the server had the request

            async def consume() -> str:
                async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += bool(line.strip())
                        if cancel and mode == "chunks" and n >= chunks:
                            return "cancelled"  # leaving the block closes the connection
                return "done"

            if not cancel or mode == "chunks":
                return await consume()
            try:
                return await asyncio.wait_for(consume(), delay)
            except TimeoutError:
                return "cancelled"

        async def run() -> list[str]:
            limits = httpx.Limits(max_connections=16)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                sem = asyncio.Semaphore(12)

                async def guarded(i):
                    async with sem:
                        return await one(i, client)

                return await asyncio.gather(*(guarded(i) for i in range(100)))

        results = asyncio.run(run())
        assert results.count("cancelled") == 34 and results.count("done") == 66
        after = None
        for _ in range(100):  # aborts are asynchronous: give the workers a moment
            after = server.workers()
            if all(after[k].get("num_free_blocks") == before[k].get("num_free_blocks") and
                   after[k].get("num_held_requests", 0) == 0 and after[k].get("num_reserved", 0) == 0
                   for k in before):
                break
            asyncio.run(asyncio.sleep(0.2))
        for inst, stats in before.items():
            assert after[inst].get("num_free_blocks") == stats.get("num_free_blocks"), (inst, after[inst])
            assert after[inst].get("num_held_requests", 0) == 0, (inst, after[inst])
            assert after[inst].get("num_reserved", 0) == 0 and after[inst].get("num_held", 0) == 0, after[inst]
        r = server.client().completions.create(model=server.model, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
        metrics = httpx.get(server.url + "/metrics").text
        cancelled = re.search(r'^epd_cancelled_requests_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M)
        # A cancel after a tiny delay may close the connection before the request was
        # even sent; every cancel after streamed chunks reached the server.
        assert cancelled and len(seen_by_server) <= float(cancelled.group(1)) <= 34


def test_smollm2_france_disaggregated_equals_aggregated(default_model_dir):
    answers = []
    for pools in (None, "e:1,pd:1"):  # no flags: the default e:1,p:1,d:1
        with launch(None, pools) as server:
            r = server.client().chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=24, temperature=0)
            answers.append(r.choices[0].message.content)
    assert answers[0] == answers[1]
    assert "Paris" in answers[0]


# ---- tied word embeddings of a multimodal checkpoint's LM (issue 13, defect 4) --------
# A small Qwen2 LM's config says tie_word_embeddings: true. Inside LLaVA transformers ties
# lm_head to the embeddings; inside Qwen2-Audio it does not (the class keeps its own
# lm_head). Each topology must answer as transformers does.
TIED_KINDS = ("qwen2-audio", "llava-siglip")


@pytest.fixture(scope="module")
def tied_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    return {k: str(create_tiny_model(k, root / k, tie_word_embeddings=True)) for k in TIED_KINDS}


def _tied_media_case(kind: str) -> tuple[list[dict], str, dict]:
    """(chat messages, the same prompt's text, its multi_modal_data) of one media request."""
    if kind == "qwen2-audio":
        clip = _wav(3)
        messages = [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
            {"type": "text", "text": " What was said?"}]}]
        return messages, f"{AUDIO_TOKEN} What was said?", {"audio": [clip]}
    text = f"{IMAGE_TOKEN} What is this?"
    return _chat_messages(text, [_png(4)]), text, {"image": [_png(4)]}


@pytest.fixture(scope="module")
def tied_expected(tied_dirs):
    """kind -> (texts of TEXT_PROMPTS, text of the media case) from the offline engine,
    whose tokens are first checked equal to transformers ``generate`` of the whole
    ``*ForConditionalGeneration`` model."""
    import torch
    import transformers

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    out = {}
    for kind, model_dir in tied_dirs.items():
        cls = "Qwen2AudioForConditionalGeneration" if kind == "qwen2-audio" else "LlavaForConditionalGeneration"
        ref = getattr(transformers, cls).from_pretrained(model_dir, dtype=torch.float32).eval()
        llm = LLM(model_dir, dtype="float32")
        try:
            got = llm.generate(TEXT_PROMPTS, params)
            for prompt, o in zip(TEXT_PROMPTS, got):
                ids = torch.tensor([prompt])
                with torch.inference_mode():
                    hf = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                      do_sample=False)[0, len(prompt):].tolist()
                assert list(o.outputs[0].token_ids) == hf, kind
            _, text, mm = _tied_media_case(kind)
            tok = llm.get_tokenizer()
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=False)
            media = llm.generate({"prompt_token_ids": tok.encode(rendered, add_special_tokens=False),
                                  "multi_modal_data": mm}, params)[0].outputs[0].text
        finally:
            llm.shutdown()
        out[kind] = ([o.outputs[0].text for o in got], media)
    return out


@pytest.mark.parametrize("pools", ["e:1,pd:1", "e:1,p:1,d:1"])
@pytest.mark.parametrize("kind", TIED_KINDS)
def test_tied_embeddings_parity_across_pools(kind, pools, tied_dirs, tied_expected):
    text_expected, media_expected = tied_expected[kind]
    with launch(tied_dirs[kind], pools, "--block-size", "8", "--num-kv-blocks", "128") as server:
        client = server.client()
        for prompt, expected in zip(TEXT_PROMPTS, text_expected):
            r = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert r.choices[0].text == expected
        messages, _, _ = _tied_media_case(kind)
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert r.choices[0].message.content == media_expected


# ---- media keys on the decode worker (issue 13, defect 2) ------------------------------
def test_same_text_other_images_survive_decode_preemption(llava_dir):
    """Two requests with the same text and different images decode at once in a KV cache
    too small for both (12 blocks of 8 = 96 tokens; they need 2 x 57), so the newest is
    preempted on the decode worker. Each equals the aggregated engine's answer: the
    preempted one resumes after its own cached image blocks (ReserveKV carries the
    placeholders, so its block hashes include its image's hash); it can neither hit the
    other image's KV nor recompute its image positions, for which the decode worker has
    no embeddings."""
    text = f"{IMAGE_TOKEN} What is this?"
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(llava_dir, dtype="float32")
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    ids = tok.encode(rendered, add_special_tokens=False)
    expected = [llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [_png(s)]}},
                             params)[0].outputs[0].text for s in (1, 2)]
    llm.shutdown()
    assert expected[0] != expected[1]

    async def both(server) -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(seed: int) -> str:
                r = await client.post(server.url + "/v1/chat/completions", json={
                    "model": server.model, "messages": _chat_messages(text, [_png(seed)]), "max_tokens": 20,
                    "ignore_eos": True, "temperature": 0})
                return r.json()["choices"][0]["message"]["content"]

            return list(await asyncio.gather(one(1), one(2)))

    with launch(llava_dir, "e:1,p:1,d:1", "--block-size", "8", "--num-kv-blocks", "12") as server:
        assert asyncio.run(both(server)) == expected
        assert server.workers()["decode-0"]["num_preemptions"] > 0
