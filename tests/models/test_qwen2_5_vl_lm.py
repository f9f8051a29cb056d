"""Qwen2.5-VL's LM half in epd's own model code (Qwen2 blocks with M-RoPE), driven here by
hand — prefill over a one-chunk paged KV cache, then decode steps — against transformers'
``Qwen2_5_VLForConditionalGeneration.generate`` on the same images. Not yet served: the
engine's steps carry 1-D positions (epd.models.registry.MULTIMODAL_ARCHITECTURES leaves it out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoTokenizer

from epd.encoders.encoder_runner import EncoderRunner
from epd.encoders.processor import MultiModalProcessor
from epd.layers.attention import Attention, AttentionMetadata, PrefillChunk, set_attention_metadata
from epd.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from epd.models.loader import load_weights
from epd.models.mrope import VisionSpan, mrope_positions
from epd.models.qwen2 import Qwen2ForCausalLM
from epd.models.tiny import create_tiny_model

BLOCK = 8
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return str(create_tiny_model("qwen2.5-vl", tmp_path_factory.mktemp("qlm") / "qwen2.5-vl"))


def _greedy(model, embeds: torch.Tensor, positions: torch.Tensor, delta: int, steps: int) -> list[int]:
    """Prefill ``embeds`` [T, H] at ``positions`` [3, T], then ``steps - 1`` decode steps at
    1-D positions index + delta; a fresh paged cache of BLOCK-token blocks."""
    n = embeds.shape[0] + steps
    blocks = (n + BLOCK - 1) // BLOCK
    for m in model.modules():
        if isinstance(m, Attention):
            m.k_cache = torch.zeros(blocks, BLOCK, m.num_kv_heads, m.head_dim)
            m.v_cache = torch.zeros_like(m.k_cache)
    table = torch.arange(blocks, dtype=torch.int32)
    t = embeds.shape[0]
    md = AttentionMetadata(torch.arange(t), 0, None, None, [PrefillChunk(0, t, t, table)])
    with torch.inference_mode(), set_attention_metadata(md):
        hidden = model(None, positions, embeds)
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    for i in range(t, t + steps - 1):
        md = AttentionMetadata(torch.tensor([i]), 1, table[None], torch.tensor([i + 1], dtype=torch.int32))
        with torch.inference_mode(), set_attention_metadata(md):
            hidden = model(torch.tensor([out[-1]]), torch.tensor([i + delta]))
        out.append(int(model.compute_logits(hidden).argmax(-1)))
    return out


def test_mrope_lm_greedy_equals_transformers_with_two_images(qwen_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(qwen_dir)
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    proc = MultiModalProcessor(qwen_dir, cfg)
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, hw + (3,), dtype=np.uint8)) for hw in ((30, 40), (64, 20))]
    content = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": " now?"}]
    text = tok.apply_chat_template([{"role": "user", "content": content}],
                                   add_generation_prompt=True, tokenize=False)
    processed = proc.process(tok.encode(text), {"image": images})
    ids = torch.tensor(processed.prompt_token_ids)
    grids = torch.stack([it.data["image_grid_thw"] for it in processed.items])

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref.generate(ids[None], pixel_values=torch.cat([it.data["pixel_values"] for it in processed.items]),
                            image_grid_thw=grids, mm_token_type_ids=(ids == cfg.image_token_id).int()[None],
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=NEW_TOKENS,
                            do_sample=False)[0, len(ids):].tolist()

    model = Qwen2ForCausalLM(cfg.get_text_config(), 2048).eval()
    load_weights(model, qwen_dir)
    assert all(isinstance(m.self_attn.rotary_emb, MRotaryEmbedding) for m in model.model.layers)
    embeds = model.embed_input_ids(ids).clone()
    for ph, emb in zip(processed.placeholders, EncoderRunner(qwen_dir, cfg).encode(processed.items)):
        embeds[ph.offset:ph.offset + ph.length] = emb
    spans = [VisionSpan(p.offset, tuple(it.data["image_grid_thw"].tolist()))
             for p, it in zip(processed.placeholders, processed.items)]
    positions, delta = mrope_positions(len(ids), spans, spatial_merge_size=2,
                                       tokens_per_second=cfg.vision_config.tokens_per_second)
    assert delta < 0  # the images take fewer positions than tokens: decode positions are not the indices
    assert _greedy(model, embeds, positions, delta, NEW_TOKENS) == want
    # 1-D positions (what the engine passes today) give other tokens: M-RoPE matters here.
    assert _greedy(model, embeds, torch.arange(len(ids)), 0, NEW_TOKENS) != want


def test_text_positions_reduce_to_plain_rope():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    plain, mrope = RotaryEmbedding(cfg, 16, 64), MRotaryEmbedding(cfg, 16, 64, [2, 3, 3])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    pos = torch.tensor([0, 3, 7, 8, 40])
    for got, want in zip(mrope(pos.expand(3, -1), q, k), plain(pos, q, k)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="sum"):
        MRotaryEmbedding(cfg, 16, 64, [2, 3, 2])
    # Positions past the context (a long video's time ids) are computed, not looked up.
    far = torch.tensor([[5000], [3], [4]])
    got_q, _ = mrope(far, q[:1], k[:1])
    table = RotaryEmbedding(cfg, 16, 6000)
    want_t, want_h = table(torch.tensor([5000]), q[:1], k[:1])[0], table(torch.tensor([3]), q[:1], k[:1])[0]
    torch.testing.assert_close(got_q[..., :2], want_t[..., :2])  # frequencies 0-1 follow time
    torch.testing.assert_close(got_q[..., 2:5], want_h[..., 2:5])  # 2-4 follow height


def test_mrope_lm_greedy_equals_transformers_with_a_video(qwen_dir):
    """A video of 8 temporal patches (16 frames 1 s apart): time ids (0, 4, .., 28) run past the
    span's height and width and past the text after it, so where decoding continues matters."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(qwen_dir)
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    proc = MultiModalProcessor(qwen_dir, cfg, video_fps=1.0)
    frames = np.random.default_rng(4).integers(0, 256, (16, 24, 32, 3), dtype=np.uint8)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                 {"type": "text", "text": "what moved?"}]}],
                                   add_generation_prompt=True, tokenize=False)
    processed = proc.process(tok.encode(text), {"video": [frames]})
    (video,) = processed.items
    ids = torch.tensor(processed.prompt_token_ids)
    grid, second = video.data["video_grid_thw"], video.data["second_per_grid_t"]
    assert grid.tolist()[0] == 8

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref.generate(ids[None], pixel_values_videos=video.data["pixel_values_videos"],
                            video_grid_thw=grid[None], second_per_grid_ts=second,
                            mm_token_type_ids=2 * (ids == cfg.video_token_id).int()[None],
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=NEW_TOKENS,
                            do_sample=False)[0, len(ids):].tolist()

    model = Qwen2ForCausalLM(cfg.get_text_config(), 2048).eval()
    load_weights(model, qwen_dir)
    embeds = model.embed_input_ids(ids).clone()
    ph = processed.placeholders[0]
    embeds[ph.offset:ph.offset + ph.length] = EncoderRunner(qwen_dir, cfg).encode([video])[0]
    positions, delta = mrope_positions(len(ids), [VisionSpan(ph.offset, tuple(grid.tolist()), float(second))],
                                       spatial_merge_size=2, tokens_per_second=cfg.vision_config.tokens_per_second)
    assert _greedy(model, embeds, positions, delta, NEW_TOKENS) == want
