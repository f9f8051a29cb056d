"""Session fixtures: tiny random checkpoints built in the test run, the real default model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from epd.models.tiny import TEXT_KINDS as TINY_KINDS


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """kind -> directory of a seeded tiny random checkpoint (+ tokenizer)."""
    from epd.models.tiny import create_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {kind: str(create_tiny_model(kind, root / kind, seed=0)) for kind in TINY_KINDS}


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct, converted to safetensors once per cache."""
    from epd.models.checkpoints import resolve_model

    return str(resolve_model(None))


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers ``generate`` (greedy, fp32), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False)
            outs.append(o[0, len(p):].tolist())
    return outs


def stream_text(url: str, model: str, prompt: list[int], max_tokens: int, on_chunk=None) -> str:
    """A greedy streamed completion's text (the concatenated chunks), through the openai SDK."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    parts: list[str] = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            if on_chunk is not None:
                on_chunk(len(parts))
    return "".join(parts)


def metric_sum(text: str, name: str, **labels) -> float:
    """Sum of the samples of metric ``name`` in Prometheus text ``text`` whose labels include ``labels``."""
    import re

    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{([^}}]*)\}} ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total
