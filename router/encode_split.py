"""How one request's media items are spread over the encode pool.

Without a split, every item goes to one encode instance (the pool's routing policy's
pick). With ``--video-encode-split auto`` (the default) and two or more routable encode
instances, a Qwen2-VL / Qwen2.5-VL video item of two or more temporal patches is cut
into contiguous chunks of temporal patches, as even as possible and at most one per
instance, each encoded by its own instance: the vision tower attends within a temporal
patch, so the chunks' rows, concatenated in temporal order, are the whole video's
embedding (tests/encoders/test_video_chunks.py). The request's other items go to the
policy's pick. Which instance takes which chunk follows rendezvous hashing on the item
hash (``MediaAffinity.score``), so the same video on the same live instances meets the
same encoder caches again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epd.launch.config import VIDEO_ENCODE_SPLITS  # noqa: F401  ("auto" splits as above, "off" never)
from epd.multimodal import MediaItem
from epd.router.policies import MediaAffinity


@dataclass(slots=True)
class EncodeShare:
    """What one encode instance is sent: ``items`` with their ``temporal_ranges`` (None:
    whole), and for each the (item index, chunk index) its embedding ref fills."""

    instance_id: str
    items: list[MediaItem] = field(default_factory=list)
    temporal_ranges: list[tuple[int, int] | None] = field(default_factory=list)
    slots: list[tuple[int, int]] = field(default_factory=list)

    def add(self, item: MediaItem, temporal_range: tuple[int, int] | None, slot: tuple[int, int]) -> None:
        self.items.append(item)
        self.temporal_ranges.append(temporal_range)
        self.slots.append(slot)


def temporal_chunks(num_patches: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_patches`` temporal patches cut into ``min(num_chunks, num_patches)`` contiguous
    ``(start, end)`` ranges whose sizes differ by at most one (the larger first).

    Raises:
        ValueError: ``num_patches`` or ``num_chunks`` below 1.
    """
    if num_patches < 1 or num_chunks < 1:
        raise ValueError(f"need >= 1 patches and chunks, got {num_patches} and {num_chunks}")
    n = min(num_chunks, num_patches)
    size, extra = divmod(num_patches, n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append((start, end))
        start = end
    return out


def temporal_patches(item: MediaItem) -> int:
    """Temporal patches of a Qwen-VL video item (``video_grid_thw[0]``); 0 for anything else."""
    grid = item.data.get("video_grid_thw") if item.modality == "video" else None
    if grid is None or "pixel_values_videos" not in item.data or tuple(grid.shape) != (3,):
        return 0
    return int(grid[0])


def chunk_item(item: MediaItem, temporal_range: tuple[int, int]) -> MediaItem:
    """Video ``item`` as the encoder of chunk ``temporal_range = (start, end)`` receives it:
    the same hash, grid, seconds per patch and ``num_tokens``, and only the chunk's pixel
    rows ``pixel_values_videos[start * h * w : end * h * w]`` (see ``EncodeRequest``)."""
    start, end = temporal_range
    _, h, w = (int(x) for x in item.data["video_grid_thw"].tolist())
    pixels = item.data["pixel_values_videos"][start * h * w:end * h * w]
    return MediaItem(item.modality, item.item_hash, {**item.data, "pixel_values_videos": pixels}, item.num_tokens)


def plan_encode(items: list[MediaItem], primary: str, encoders: list[str], split: str = "auto"
                ) -> list[EncodeShare]:
    """Each encode instance's share of ``items`` (instances without one are left out).

    ``primary``: the routing policy's pick, which takes every item not split;
    ``encoders``: the routable instances the chunks may go to (``primary`` among them);
    ``split``: one of ``VIDEO_ENCODE_SPLITS``. Slot ``(i, j)``: chunk j of item i (0 for
    an item sent whole); a split item's chunks are in temporal order.
    """
    shares: dict[str, EncodeShare] = {}

    def share(inst: str) -> EncodeShare:
        return shares.setdefault(inst, EncodeShare(inst))

    others = sorted(set(encoders) | {primary})
    for i, item in enumerate(items):
        t = temporal_patches(item)
        if split != "auto" or len(others) < 2 or t < 2:
            share(primary).add(item, None, (i, 0))
            continue
        ranked = sorted(others, key=lambda e: (MediaAffinity.score(item.item_hash, e), e), reverse=True)
        for j, (rng, inst) in enumerate(zip(temporal_chunks(t, len(ranked)), ranked)):
            share(inst).add(chunk_item(item, rng), rng, (i, j))
    return list(shares.values())
