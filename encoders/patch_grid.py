"""What a native-resolution (Qwen2-VL / Qwen2.5-VL) item's pixel tensor weighs, from the
picture's size alone, before any processing.

The model's image processor resizes each picture (or video frame) to multiples of
``patch * merge`` pixels between its min and max pixels (transformers' ``smart_resize``)
and cuts it into ``patch x patch`` patches. An image's patch is a row of
``3 * temporal_patch * patch**2`` fp32 values (``pixel_values``); a video keeps one frame
per temporal slot, ``3 * patch**2`` values per frame and patch (``pixel_values_videos``).
``MultiModalProcessor`` checks these sizes against ``MediaLimits.max_item_bytes`` from
the media's header, so an item the encode worker would refuse is scaled down (an image),
sampled with fewer frames (a video) or refused before it is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from epd.encoders.media_limits import UnsupportedMediaError

__all__ = ["FLOAT32_BYTES", "PatchGrid"]

FLOAT32_BYTES = 4


@dataclass(frozen=True, slots=True)
class PatchGrid:
    """A native-resolution processor's resize rule and patch size.

    ``patch``: patch side (pixels); ``merge``: patches merged per token along each side;
    ``temporal_patch``: frames per temporal patch; ``min_pixels`` / ``max_pixels``: the
    resized picture's bounds (the processor's ``size["shortest_edge"]`` / ``["longest_edge"]``).
    """

    patch: int
    merge: int
    temporal_patch: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def of(cls, image_processor) -> PatchGrid:
        """The grid of a transformers ``Qwen2VLImageProcessor`` (either backend)."""
        size = image_processor.size
        edge = (lambda k: getattr(size, k)) if hasattr(size, "shortest_edge") else size.__getitem__
        return cls(int(image_processor.patch_size), int(image_processor.merge_size),
                   int(image_processor.temporal_patch_size), int(edge("shortest_edge")), int(edge("longest_edge")))

    def resized(self, width: int, height: int, max_pixels: int | None = None, modality: str = "image"
                ) -> tuple[int, int]:
        """(width, height) the processor resizes a ``width`` x ``height`` picture to, with
        ``max_pixels`` (default: the processor's) as its upper bound.

        Raises:
            UnsupportedMediaError: an aspect ratio over 200 (the processor refuses it).
        """
        try:
            h, w = smart_resize(height, width, factor=self.patch * self.merge, min_pixels=self.min_pixels,
                                max_pixels=max_pixels or self.max_pixels)
        except ValueError as e:
            raise UnsupportedMediaError(f"the {modality} is {width}x{height}: {e}", modality=modality) from None
        return w, h

    def image_bytes(self, width: int, height: int, max_pixels: int | None = None) -> int:
        """Bytes of an image's ``pixel_values`` [patches, 3 * temporal_patch * patch**2] fp32."""
        w, h = self.resized(width, height, max_pixels)
        return (w // self.patch) * (h // self.patch) * 3 * self.temporal_patch * self.patch**2 * FLOAT32_BYTES

    def frame_bytes(self, width: int, height: int) -> int:
        """Bytes one video frame adds to ``pixel_values_videos`` (3 * patch**2 fp32 per patch)."""
        w, h = self.resized(width, height, modality="video")
        return (w // self.patch) * (h // self.patch) * 3 * self.patch**2 * FLOAT32_BYTES

    def max_pixels_within(self, limit_bytes: int) -> int:
        """The largest ``max_pixels`` whose images' ``pixel_values`` fit in ``limit_bytes``."""
        row = 3 * self.temporal_patch * self.patch**2 * FLOAT32_BYTES
        return (limit_bytes // row) * self.patch**2
