"""The OpenAI-compatible API against real spawned servers, through the official openai SDK.

Two launches: a disaggregated tiny LLaVA (e:1,p:1,d:1) whose chat template takes
HF-style content lists, with small limits so every error status can be hit; and an
aggregated tiny Qwen2-Audio (e:1,pd:1) behind an API key (from $EPD_API_KEY), whose
last test takes its only pd worker down for the 503 case. References: the offline
engine (whose greedy tokens the engine tests prove equal to transformers') and
transformers' own log_softmax for logprobs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from epd import LLM, SamplingParams
from epd.models.tiny import AUDIO_TOKEN, create_tiny_model
from tests.serving.conftest import launch
from tests.serving.media import data_url as _data_url
from tests.serving.media import png as _png
from tests.serving.media import wav as _wav

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-epd-test-key"
MAX_MODEL_LEN = 512
# HF-style template (like llava-hf's): content may be a list of {"type": "image"} / {"type": "text"}.
LIST_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    d = create_tiny_model("llava", tmp_path_factory.mktemp("api") / "llava")
    (d / "chat_template.jinja").write_text(LIST_TEMPLATE)
    return str(d)


@pytest.fixture(scope="module")
def server(llava_dir):
    with launch(llava_dir, "e:1,p:1,d:1", "--block-size", "8", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-pending-requests", "4", "--max-body-mb", "1", "--max-n", "4",
                "--allowed-media-domains", "localhost") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _stream_texts(stream) -> tuple[dict[int, str], dict[int, str | None], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    chunks = list(stream)
    for c in chunks:
        for ch in c.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (piece or "")
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, chunks


# ---- content parts, chat template, streaming ------------------------------------------------
def test_image_parts_use_the_models_list_template(server, client, llava_dir):
    """Parts go to the template HF-style ({"type": "image"}), which renders differently from
    the placeholder-text fallback; the answer equals the offline engine on that rendering,
    streamed or not."""
    png = _png(1)
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": _data_url(png)}},
             {"type": "text", "text": "What is this?"}]
    llm = LLM(llava_dir, dtype="float32")
    tok = llm.get_tokenizer()
    hf_parts = [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": "What is this?"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": hf_parts}], add_generation_prompt=True,
                                       tokenize=False)
    assert "<image>\nWhat is this?" in rendered  # the list template's own layout, not "<image>What"
    ids = tok.encode(rendered, add_special_tokens=False)
    expected = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [png]}},
                            SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    llm.shutdown()
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": parts}],
                                       max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    texts, reasons, chunks = _stream_texts(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0,
        stream=True))
    assert texts[0] == expected and reasons[0] == "length"
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stop_string_spanning_two_chunks_is_never_sent_in_part(server, client):
    prompt = list(range(40, 60))
    full = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0)
    text = full.choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(model=server.model, prompt=prompt,
                                                                   max_tokens=24, temperature=0, stream=True)
              if c.choices and c.choices[0].text]
    assert "".join(pieces) == text  # streamed text concatenates to the non-streamed text
    # A stop string made of the end of one chunk and the start of the next, first occurring there.
    pos = 0
    stop = None
    for a, b in zip(pieces, pieces[1:]):
        pos += len(a)
        cand = a[-2:] + b[:2]
        if len(a) >= 2 and len(b) >= 2 and text.find(cand) == pos - 2:
            stop = cand
            break
    assert stop is not None, pieces
    before = text[:text.index(stop)]
    streamed = [c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "zzzz"], stream=True)
        if c.choices]
    # Had any chunk carried the first half of the stop string, the concatenation would be longer.
    assert "".join(streamed) == before
    whole = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    assert whole.choices[0].text == before and whole.choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n_choices(server, client):
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text
    many = client.completions.create(seed=7, n=3, **kw)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    texts = [ch.text for ch in sorted(many.choices, key=lambda ch: ch.index)]
    assert texts[0] == a.choices[0].text  # choice i draws with seed + i
    assert texts[1] == c.choices[0].text
    assert len(set(texts)) == 3
    assert many.usage.completion_tokens == 48 and many.usage.prompt_tokens == a.usage.prompt_tokens
    streamed, reasons, _ = _stream_texts(client.completions.create(seed=7, n=3, stream=True, **kw))
    assert [streamed[i] for i in range(3)] == texts and set(reasons.values()) == {"length"}
    # A batch of prompts: choice p * n + i is sample i of prompt p; usage counts each prompt once.
    prompts = ["Once upon a time", "The quick brown fox"]
    singles = [client.completions.create(model=server.model, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    batch = client.completions.create(model=server.model, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [ch.text for ch in sorted(batch.choices, key=lambda ch: ch.index)] == \
        [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in singles)
    assert batch.usage.completion_tokens == 4 * 8
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0.9, seed=3, n=2, user="u-1",
                                          presence_penalty=0.5, frequency_penalty=0.5, extra_body={"top_k": 20})
    again = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8, temperature=0.9, seed=3, n=2, user="u-2",
                                           presence_penalty=0.5, frequency_penalty=0.5, extra_body={"top_k": 20})
    assert [ch.message.content for ch in chat.choices] == [ch.message.content for ch in again.choices]


def test_logprobs_equal_transformers(server, client, llava_dir):
    import torch
    from transformers import LlavaForConditionalGeneration

    prompt = [7, 70, 170, 270, 370, 33, 44]
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    tok = __import__("transformers").AutoTokenizer.from_pretrained(llava_dir)
    out_ids = []
    with torch.inference_mode():
        ids = list(prompt)
        for i in range(6):
            ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            top_v, top_i = ref.topk(3)
            tok_id = int(top_i[0])
            assert lp.token_logprobs[i] == pytest.approx(float(ref[tok_id]), abs=2e-3)
            assert lp.tokens[i] == tok.decode([tok_id])
            got = lp.top_logprobs[i]  # {token text: logprob}; byte tokens may share a text ("\ufffd")
            assert max(got.values()) == pytest.approx(float(top_v[0]), abs=2e-3)
            assert all(min(abs(v - t) for t in top_v.tolist()) < 2e-3 for v in got.values())
            ids.append(tok_id)
            out_ids.append(tok_id)
    assert tok.decode(out_ids).rstrip("\ufffd") == r.choices[0].text  # an unfinished last character is dropped
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: top-1
    joined = b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace").rstrip("\ufffd")
    assert joined == chat.choices[0].message.content  # bytes are the tokens' own UTF-8 pieces
    stream = list(client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed = [c for ch in stream for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]


def test_cached_tokens_after_repeated_system_prompt(server, client):
    system = "You are a careful assistant. Answer briefly and politely about the lazy dog and the fox."
    first = client.chat.completions.create(model=server.model, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "one"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    stream = list(client.chat.completions.create(
        model=server.model, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "two"}]))
    usage = stream[-1].usage
    assert stream[-1].choices == [] and all(c.usage is None for c in stream[:-1])
    cached = usage.prompt_tokens_details.cached_tokens
    # Whole blocks of 8 of the shared system-prompt prefix hit the prefix cache.
    assert cached >= 8 and cached % 8 == 0 and cached < usage.prompt_tokens
    assert usage.completion_tokens == 2 and usage.total_tokens == usage.prompt_tokens + 2


# ---- errors ------------------------------------------------------------------------------------------
def _post(server, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def _assert_error(r: httpx.Response, status: int, match: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["type"], str) and re.search(match, err["message"]), err


def test_every_bad_request_gets_400_with_openai_body(server):
    user = lambda content: {"messages": [{"role": "user", "content": content}], "max_tokens": 4}  # noqa: E731
    img = lambda url: user([{"type": "image_url", "image_url": {"url": url}}])  # noqa: E731
    cases = [
        (img("data:image/png;base64,@@not-base64@@"), "base64"),
        (img("data:image/png;base64," + base64.b64encode(b"not an image").decode()), "image"),
        (user([{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode(),
                                                       "format": "wav"}}]), "audio"),
        (user([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}}]), "format"),
        (user([{"type": "video_url", "video_url": {"url": "x"}}]), "video_url.url must be a data: URL"),
        (user([{"type": "image_url", "image_url": {"url": _data_url(_png(0, (4, 4)))}}] * 17), "at most 16"),
        ({"messages": [{"role": "user", "content": "x " * 800}]}, "max_model_len"),
        ({**user("hi"), "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({**user("hi"), "n": 5}, "at most 4"),
        ({**user("hi"), "temperature": -0.5}, "temperature"),
        ({**user("hi"), "top_p": 0}, "top_p"),
        ({**user("hi"), "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        (img("http://example.com/cat.png"), "allowed media domains"),
        (img("http://localhost:9/cat.png"), "loopback"),
        (img("file:///etc/passwd"), "data: URL or an http"),
        ({"messages": [{"role": "function", "content": "x"}]}, "invalid request"),
        ({**user("hi"), "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs"),
        ({**user("hi"), "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among the tools"),
        ({**user("hi"), "logit_bias": {"42": 5}}, "logit_bias"),
        ({**user("hi"), "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ]
    for body, match in cases:
        _assert_error(_post(server, body), 400, match)
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    _assert_error(r, 400, "JSON")
    for path, body in (("/v1/chat/completions", user("a\ud800b")), ("/v1/completions", {"prompt": "\udfff"}),
                       ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]})):
        r = httpx.post(server.url + path, content=json.dumps(body), timeout=30,  # JSON escapes a lone surrogate
                       headers={"Content-Type": "application/json"})
        _assert_error(r, 400, "Unicode")
    _assert_error(_post(server, {"prompt": [1, 2, 10**6]}, "/v1/completions"), 400, "vocabulary")
    _assert_error(_post(server, {"prompt": ""}, "/v1/completions"), 400, "empty")
    _assert_error(_post(server, {"prompt": "hi", "echo": True}, "/v1/completions"), 400, "echo")
    _assert_error(_post(server, {"prompt": ["a", "b", "c"], "n": 2}, "/v1/completions"), 400, "at most 4")
    _assert_error(_post(server, {**user("hi"), "model": "gpt-4"}), 404, "does not exist")
    _assert_error(httpx.get(server.url + "/v1/nothing-here"), 404, "Not Found")
    big = _data_url(b"\x89PNG" + os.urandom(1_200_000))
    _assert_error(_post(server, img(big)), 413, "limit")
    # The SDK maps them to its exception classes.
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}], n=5)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # Nothing above disturbed the server.
    r = client.completions.create(model=server.model, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_pending_limit_gives_429_and_disconnect_frees_blocks(server):
    """4 streams in flight fill --max-pending-requests 4: the 5th request gets 429. Leaving the
    streams (client disconnect) aborts them on every worker: free blocks return to their start
    value and the slots are free again. A non-streamed request whose client leaves is aborted too."""
    before = server.workers()
    # Long streams (480 tokens, no EOS): they are still running when the 5th request comes.
    body = {"prompt": list(range(30, 60)), "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            async with contextlib.AsyncExitStack() as stack:
                readers = []  # kept alive: a collected line iterator closes its stream

                async def open_stream() -> None:
                    r = await stack.enter_async_context(c.stream("POST", server.url + "/v1/completions", json=body))
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    readers.append(lines)
                    while not (await lines.__anext__()).startswith("data:"):
                        pass

                await asyncio.gather(*(open_stream() for _ in range(4)))
                r5 = await c.post(server.url + "/v1/completions", json=body)
                _assert_error(r5, 429, "too many requests")
                during = await c.get(server.url + "/epd/workers")
                assert during.json()["decode-0"]["num_free_blocks"] < before["decode-0"]["num_free_blocks"]
            # leaving the block closed all four connections mid-stream

    asyncio.run(run())
    cancelled_before = _cancelled(server)

    async def give_up_once_running() -> None:
        """A non-streamed request (4 x 480 tokens) whose client leaves once a decode worker runs it."""
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.create_task(c.post(server.url + "/v1/completions", json={**body, "stream": False, "n": 4}))
            for _ in range(600):
                if (await c.get(server.url + "/epd/workers")).json()["decode-0"].get("num_running", 0):
                    break
                await asyncio.sleep(0.1)
            assert not task.done(), task.result()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(give_up_once_running())
    after = _wait_drained(server, before)
    for inst, stats in before.items():
        assert after[inst].get("num_free_blocks") == stats.get("num_free_blocks"), (inst, after[inst])
        assert after[inst].get("num_running", 0) == 0 and after[inst].get("num_reserved", 0) == 0, after[inst]
    for _ in range(150):  # the API counts the cancel when its handler ends, after the abort went out
        if _cancelled(server) >= cancelled_before + 1:
            break
        time.sleep(0.2)
    assert _cancelled(server) >= cancelled_before + 1
    r = server.client().completions.create(model=server.model, prompt=[5, 6], max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def _cancelled(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(r'^epd_cancelled_requests_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))


def _wait_drained(server, before: dict) -> dict:
    after = server.workers()
    for _ in range(150):  # aborts are asynchronous
        if all(after[k].get("num_free_blocks") == before[k].get("num_free_blocks")
               and after[k].get("num_running", 0) == 0 for k in before):
            break
        time.sleep(0.2)
        after = server.workers()
    return after


def test_openapi_fuzz_finds_no_server_error(server):
    """schemathesis generates valid and invalid bodies from the app's OpenAPI spec: no 5xx."""
    import hypothesis
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        post = op.method.upper() == "POST"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if post else (GenerationMode.POSITIVE,):
            @hypothesis.settings(max_examples=25 if post else 3, deadline=None,
                                 derandomize=True, database=None, phases=[hypothesis.Phase.generate],
                                 suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                nonlocal ran
                ran += 1
                r = case.call(base_url=server.url, timeout=120)
                if r.status_code >= 500:
                    failures.append((op.label, case.body, r.status_code, r.text[:300]))

            check()
    assert ran >= 4 * 25
    assert not failures, failures[:5]
    assert httpx.get(server.url + "/health").status_code == 200


def test_readme_curl_examples_work_verbatim(server):
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "curl" in b and "/v1/chat" in b]
    assert len(blocks) >= 2 and any("data:image/png;base64" in b for b in blocks)
    for block in blocks:
        script = block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
        out = subprocess.run(["bash", "-c", "set -e\n" + script], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        if '"stream": true' in block:
            assert out.stdout.rstrip().endswith("data: [DONE]") and "chat.completion.chunk" in out.stdout
        else:
            assert '"object":"chat.completion"' in out.stdout.replace(" ", ""), out.stdout


def test_example_chat_with_image(server):
    out = subprocess.run([sys.executable, "examples/chat_image.py", "--base-url", server.url + "/v1",
                          "--max-tokens", "8"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OPENAI_API_KEY": "none"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


# ---- aggregated pool, audio, API key, pool down ------------------------------------------------
@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    return str(create_tiny_model("qwen2-audio", tmp_path_factory.mktemp("api") / "qa"))


@pytest.fixture(scope="module")
def audio_server(audio_dir):
    with contextlib.ExitStack() as stack:
        os.environ["EPD_API_KEY"] = KEY  # the launcher reads the key from the environment
        try:
            s = stack.enter_context(launch(audio_dir, "e:1,pd:1", "--max-worker-restarts", "0"))
        finally:
            del os.environ["EPD_API_KEY"]
        yield s


def test_api_key_required(audio_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(audio_server.url + "/v1/chat/completions", headers=headers, timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        _assert_error(r, 401, "API key")
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        audio_server.client().models.list()
    assert httpx.get(audio_server.url + "/health").status_code == 200  # health stays open for probes
    ok = openai.OpenAI(base_url=audio_server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id


def test_worker_stats_sit_behind_the_api_key(audio_server):
    """/epd/workers asks every worker for its stats: with --api-key set it needs the key too."""
    r = httpx.get(audio_server.url + "/epd/workers", timeout=30)
    _assert_error(r, 401, "API key")
    r = httpx.get(audio_server.url + "/epd/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and "pd-0" in r.json()


def test_audio_part_on_aggregated_pool(audio_server, audio_dir):
    wav = _wav(3)
    llm = LLM(audio_dir, dtype="float32")
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": f"{AUDIO_TOKEN} What was said?"}],
                                       add_generation_prompt=True, tokenize=False)
    expected = llm.generate({"prompt_token_ids": tok.encode(rendered, add_special_tokens=False),
                             "multi_modal_data": {"audio": [wav]}},
                            SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    llm.shutdown()
    client = openai.OpenAI(base_url=audio_server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": " What was said?"}]}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == expected
    texts, _, _ = _stream_texts(client.chat.completions.create(model=model, messages=messages,
                                                               max_tokens=10, temperature=0, stream=True))
    assert texts[0] == expected
    # logprobs ride the aggregated pool's token stream too: one per token, greedy = top-1
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == expected and len(content) == r.usage.completion_tokens
    assert all(c.top_logprobs[0].token == c.token and c.logprob <= 0 for c in content)
    out = subprocess.run([sys.executable, "examples/chat_audio.py", "--base-url", audio_server.url + "/v1",
                          "--max-tokens", "8"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OPENAI_API_KEY": KEY})
    assert out.returncode == 0, out.stderr


def test_pool_down_gives_503(audio_server):
    """Last test on this server: its only pd worker is killed (no restarts allowed)."""
    pd = [p for p in psutil.Process(audio_server.proc.pid).children(recursive=True)
          if "--role" in p.cmdline() and p.cmdline()[p.cmdline().index("--role") + 1] == "pd"]
    assert len(pd) == 1
    pd[0].kill()
    for _ in range(100):
        if httpx.get(audio_server.url + "/health").status_code == 503:
            break
        time.sleep(0.2)
    _assert_error(httpx.get(audio_server.url + "/health"), 503, "pd")
    r = httpx.post(audio_server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    _assert_error(r, 503, "pool")
    client = openai.OpenAI(base_url=audio_server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
    assert e.value.status_code == 503
