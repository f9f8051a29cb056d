"""Helpers of the bug-log replays (tests/serving/test_public_bugs.py): requests, idle
checks that read every worker's counters from /epd/workers, metrics, and greedy
references from the offline engine (checked against transformers where a row needs it)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time

import httpx

from epd import LLM, SamplingParams
from tests.serving.conftest import Server

#: worker counters that are 0 on an idle worker (absent counters count as 0)
BUSY_KEYS = ("num_reserved", "num_held", "num_held_requests", "num_quarantined", "num_running", "num_waiting",
             "num_sending", "num_waiting_staging", "num_remote_prefix_reads", "num_pinned_blocks",
             "num_remote_prefix_draining_blocks")


def post(server: Server, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def complete(server: Server, prompt, max_tokens: int, **kw) -> dict:
    """A greedy, non-streamed /v1/completions answer (the JSON body); asserts 200."""
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(server: Server, path: str, body: dict, timeout: float = 300) -> tuple[int, list]:
    """(HTTP status, the stream's data events: parsed JSON, or the string "[DONE]")."""
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return r.status_code, events


def streamed_text(events: list, index: int = 0) -> tuple[str, list[str], str | None]:
    """(the concatenated text of choice ``index``, its non-empty pieces, its finish_reason)."""
    pieces, reason = [], None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        for ch in ev.get("choices", []):
            if ch["index"] != index:
                continue
            piece = ch["delta"].get("content") if "delta" in ch else ch.get("text")
            if piece:
                pieces.append(piece)
            reason = ch.get("finish_reason") or reason
    return "".join(pieces), pieces, reason


def assert_error(r: httpx.Response, status: int, match: str, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert re.search(match, err["message"]), err
    if param is not None:
        assert err["param"] == param, err
    return err


def metric(server: Server, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    from tests.conftest import metric_sum

    return metric_sum(httpx.get(server.url + "/metrics", timeout=30).text, name, **labels)


def _idle(stats: dict, before: dict) -> bool:
    for inst, start in before.items():
        now = stats.get(inst, {})
        if now.get("num_free_blocks") != start.get("num_free_blocks"):
            return False
        if any(now.get(k, 0) for k in BUSY_KEYS):
            return False
        if now.get("num_free_staging_blocks") != now.get("num_staging_blocks"):
            return False
    return True


def wait_idle(server: Server, before: dict, timeout_s: float = 90.0) -> dict:
    """Poll /epd/workers until every instance of ``before`` is back to its free-block
    count with nothing reserved, held, fenced, queued or running (aborts and frees are
    asynchronous); return the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.workers()
        if _idle(stats, before) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def assert_idle(server: Server, before: dict) -> dict:
    """Every worker of ``before`` is idle again with its start number of free blocks."""
    return check_idle(wait_idle(server, before), before)


def check_idle(after: dict, before: dict) -> dict:
    """Assert that the stats ``after`` show every worker of ``before`` idle with its start
    number of free blocks (and every staging block free)."""
    for inst, start in before.items():
        assert inst in after, f"{inst} is gone: {sorted(after)}"
        assert after[inst].get("num_free_blocks") == start.get("num_free_blocks"), (inst, start, after[inst])
        for k in BUSY_KEYS:
            assert not after[inst].get(k, 0), (inst, k, after[inst])
        assert after[inst].get("num_free_staging_blocks") == after[inst].get("num_staging_blocks"), after[inst]
    return after


def wait_healthy(server: Server, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the server did not become healthy again"
        time.sleep(0.25)


class Reference:
    """Greedy answers of the offline engine (one ``LLM`` of ``model_dir``, made on first
    use): the monolithic run a disaggregated answer must equal. The engine tests prove its
    tokens equal transformers'; ``check_transformers`` re-checks that for given prompts."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._llm: LLM | None = None
        self._cache: dict = {}

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = LLM(self.model_dir, kv_cache_memory_gb=0.25, dtype="float32")
        return self._llm

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def outputs(self, prompts: list, max_tokens: int) -> list:
        """The offline engine's CompletionOutputs (greedy, no EOS) of ``prompts``: token-id
        lists, or dicts with ``prompt_token_ids`` and ``multi_modal_data``."""
        keys = [(hashlib.sha256(repr(p).encode()).hexdigest(), max_tokens) for p in prompts]
        todo = {k: p for p, k in zip(prompts, keys) if k not in self._cache}
        if todo:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            for k, out in zip(todo, self.llm.generate(list(todo.values()), params)):
                self._cache[k] = out.outputs[0]
        return [self._cache[k] for k in keys]

    def texts(self, prompts: list, max_tokens: int) -> list[str]:
        return [o.text for o in self.outputs(prompts, max_tokens)]

    def text(self, prompt, max_tokens: int) -> str:
        return self.texts([prompt], max_tokens)[0]

    def check_transformers(self, prompts: list[list[int]], max_tokens: int) -> None:
        """The offline engine's greedy tokens of these text prompts equal transformers'."""
        from tests.conftest import hf_greedy

        got = [list(o.token_ids) for o in self.outputs(prompts, max_tokens)]
        assert got == hf_greedy(self.model_dir, prompts, max_tokens)

    def chat_ids(self, content: str) -> list[int]:
        """The chat prompt of one user message ``content`` (placeholder text inline)."""
        tok = self.tokenizer
        rendered = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
        return tok.encode(rendered, add_special_tokens=False)

    def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def start_and_drop(server: Server, prompt: list[int], after_s: float) -> threading.Thread:
    """Send ``prompt`` and hang up ``after_s`` seconds later (mid-prefill)."""

    def run() -> None:
        body = {"model": server.model, "prompt": prompt, "max_tokens": 64, "temperature": 0}
        try:  # not streamed: the API watches the connection and aborts within 0.25 s of the hang-up
            httpx.post(server.url + "/v1/completions", json=body, timeout=after_s)
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=run)
    t.start()
    return t
