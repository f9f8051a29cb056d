"""epd.models.mrope against transformers' ``Qwen2_5_VLModel.get_rope_index`` on the same prompts."""

from __future__ import annotations

import pytest
import torch

from epd.models.mrope import VisionSpan, mrope_positions
from epd.models.tiny import QWEN_VL_TOKENS, build_tiny_tokenizer


@pytest.fixture(scope="module")
def reference():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from epd.models.tiny import _qwen2_5_vl_config

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_VL_TOKENS)})
    return Qwen2_5_VLModel(_qwen2_5_vl_config(tok)).eval()


def _prompt(config, layout) -> tuple[list[int], list[int], list[VisionSpan]]:
    """``layout``: text lengths (int) and ("image" | "video", grid_thw[, second_per_grid_t]) items,
    each item wrapped in vision_start / vision_end as Qwen's template does."""
    ids, types, spans = [], [], []
    for part in layout:
        if isinstance(part, int):
            ids += [7 + k % 50 for k in range(part)]
            types += [0] * part
            continue
        kind, grid, *sec = part
        ids.append(config.vision_start_token_id)
        types.append(0)
        n = grid[0] * (grid[1] // 2) * (grid[2] // 2)
        spans.append(VisionSpan(len(ids), grid, sec[0] if kind == "video" else None))
        ids += [config.image_token_id if kind == "image" else config.video_token_id] * n
        types += [1 if kind == "image" else 2] * n
        ids.append(config.vision_end_token_id)
        types.append(0)
    return ids, types, spans


LAYOUTS = {
    "one image": [5, ("image", (1, 8, 10)), 4],
    "two images of different sizes": [3, ("image", (1, 8, 10)), 2, ("image", (1, 16, 4)), 6],
    "image first": [("image", (1, 4, 4)), 3],
    "video": [4, ("video", (3, 4, 4), 1.0), 3],
    "video, fractional interval": [2, ("video", (4, 6, 4), 0.75), 2],
    "long video past its spatial extent": [2, ("video", (6, 2, 2), 2.0), 5],
    "image then video": [2, ("image", (1, 6, 8)), 1, ("video", (2, 4, 6), 0.5), 3],
    "text only": [9],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_equals_transformers_get_rope_index(reference, name):
    config = reference.config
    ids, types, spans = _prompt(config, LAYOUTS[name])
    vc = config.vision_config
    got, delta = mrope_positions(len(ids), spans, spatial_merge_size=vc.spatial_merge_size,
                                 tokens_per_second=vc.tokens_per_second)
    assert got.shape == (3, len(ids)) and got.dtype == torch.int64
    if not spans:  # transformers needs a vision span; text is plain 1-D positions
        assert torch.equal(got, torch.arange(len(ids)).expand(3, -1)) and delta == 0
        return
    images = [s.grid_thw for s in spans if s.second_per_grid_t is None]
    videos = [s for s in spans if s.second_per_grid_t is not None]
    want, want_delta = reference.get_rope_index(
        torch.tensor([ids]), torch.tensor([types]),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor([s.grid_thw for s in videos]) if videos else None,
        second_per_grid_ts=torch.tensor([s.second_per_grid_t for s in videos]) if videos else None)
    assert torch.equal(got, want[:, 0]), (got, want[:, 0])
    # Decoded tokens continue as text: get_rope_index over the prompt + 3 more text tokens.
    more, _ = reference.get_rope_index(
        torch.tensor([ids + [9, 9, 9]]), torch.tensor([types + [0, 0, 0]]),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor([s.grid_thw for s in videos]) if videos else None,
        second_per_grid_ts=torch.tensor([s.second_per_grid_t for s in videos]) if videos else None)
    after = torch.arange(len(ids), len(ids) + 3) + delta
    assert torch.equal(more[:, 0, -3:], after.expand(3, -1)), (more[:, 0, -3:], after)
    if name == "long video past its spatial extent":  # transformers' rope_deltas is max + 1 - len: not it
        assert delta < int(want_delta)


def test_decode_positions_continue_after_the_prompt(reference):
    vc = reference.config.vision_config
    ids, _, spans = _prompt(reference.config, LAYOUTS["two images of different sizes"])
    pos, delta = mrope_positions(len(ids), spans, spatial_merge_size=2, tokens_per_second=vc.tokens_per_second)
    assert delta < 0 and len(ids) + delta == int(pos.max()) + 1  # the first decoded token follows the last id


def test_bad_spans():
    with pytest.raises(ValueError, match="merge"):
        mrope_positions(20, [VisionSpan(0, (1, 3, 4))], spatial_merge_size=2, tokens_per_second=2)
    with pytest.raises(ValueError, match="past"):
        mrope_positions(5, [VisionSpan(2, (1, 4, 4))], spatial_merge_size=2, tokens_per_second=2)
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions(20, [VisionSpan(0, (1, 4, 4)), VisionSpan(2, (1, 4, 4))], spatial_merge_size=2,
                        tokens_per_second=2)
