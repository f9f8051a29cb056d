"""E-pool compute: media items -> embeddings (or transcripts), through the encoder cache."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from epd.encoders.encoder_cache import EncoderCache
from epd.encoders.processor import model_modalities
from epd.messages import MessageError
from epd.multimodal import MediaItem


class EncoderRunner:
    """Runs the towers of one model.

    ``encode(items)`` returns one embedding ``[item.num_tokens, text_hidden]``
    per item (images are batched through the vision tower — native-resolution
    Qwen-VL images as one flat patch sequence with their grids; audio windows
    through the audio tower). ``transcribe(items)`` runs the Whisper speech
    front end for text-only LMs and returns the transcripts. Results are
    cached by item hash in ``cache`` (transcripts as UTF-8 bytes in a uint8
    tensor), so a repeated item is encoded once.
    """

    def __init__(self, model_dir: str | Path, config: PretrainedConfig, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", cache_bytes: int = 512 * 2**20, audio_mode: str = "auto") -> None:
        self.model_dir, self.config, self.dtype, self.device = str(model_dir), config, dtype, device
        self.modalities = model_modalities(config, audio_mode)
        self.cache = EncoderCache(cache_bytes)
        self._vision = self._audio = self._speech = None

    @property
    def vision(self):
        if self._vision is None:
            from epd.encoders.towers import QWEN_VL_CLASSES, QwenVisionTower, VisionTower

            cls = QwenVisionTower if self.config.model_type in QWEN_VL_CLASSES else VisionTower
            self._vision = cls(self.model_dir, self.config, self.dtype, self.device)
        return self._vision

    @property
    def audio(self):
        if self._audio is None:
            from epd.encoders.towers import AudioTower

            self._audio = AudioTower(self.model_dir, self.config, self.dtype, self.device)
        return self._audio

    @property
    def speech(self):
        if self._speech is None:
            from epd.encoders.speech import SpeechFrontEnd

            self._speech = SpeechFrontEnd(device=self.device)
        return self._speech

    def encode(self, items: list[MediaItem], temporal_ranges: list[tuple[int, int] | None] | None = None
               ) -> list[torch.Tensor]:
        """One embedding per item: ``[item.num_tokens, text_hidden]``, or for a video chunk
        (``temporal_ranges[i] = (start, end)``, see ``EncodeRequest``) the rows of its
        temporal patches ``[(end - start) * h * w / merge**2, text_hidden]``, cached under
        the item hash and the range.

        Raises:
            MessageError: a range or a chunk's pixel rows that do not fit the item (see
                ``video_chunk``); the ranges' count is not the items'.
            RuntimeError: a tower produced another number of rows than expected.
        """
        ranges = list(temporal_ranges or [None] * len(items))
        if len(ranges) != len(items):
            raise MessageError(f"{len(ranges)} temporal ranges for {len(items)} items")
        grids: list[torch.Tensor | None] = [None] * len(items)
        rows = [it.num_tokens for it in items]
        keys = [it.item_hash for it in items]
        for i, rng in enumerate(ranges):
            if rng is not None:
                grids[i], rows[i] = video_chunk(items[i], rng, self.config.vision_config.spatial_merge_size)
                keys[i] = f"{items[i].item_hash}@t{rng[0]}:{rng[1]}"
        results: list[torch.Tensor | None] = [self.cache.get(k) for k in keys]
        todo = [i for i, r in enumerate(results) if r is None]
        images = [i for i in todo if items[i].modality == "image"]
        audios = [i for i in todo if items[i].modality == "audio"]
        videos = [i for i in todo if items[i].modality == "video"]
        if images and "image_grid_thw" in items[images[0]].data:  # native resolution: one flat patch sequence
            pixels = torch.cat([items[i].data["pixel_values"] for i in images])
            grid = torch.stack([items[i].data["image_grid_thw"] for i in images])
            for i, emb in zip(images, self.vision.encode(pixels, grid)):
                results[i] = emb
        elif images:
            pixels = torch.stack([items[i].data["pixel_values"] for i in images])
            for i, emb in zip(images, self.vision.encode(pixels)):
                results[i] = emb
        if videos:  # temporal patches (Qwen-VL): the vision tower takes them as it takes images
            pixels = torch.cat([items[i].data["pixel_values_videos"] for i in videos])
            grid = torch.stack([items[i].data["video_grid_thw"] if grids[i] is None else grids[i] for i in videos])
            for i, emb in zip(videos, self.vision.encode(pixels, grid)):
                results[i] = emb
        for i in audios:
            data = items[i].data
            windows = self.audio.encode(data["input_features"], data["num_frames"])
            results[i] = torch.cat(windows)
        for i in todo:
            emb = results[i]
            if emb.shape[0] != rows[i]:
                raise RuntimeError(f"{items[i].modality} encoder produced {emb.shape[0]} rows, "
                                   f"expected {rows[i]}")
            self.cache.put(keys[i], emb.detach().contiguous())
        return results  # type: ignore[return-value]

    def transcribe(self, items: list[MediaItem]) -> list[str]:
        out: list[str] = []
        for it in items:
            cached = self.cache.get(it.item_hash)
            if cached is not None:
                out.append(bytes(cached.numpy()).decode())
                continue
            text = self.speech.transcribe(it.data["audio"].numpy())
            self.cache.put(it.item_hash, torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))
            out.append(text)
        return out


def video_chunk(item: MediaItem, temporal_range, merge: int) -> tuple[torch.Tensor, int]:
    """The grid ``[3]`` int64 ``(end - start, h, w)`` and embedding rows
    ``(end - start) * h * w / merge**2`` of chunk ``temporal_range = (start, end)`` of video
    ``item``, after checking what another process sent: a Qwen-VL video item whose
    ``video_grid_thw`` (t, h, w) is the whole video's (``num_tokens = t * h * w / merge**2``),
    integers ``0 <= start < end <= t``, and exactly ``(end - start) * h * w`` pixel rows.

    Raises:
        MessageError: any of these does not hold (the message says which).
    """
    data = item.data
    if item.modality != "video" or "video_grid_thw" not in data or "pixel_values_videos" not in data:
        raise MessageError(f"a temporal range is for a video item of temporal patches, not {item.modality}")
    grid = data["video_grid_thw"]
    if tuple(grid.shape) != (3,):
        raise MessageError(f"video_grid_thw must be [3], got {list(grid.shape)}")
    t, h, w = (int(x) for x in grid.tolist())
    if min(t, h, w) < 1 or t * h * w // merge**2 != item.num_tokens:
        raise MessageError(f"video grid ({t}, {h}, {w}) does not give the item's {item.num_tokens} tokens")
    if (not isinstance(temporal_range, (tuple, list)) or len(temporal_range) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in temporal_range)):
        raise MessageError(f"a temporal range must be two integers (start, end), got {temporal_range!r}")
    start, end = temporal_range
    if not 0 <= start < end <= t:
        raise MessageError(f"temporal range ({start}, {end}) is not within the video's {t} temporal patches")
    got = data["pixel_values_videos"].shape[0]
    if got != (end - start) * h * w:
        raise MessageError(f"video chunk ({start}, {end}) carries {got} pixel rows, expected "
                           f"{(end - start) * h * w} ({end - start} patches of {h}x{w})")
    return torch.tensor([end - start, h, w], dtype=torch.int64), (end - start) * h * w // merge**2
