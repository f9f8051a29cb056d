"""Qwen2.5-VL and Qwen2-VL through epd's engine (``LLM``, tiny random checkpoint built here): M-RoPE
positions ride each step (``StepInput.mrope_positions``), so greedy tokens equal
transformers' ``generate`` for images of different sizes, a video, and text, batched
together under chunked prefill that splits media spans, and after a resume that puts
earlier output into the prompt (what a migration does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from epd import LLM, SamplingParams
from epd.models.tiny import create_tiny_model

MAX_TOKENS = 8


#: tiny kind -> transformers class (Qwen2-VL: no window attention, video time ids one per patch)
KINDS = {"qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration", "qwen2-vl": "Qwen2VLForConditionalGeneration"}


@pytest.fixture(scope="module", params=list(KINDS))
def qwen_dir(request, tmp_path_factory):
    return str(create_tiny_model(request.param, tmp_path_factory.mktemp("mrope") / request.param))


def _image(seed: int, hw) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*hw, 3), dtype=np.uint8))


def _frames(seed: int, n: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 24, 32, 3), dtype=np.uint8)


def _cases(tok):
    def chat(*content):
        return tok.apply_chat_template([{"role": "user", "content": list(content)}], add_generation_prompt=True,
                                       tokenize=False)

    img, vid = {"type": "image"}, {"type": "video"}
    return [
        (chat(img, {"type": "text", "text": "and"}, img, {"type": "text", "text": " now?"}),
         {"image": [_image(1, (30, 40)), _image(2, (64, 20))]}),
        (chat(vid, {"type": "text", "text": "what moved?"}), {"video": [_frames(3)]}),
        # 16 frames 1 s apart: time ids 0, 4, .., 28 run past the text after the video (5.24's
        # get_rope_index continues it at the span's start + max(h, w)), so decoding starts after a gap
        (chat(img, vid, {"type": "text", "text": "same?"}),
         {"image": [_image(4, (40, 40))], "video": [_frames(5, 16)]}),
        (chat({"type": "text", "text": "hello there"}), {}),
    ]


def _reference(qwen_dir, llm, cases) -> list[list[int]]:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(qwen_dir)
    ref_cls = getattr(transformers, cfg.architectures[0])
    ref = ref_cls.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    out = []
    for text, mm in cases:
        processed = llm.mm_processor.process(llm.get_tokenizer().encode(text), mm)
        ids = torch.tensor([processed.prompt_token_ids])
        kw = {}
        images = [it for it in processed.items if it.modality == "image"]
        videos = [it for it in processed.items if it.modality == "video"]
        if images:
            kw |= {"pixel_values": torch.cat([it.data["pixel_values"] for it in images]),
                   "image_grid_thw": torch.stack([it.data["image_grid_thw"] for it in images])}
        if videos:
            kw |= {"pixel_values_videos": torch.cat([it.data["pixel_values_videos"] for it in videos]),
                   "video_grid_thw": torch.stack([it.data["video_grid_thw"] for it in videos])}
            if cfg.model_type == "qwen2_5_vl":
                kw["second_per_grid_ts"] = torch.cat([it.data["second_per_grid_t"] for it in videos])
        types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
        with torch.inference_mode():
            g = ref.generate(ids, mm_token_type_ids=types, attention_mask=torch.ones_like(ids),
                             max_new_tokens=MAX_TOKENS, do_sample=False, **kw)
        out.append(g[0, ids.shape[1]:].tolist())
    return out


def test_greedy_equals_transformers_batched_and_chunked(qwen_dir):
    llm = LLM(qwen_dir, dtype="float32", block_size=8, max_num_batched_tokens=24, kv_cache_memory_gb=0.05,
              video_fps=1.0)
    try:
        cases = _cases(llm.get_tokenizer())
        want = _reference(qwen_dir, llm, cases)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        got = llm.generate([{"prompt": t, "multi_modal_data": mm} for t, mm in cases], params)
        assert [o.outputs[0].token_ids for o in got] == want
        # One at a time, too (no batch neighbours), and again (prefix cache hits on media blocks).
        for (t, mm), w in zip(cases, want):
            assert llm.generate({"prompt": t, "multi_modal_data": mm}, params)[0].outputs[0].token_ids == w
        # Resumed after 3 tokens (a migration): the prior output re-enters as prompt, decoded at its
        # original M-RoPE positions, and the rest of the answer is unchanged.
        # Its log-probabilities match the uninterrupted run's: the positions, not just the argmax.
        text, mm = cases[2]
        with_lp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
        first = llm.generate({"prompt": text, "multi_modal_data": mm}, with_lp)[0].outputs[0]
        prior = first.token_ids[:3]
        ids = llm.get_tokenizer().encode(text) + prior
        resumed = llm.generate({"prompt_token_ids": ids, "multi_modal_data": mm},
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS - 3, num_prior_output_tokens=3,
                                              logprobs=1))[0].outputs[0]
        assert prior + resumed.token_ids == want[2]
        np.testing.assert_allclose([lp.logprob for lp in resumed.logprobs], [lp.logprob for lp in first.logprobs[3:]],
                                   rtol=0, atol=1e-4)
    finally:
        llm.shutdown()
