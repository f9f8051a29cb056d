"""Multimodal types shared by every process: media items and their prompt spans.

One type per concept, used in-process and on the wire as is (msgspec Structs;
``epd.messages`` encodes them, turning each ``torch.Tensor`` into a validated
``TensorBlob`` and back). Cheap to import: no transformers, no model code —
preprocessing lives in ``epd.encoders.processor``.
"""

from __future__ import annotations

import msgspec
import torch  # resolves the ``torch.Tensor`` annotation for msgspec


class Placeholder(msgspec.Struct, frozen=True):
    """One media item's span in the prompt.

    ``offset``: index of its first placeholder token; ``length``: number of
    placeholder tokens (= embedding rows); ``item_hash``: full hex digest of the
    item (sha256 of the decoded, preprocessed input); it is mixed into the hash of
    every KV block the span touches, so the same text with a different image never
    shares KV.
    ``grid_thw`` / ``time_interval``: the item's vision grid (temporal, height, width;
    before the spatial merge) and, for a video, the time-id step between its temporal
    patches (tokens_per_second x seconds per patch, ``epd.models.mrope.time_interval``) —
    Qwen2-VL / Qwen2.5-VL items only (None otherwise): what its M-RoPE positions follow
    (``epd.models.mrope.prompt_mrope_positions``), so every worker holding the request
    (prefill, decode, a migration's target) computes them from the request alone.
    """

    offset: int
    length: int
    item_hash: str
    grid_thw: tuple[int, int, int] | None = None
    time_interval: float | None = None


class MediaItem(msgspec.Struct):
    """One preprocessed media item, ready for its tower (built by
    ``epd.encoders.processor``; router -> E inside ``EncodeRequest``).

    image: ``data["pixel_values"]``: [3, H, W] fp32 (fixed-resolution LLaVA); Qwen2-VL /
    Qwen2.5-VL: [patches, C * temporal_patch * patch**2] fp32 and ``data["image_grid_thw"]``:
    [3] int64 (the patch grid; num_tokens = t * h * w / merge**2).
    video (Qwen2-VL / Qwen2.5-VL): ``data["pixel_values_videos"]``: [patches, C *
    temporal_patch * patch**2] fp32, ``data["video_grid_thw"]``: [3] int64 and
    ``data["second_per_grid_t"]``: [1] fp32 (seconds of video per temporal patch, for M-RoPE).
    audio (embed): ``data["input_features"]``: [windows, mel, frames] fp32 and
    ``data["num_frames"]``: [windows] int64 (valid frames per 30 s window).
    audio (transcribe): ``data["audio"]``: [samples] fp32 at 16 kHz.
    ``num_tokens``: embedding rows the tower will produce (0 for transcribe).

    On the wire each tensor is a ``TensorBlob`` (``epd.messages``): decoding
    checks its dtype against the allow-list and its byte count against the
    shape and ``MAX_TENSOR_BYTES`` (``MessageError`` otherwise).
    """

    modality: str
    item_hash: str
    data: dict[str, torch.Tensor] = {}
    num_tokens: int = 0
