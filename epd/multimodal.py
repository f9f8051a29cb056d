"""Multimodal types shared by every process: media items and their prompt spans.

One type per concept, used in-process and on the wire as is (msgspec Structs;
``epd.messages`` encodes them, turning each ``torch.Tensor`` into a validated
``TensorBlob`` and back). Cheap to import: no transformers, no model code —
preprocessing lives in ``epd.encoders.processor``.
"""

from __future__ import annotations

import msgspec
import torch  # noqa: F401  (resolves the ``torch.Tensor`` annotation for msgspec)


class Placeholder(msgspec.Struct, frozen=True):
    """One media item's span in the prompt.

    ``offset``: index of its first placeholder token; ``length``: number of
    placeholder tokens (= embedding rows); ``item_hash``: full hex digest of the
    item (sha256 of the decoded, preprocessed input); it is mixed into the hash of
    every KV block the span touches, so the same text with a different image never
    shares KV.
    """

    offset: int
    length: int
    item_hash: str


class MediaItem(msgspec.Struct):
    """One preprocessed media item, ready for its tower (built by
    ``epd.encoders.processor``; router -> E inside ``EncodeRequest``).

    image: ``data["pixel_values"]``: [3, H, W] fp32.
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
