"""Multimodal RoPE (M-RoPE) positions of Qwen2-VL / Qwen2.5-VL prompts.

Every prompt token gets three position ids (time, height, width). A text token has the
same id in all three, counting on from the previous token; the tokens of one image or
video span take ``start + (t * time_interval, h, w)`` over the span's merged grid
(t, h, w) in row-major order, where ``start`` is the position the span begins at, and the
text after a span continues from ``start + max(h, w)``. Decoding continues in 1-D, as
more text: the token at index ``i >= len(prompt)`` has id ``i + delta`` in all three rows,
``delta`` = (the id the next text token would get) - len(prompt).

Source: transformers ``Qwen2_5_VLModel.get_rope_index`` / ``get_vision_position_ids``
(5.24), which this module equals on the same inputs, and its ``generate``, whose decoded
tokens continue as text (tests/models/test_mrope.py, tests/engine/test_mrope_engine.py).
Two things differ from Qwen's original code (transformers 4.x) and vLLM, which continue
after a span from ``max(positions of the span) + 1``: after a *video* whose time ids run
past its height and width, 5.24 continues from ``start + max(h, w)``; and 5.24's returned
``rope_deltas`` (``max(positions) + 1 - len``) is not what its ``generate`` decodes at
then. Images (t = 1) are the same either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["VisionSpan", "mrope_positions", "prompt_mrope_positions", "time_interval"]


@dataclass(frozen=True, slots=True)
class VisionSpan:
    """One image or video in a prompt.

    ``offset``: index of its first placeholder token; ``grid_thw``: the vision tower's patch
    grid (temporal, height, width), before the spatial merge (the processor's
    ``image_grid_thw`` / ``video_grid_thw`` row); its span holds
    ``t * (h // merge) * (w // merge)`` tokens. ``second_per_grid_t``: seconds of video per
    temporal patch (the processor's ``second_per_grid_ts``, e.g. temporal_patch_size / fps);
    None for an image.
    """

    offset: int
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None


def time_interval(second_per_grid_t: float, tokens_per_second: float) -> float:
    """Time-id step between a video's temporal patches: ``tokens_per_second`` x
    ``second_per_grid_t``, computed in float32 as transformers does (the step is truncated to
    an integer only after multiplying by the patch index)."""
    return float(torch.tensor(second_per_grid_t, dtype=torch.float32) * tokens_per_second)


def mrope_positions(num_tokens: int, spans: list[VisionSpan], *, spatial_merge_size: int,
                    tokens_per_second: float) -> tuple[torch.Tensor, int]:
    """Position ids of a prompt of ``num_tokens`` tokens holding ``spans``.

    ``spatial_merge_size`` and ``tokens_per_second`` are the vision config's. Returns
    (``positions`` [3, num_tokens] int64 — rows time, height, width — and ``delta``, the
    offset of every later (decoded) token's 1-D position from its index).

    Raises:
        ValueError: spans that overlap, run past the prompt, or whose grid does not divide
            by ``spatial_merge_size``.
    """
    return _positions(num_tokens, [(s.offset, tuple(int(x) for x in s.grid_thw),
                                    None if s.second_per_grid_t is None
                                    else time_interval(s.second_per_grid_t, tokens_per_second))
                                   for s in spans], spatial_merge_size)


def _positions(num_tokens: int, spans: list[tuple[int, tuple[int, int, int], float | None]],
               merge: int) -> tuple[torch.Tensor, int]:
    """(offset, grid_thw, time step or None for an image) per span -> positions, delta."""
    positions = torch.empty((3, num_tokens), dtype=torch.int64)
    cur, end = 0, 0  # next position id; prompt index after the previous span
    for offset, (t, h, w), interval in sorted(spans, key=lambda s: s[0]):
        if h % merge or w % merge or min(t, h, w) < 1:
            raise ValueError(f"grid {(t, h, w)} does not merge by {merge}")
        h, w = h // merge, w // merge
        if offset < end or offset + t * h * w > num_tokens:
            raise ValueError(f"span at {offset} of {t * h * w} tokens overlaps another or runs past "
                             f"the prompt's {num_tokens} tokens")
        positions[:, end:offset] = torch.arange(offset - end) + cur
        cur += offset - end
        if interval is None:
            times = torch.arange(t)
        else:  # float32, truncated after the multiply (transformers' get_vision_position_ids)
            times = (torch.arange(t) * torch.tensor(interval, dtype=torch.float32)).long()
        tt, hh, ww = torch.meshgrid(times, torch.arange(h), torch.arange(w), indexing="ij")
        positions[:, offset:offset + t * h * w] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(h, w)
        end = offset + t * h * w
    positions[:, end:] = torch.arange(num_tokens - end) + cur
    # The next token continues as text would: from the last text position (or a final span's
    # start + max(h, w)), not from max(positions) + 1 (see the module docstring).
    delta = cur + (num_tokens - end) - num_tokens
    return positions, delta


def prompt_mrope_positions(num_tokens: int, placeholders) -> tuple[torch.Tensor, int] | None:
    """:func:`mrope_positions` of a processed prompt from its ``placeholders`` alone
    (``epd.multimodal.Placeholder``: each Qwen-VL item's ``grid_thw`` and, for a video, its
    ``time_interval``; the spatial merge is the grid's area over the span's length), so any
    worker holding the request computes them without the model config. None when no
    placeholder has a grid (text, LLaVA, audio): positions are then the token indices.

    Raises:
        ValueError: some placeholders with a grid and some without, a span whose length is
            not its grid over a square merge, or spans that do not fit.
    """
    with_grid = [p for p in placeholders if p.grid_thw is not None]
    if not with_grid:
        return None
    if len(with_grid) != len(placeholders):
        raise ValueError("M-RoPE positions need a vision grid on every media placeholder")
    spans, merges = [], set()
    for p in placeholders:
        t, h, w = (int(x) for x in p.grid_thw)
        merge = math.isqrt(t * h * w // p.length) if p.length else 0
        if merge < 1 or t * h * w != p.length * merge * merge:
            raise ValueError(f"the placeholder at {p.offset} has {p.length} tokens for grid {p.grid_thw}")
        merges.add(merge)
        spans.append((p.offset, (t, h, w), p.time_interval))
    if len(merges) != 1:
        raise ValueError(f"placeholders disagree on the spatial merge: {sorted(merges)}")
    return _positions(num_tokens, spans, merges.pop())
