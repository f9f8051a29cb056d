"""Multimodal prompt processing: media -> preprocessed tensors, item hashes, placeholders.

Runs where tokenization runs (the API process, or ``LLM`` offline). For each
media item it decodes under limits (``epd.encoders.image``, ``epd.encoders.audio``),
preprocesses with the model's own transformers processor (CLIP/SigLIP image processor,
``WhisperFeatureExtractor``), hashes the result together with the
preprocessing parameters (sha256, full digest), and expands the item's single
placeholder token in the prompt to exactly as many placeholder tokens as the
tower will produce embedding rows.

Placeholder policy: the prompt must contain exactly one placeholder token per
item, in order. A prompt whose text spells out placeholder tokens without
matching items (or items without placeholders) is rejected with
``InvalidRequestError`` — never silently mis-assigned.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import PretrainedConfig

from epd.encoders.audio import decode_audio, normalize_audio
from epd.encoders.image import decode_image, header_size, normalize_image
from epd.encoders.media_limits import MediaLimits, MediaTooLargeError
from epd.encoders.patch_grid import PatchGrid
from epd.encoders.video import (
    DecodedVideo,
    VideoFrame,
    VideoSampling,
    decode_video,
    normalize_video,
    probe_video,
    sample_size,
    sampled_frames,
)
from epd.errors import InvalidRequestError
from epd.multimodal import MediaItem, Placeholder

WHISPER_WINDOW_S = 30.0
# Where a clip's transcript goes in a text prompt for a text-only LM (audio_mode "transcribe").
AUDIO_PLACEHOLDER = "<|audio|>"


@dataclass(slots=True)
class ProcessedPrompt:
    prompt_token_ids: list[int]
    placeholders: list[Placeholder]
    items: list[MediaItem]


def item_hash(modality: str, params: dict, *tensors: torch.Tensor) -> str:
    """sha256 over modality, preprocessing parameters (canonical JSON) and tensor bytes."""
    h = hashlib.sha256()
    h.update(modality.encode())
    h.update(json.dumps(params, sort_keys=True, default=str).encode())
    for t in tensors:
        t = t.contiguous().cpu()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


AUDIO_MODES = ("auto", "transcribe", "embed")


def model_modalities(config: PretrainedConfig, audio_mode: str = "auto") -> dict[str, str]:
    """modality -> how it is served.

    LLaVA: {"image": "embed", "video": "frames"} (a video's sampled frames go in as
    images, ``epd.encoders.video``); Qwen2-VL / Qwen2.5-VL: {"image": "embed", "video":
    "embed"} (native resolution; a video as temporal patches); Qwen2-Audio: {"audio": "embed"} (or "transcribe"
    when asked); text-only LMs: {"audio": "transcribe"} (Whisper tiny.en speech
    front end; ``audio_mode="embed"`` is refused: they have no audio tower).

    Raises:
        ValueError: unknown ``audio_mode`` or "embed" for a model without an audio tower.
    """
    if audio_mode not in AUDIO_MODES:
        raise ValueError(f"audio_mode must be one of {AUDIO_MODES}, got {audio_mode!r}")
    model_type = getattr(config, "model_type", "")
    if model_type == "llava":
        if audio_mode == "embed":
            raise ValueError("audio_mode='embed' needs an audio tower; this LLaVA model has none")
        return {"image": "embed", "video": "frames"} | ({"audio": "transcribe"} if audio_mode == "transcribe" else {})
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        if audio_mode == "embed":
            raise ValueError(f"audio_mode='embed' needs an audio tower; this {model_type} model has none")
        return {"image": "embed", "video": "embed"} | ({"audio": "transcribe"} if audio_mode == "transcribe" else {})
    if model_type == "qwen2_audio":
        return {"audio": "transcribe" if audio_mode == "transcribe" else "embed"}
    if audio_mode == "embed":
        raise ValueError(f"audio_mode='embed' needs an audio tower; {model_type or 'this'} model has none")
    return {"audio": "transcribe"}


class MultiModalProcessor:
    """Turns ``{"image": [...], "audio": [...]}`` into items and placeholder spans.

    Accepted inputs: images as ``PIL.Image`` or encoded bytes (or a video's
    :class:`~epd.encoders.video.VideoFrame`, from :meth:`video_frames`); audio as encoded
    bytes or ``(samples, sample_rate)`` with samples ``[n]`` or ``[n, channels]``; video
    (:meth:`video_frames`) as encoded bytes or a ``[T, H, W, 3]`` uint8 frame array.
    ``video_fps``: frames sampled per second of video when a request names no fps.

    Raises (from ``process``):
        InvalidRequestError: the model does not take that modality, or
            placeholders and items do not match.
        epd.encoders.media_limits.MediaError: undecodable or over-limit media.
    """

    def __init__(self, model_dir: str | Path, config: PretrainedConfig, *,
                 limits: MediaLimits = MediaLimits(), background: tuple[int, int, int] = (255, 255, 255),
                 max_items_per_prompt: int = 16, audio_mode: str = "auto", video_fps: float = 2.0) -> None:
        self.model_dir = str(model_dir)
        self.video_fps = VideoSampling(fps=video_fps, max_frames=limits.max_video_frames).fps
        self.config = config
        self.limits = limits
        self.background = tuple(background)
        self.max_items_per_prompt = max_items_per_prompt
        self.modalities = model_modalities(config, audio_mode)
        self.image_processor = None
        self.feature_extractor = None
        self.placeholder_ids: dict[str, int] = {}
        self.native_resolution = False
        self.patch_grid: PatchGrid | None = None  # native resolution: what an item's pixels weigh
        if "image" in self.modalities:
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
            self.placeholder_ids["image"] = config.image_token_id
            # Qwen2-VL / Qwen2.5-VL: native resolution, tokens per image from its grid.
            self.native_resolution = config.model_type in ("qwen2_vl", "qwen2_5_vl")
            if self.native_resolution:
                self.patch_grid = PatchGrid.of(self.image_processor)
            self._image_tokens = None if self.native_resolution else self._tokens_per_image(config)
        if self.modalities.get("video") == "embed":
            self.placeholder_ids["video"] = config.video_token_id
        if self.modalities.get("audio") == "embed":
            from transformers import AutoFeatureExtractor

            self.feature_extractor = AutoFeatureExtractor.from_pretrained(self.model_dir)
            self.placeholder_ids["audio"] = config.audio_token_id
        self.audio_sample_rate = (self.feature_extractor.sampling_rate if self.feature_extractor else 16000)

    @staticmethod
    def _tokens_per_image(config: PretrainedConfig) -> int:
        vc = config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        if vc.model_type == "clip_vision_model" and config.vision_feature_select_strategy == "full":
            n += 1
        return n

    # ---- size of an item, before processing ------------------------------------------
    def fit_image(self, width: int, height: int, where: str = "image") -> int | None:
        """The ``max_pixels`` a native-resolution ``width`` x ``height`` image is processed
        with so that its ``pixel_values`` fit ``limits.max_item_bytes`` (None: the processor's
        own; a larger image is scaled down further, aspect kept, as the processor's own
        ``max_pixels`` scales it). ``where`` names the item in errors.

        Raises:
            MediaTooLargeError: not even the smallest size fits; UnsupportedMediaError: an
                aspect ratio the processor refuses (over 200).
        """
        grid, limit = self.patch_grid, self.limits.max_item_bytes
        if grid is None or grid.image_bytes(width, height) <= limit:
            return None
        cap = grid.max_pixels_within(limit)
        if cap < (grid.patch * grid.merge) ** 2 or grid.image_bytes(width, height, cap) > limit:
            raise MediaTooLargeError(f"{where}: the image's pixel_values would be {grid.image_bytes(width, height)} "
                                     f"bytes; the limit is {limit} bytes (--max-mm-item-mb)", modality="image")
        return cap

    def check_image(self, data: bytes, where: str = "image") -> None:
        """:meth:`fit_image` from the size an encoded image's header declares (no pixel is
        decoded; an image whose header says nothing is checked again once decoded)."""
        size = header_size(bytes(data)) if self.patch_grid is not None else None
        if size is not None:
            self.fit_image(*size, where)

    def fit_video(self, video, sampling: VideoSampling, pinned: bool = False, where: str = "video"
                  ) -> VideoSampling:
        """``sampling`` of a native-resolution video (encoded bytes) such that its
        ``pixel_values_videos`` fit ``limits.max_item_bytes``, from its header (size, frame
        count) before any frame is decoded: as given when they fit; else, unless ``pinned``
        (the request named its frame count), with the most frames (a multiple of the
        temporal patch) that fit. ``where`` names the item in errors.

        Raises:
            MediaTooLargeError: over the limit with ``pinned``, or even at the fewest frames.
            epd.encoders.media_limits.MediaError: as :func:`epd.encoders.video.probe_video`.
        """
        grid, limit = self.patch_grid, self.limits.max_item_bytes
        if grid is None or self.modalities.get("video") != "embed" or not isinstance(
                video, (bytes, bytearray, memoryview)):
            return sampling
        header = probe_video(bytes(video), limits=self.limits)
        per_frame = grid.frame_bytes(*sample_size(header.width, header.height, self.limits))
        tp = grid.temporal_patch
        frames = sampled_frames(header, sampling)
        need = -(-frames // tp) * tp * per_frame
        if need <= limit:
            return sampling
        fit = limit // per_frame // tp * tp
        if pinned or fit < 1:
            hint = (f"; ask for at most {fit} frames (media_io_kwargs.video.num_frames)" if fit >= 1 else "")
            raise MediaTooLargeError(f"{where}: {frames} frames of this {header.width}x{header.height} video make "
                                     f"{need} bytes of pixel_values_videos; the limit is {limit} bytes "
                                     f"(--max-mm-item-mb){hint}", modality="video")
        return VideoSampling(fps=sampling.fps, max_frames=fit)

    # ---- items ----------------------------------------------------------
    def image_item(self, image: Image.Image | bytes | VideoFrame, where: str = "image") -> MediaItem:
        if "image" not in self.modalities:
            raise InvalidRequestError("this model does not accept images: send text (or audio) only",
                                      "multi_modal_data")
        params = {"processor": self.image_processor.to_dict(), "background": self.background}
        if isinstance(image, VideoFrame):
            # A video frame is keyed by its video (bytes + sampling) and position, so the same
            # bytes sampled at another fps never shares a cache entry or KV with these frames.
            params["video"] = {"digest": image.video_digest, "frame": image.index}
            img = Image.fromarray(image.pixels)  # [H, W, 3] uint8 -> RGB
        elif isinstance(image, (bytes, bytearray, memoryview)):
            img = decode_image(bytes(image), limits=self.limits, background=self.background)
        elif isinstance(image, Image.Image):
            img = normalize_image(image, limits=self.limits, background=self.background)
        else:
            raise InvalidRequestError(f"an image must be a PIL.Image or encoded bytes, got {type(image).__name__}",
                                      "multi_modal_data")
        if self.native_resolution:
            # The processor resizes to a multiple of patch * merge pixels, between its
            # size["shortest_edge"] (min_pixels) and size["longest_edge"] (max_pixels),
            # lowered to what fits max_item_bytes.
            cap = self.fit_image(img.width, img.height, where)
            size = {} if cap is None else {"size": {"shortest_edge": min(self.patch_grid.min_pixels, cap),
                                                    "longest_edge": cap}}
            out = self.image_processor(images=[img], return_tensors="pt", **size)
            pixel_values, grid = out["pixel_values"].float(), out["image_grid_thw"][0].long()
            merge = self.config.vision_config.spatial_merge_size
            return MediaItem("image", item_hash("image", params, pixel_values, grid),
                             {"pixel_values": pixel_values, "image_grid_thw": grid}, int(grid.prod()) // merge**2)
        pixel_values = self.image_processor(images=[img], return_tensors="pt")["pixel_values"][0].float()
        return MediaItem("image", item_hash("image", params, pixel_values), {"pixel_values": pixel_values},
                         self._image_tokens)

    def video_sampling(self, fps: float | None = None, num_frames: int | None = None) -> VideoSampling:
        """The sampling of a request: ``fps`` (default ``video_fps``) and at most ``num_frames``
        frames (default and ceiling: ``limits.max_video_frames``).

        Raises:
            InvalidRequestError: ``fps`` not positive, or ``num_frames`` outside 1..max_video_frames.
        """
        ceiling = self.limits.max_video_frames
        if num_frames is not None and (isinstance(num_frames, bool) or not isinstance(num_frames, int)
                                       or not 1 <= num_frames <= ceiling):
            raise InvalidRequestError(f"num_frames must be an integer from 1 to {ceiling} (--max-video-frames), "
                                      f"got {num_frames!r}", "media_io_kwargs.video.num_frames")
        try:
            return VideoSampling(fps=self.video_fps if fps is None else fps, max_frames=num_frames or ceiling)
        except ValueError as e:
            raise InvalidRequestError(str(e), "media_io_kwargs.video.fps") from None

    def decode_video(self, video, sampling: VideoSampling | None = None) -> DecodedVideo:
        """``video`` (encoded bytes, or a ``[T, H, W, 3]`` uint8 array of frames) sampled as
        ``sampling`` (default: :meth:`video_sampling`).

        Raises:
            InvalidRequestError: the model takes no video, or ``video`` is neither.
            epd.encoders.media_limits.MediaError: undecodable or over a limit.
        """
        if "video" not in self.modalities:
            raise InvalidRequestError("this model does not accept video", "multi_modal_data")
        sampling = sampling or self.video_sampling()
        if isinstance(video, (bytes, bytearray, memoryview)):
            return decode_video(bytes(video), sampling=sampling, limits=self.limits)
        if isinstance(video, (np.ndarray, torch.Tensor)):
            return normalize_video(video, sampling=sampling, limits=self.limits)
        raise InvalidRequestError(f"a video must be encoded bytes or a [T, H, W, 3] uint8 array, got "
                                  f"{type(video).__name__}", "multi_modal_data")

    def video_item(self, video, sampling: VideoSampling | None = None) -> MediaItem:
        """A video as one item of temporal patches (Qwen2-VL / Qwen2.5-VL).

        The sampled frames (padded to a multiple of ``temporal_patch_size`` by repeating the
        last, as transformers' ``Qwen2VLVideoProcessor.patchify``) are resized and normalized
        one by one by the model's image processor (its min/max pixels: a checkpoint's video
        size settings are not read yet), and each patch's ``temporal_patch_size`` frames are
        stacked in its flat layout ``[C, temporal_patch, patch, patch]``, the video
        processor's. data: ``pixel_values_videos`` [t*h*w, C*temporal_patch*patch**2] fp32,
        ``video_grid_thw`` [3] int64, ``second_per_grid_t`` [1] fp32 (seconds per temporal
        patch: temporal_patch_size x the sampled frames' spacing); num_tokens = t*h*w/merge**2.

        ``video`` may also be a ``(video, VideoSampling)`` pair, the sampling winning over
        ``sampling``.

        Raises: as :meth:`decode_video`; InvalidRequestError for a model without video patches.
        """
        if self.modalities.get("video") != "embed":
            raise InvalidRequestError("this model takes video as frames: see video_frames", "multi_modal_data")
        if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], VideoSampling):
            video, sampling = video  # (video, its request's sampling), as the chat renderer passes it
        if isinstance(video, (bytes, bytearray, memoryview)):
            sampling = self.fit_video(video, sampling or self.video_sampling())
        decoded = self.decode_video(video, sampling)
        vc = self.config.vision_config
        tp, merge = vc.temporal_patch_size, vc.spatial_merge_size
        frames = list(decoded.frames)
        frames += [frames[-1]] * (-len(frames) % tp)
        h, w = frames[0].shape[:2]
        need = len(frames) * self.patch_grid.frame_bytes(w, h)
        if need > self.limits.max_item_bytes:  # frames given as an array, or a header that lied
            raise MediaTooLargeError(f"{len(frames)} frames of {w}x{h} make {need} bytes of pixel_values_videos; the "
                                     f"limit is {self.limits.max_item_bytes} bytes (--max-mm-item-mb)",
                                     modality="video")
        out = self.image_processor(images=[Image.fromarray(f) for f in frames], return_tensors="pt")
        grids = out["image_grid_thw"]
        if not bool((grids == grids[0]).all()):  # pragma: no cover - frames of one video share a size
            raise RuntimeError(f"frames of one video resized to different grids: {grids.tolist()}")
        _, gh, gw = grids[0].tolist()
        n, c, p = gh * gw, 3, vc.patch_size
        # the image processor repeats each frame over the temporal axis; keep one copy per frame
        per_frame = out["pixel_values"].float().reshape(len(frames), n, c, tp, p, p)[:, :, :, 0]
        gt = len(frames) // tp
        patches = per_frame.reshape(gt, tp, n, c, p, p).permute(0, 2, 3, 1, 4, 5).reshape(gt * n, c * tp * p * p)
        grid = torch.tensor([gt, gh, gw], dtype=torch.int64)
        times = decoded.timestamps_s
        spacing = float(np.diff(times).mean()) if len(times) > 1 else 1.0 / decoded.sampling.fps
        second = torch.tensor([tp * spacing], dtype=torch.float32)
        params = {"processor": self.image_processor.to_dict(), "video": decoded.digest}
        return MediaItem("video", item_hash("video", params, patches, grid, second),
                         {"pixel_values_videos": patches.contiguous(), "video_grid_thw": grid,
                          "second_per_grid_t": second}, gt * gh * gw // merge**2)

    def video_frames(self, video, sampling: VideoSampling | None = None) -> list[VideoFrame]:
        """A video as the image items a frames-as-images model (LLaVA) takes: its sampled
        frames in time order, each keyed by the video's digest (bytes + sampling) and index.
        Raises as :meth:`decode_video`."""
        return self.decode_video(video, sampling).as_images()

    def _audio_samples(self, audio) -> np.ndarray:
        sr = self.audio_sample_rate
        if isinstance(audio, (bytes, bytearray, memoryview)):
            return decode_audio(bytes(audio), target_sample_rate=sr, limits=self.limits)
        if isinstance(audio, tuple) and len(audio) == 2:
            samples, rate = audio
            return normalize_audio(np.asarray(samples), int(rate), target_sample_rate=sr, limits=self.limits)
        raise InvalidRequestError("audio must be encoded bytes or a (samples, sample_rate) tuple",
                                  "multi_modal_data")

    def audio_item(self, audio) -> MediaItem:
        samples = self._audio_samples(audio)
        if self.modalities.get("audio") == "transcribe":
            wave = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
            return MediaItem("audio", item_hash("audio", {"mode": "transcribe", "sr": 16000}, wave),
                             {"audio": wave}, 0)
        fe = self.feature_extractor
        window = int(WHISPER_WINDOW_S * fe.sampling_rate)
        chunks = [samples[i:i + window] for i in range(0, len(samples), window)] or [samples]
        feats = fe(chunks, sampling_rate=fe.sampling_rate, return_attention_mask=True, padding="max_length",
                   return_tensors="pt")
        input_features = feats["input_features"].float()
        num_frames = feats["attention_mask"].sum(-1).long()
        from epd.encoders.towers import AudioTower

        num_tokens = int(AudioTower.output_lengths(num_frames)[1].sum())
        params = {"processor": fe.to_dict(), "window_s": WHISPER_WINDOW_S}
        return MediaItem("audio", item_hash("audio", params, input_features, num_frames),
                         {"input_features": input_features, "num_frames": num_frames}, num_tokens)

    # ---- prompts --------------------------------------------------------
    def process(self, prompt_token_ids: list[int], mm_data: dict | None) -> ProcessedPrompt:
        """Build items for ``mm_data`` and expand their placeholders in the prompt."""
        mm_data = dict(mm_data or {})
        video_embed = self.modalities.get("video") == "embed"
        for key in mm_data:
            if key not in ("image", "audio") and not (key == "video" and video_embed):
                hint = (" (a video goes in as its frames: see video_frames)" if key == "video" else "")
                raise InvalidRequestError(f"unknown modality {key!r}: use 'image' or 'audio'{hint}",
                                          "multi_modal_data")
        images = mm_data.get("image") or []
        audios = mm_data.get("audio") or []
        images = images if isinstance(images, list) else [images]
        audios = audios if isinstance(audios, list) else [audios]
        videos = mm_data.get("video") or []
        videos = videos if isinstance(videos, list) else [videos]
        # A video counts once (its frames are bounded by max_video_frames).
        count = (sum(1 for i in images if not isinstance(i, VideoFrame) or i.index == 0) + len(audios)
                 + len(videos))
        if count > self.max_items_per_prompt:
            raise InvalidRequestError(f"{count} media items in one prompt; "
                                      f"at most {self.max_items_per_prompt} are allowed", "multi_modal_data")
        if images and "image" not in self.modalities:
            raise InvalidRequestError("this model does not accept images: send text (or audio) only",
                                      "multi_modal_data")
        if audios and "audio" not in self.modalities:
            raise InvalidRequestError("this model does not accept audio: send text (or images) only",
                                      "multi_modal_data")
        items = {"image": [self.image_item(i) for i in images], "audio": [self.audio_item(a) for a in audios],
                 "video": [self.video_item(v) for v in videos]}
        # Count placeholders of every modality the model knows, even with no items:
        # placeholder text with no matching item is rejected.
        for modality, token_id in self.placeholder_ids.items():
            found = sum(1 for t in prompt_token_ids if t == token_id)
            if found != len(items[modality]):
                raise InvalidRequestError(
                    f"the prompt has {found} {modality} placeholder token(s) but {len(items[modality])} "
                    f"{modality} item(s) were given: put exactly one placeholder per item "
                    f"(placeholder text without media is not allowed)", "prompt")
        out_ids: list[int] = []
        placeholders: list[Placeholder] = []
        ordered: list[MediaItem] = []
        next_item = {m: 0 for m in self.placeholder_ids}
        by_id = {v: k for k, v in self.placeholder_ids.items()}
        for t in prompt_token_ids:
            modality = by_id.get(t)
            if modality is None:
                out_ids.append(t)
                continue
            item = items[modality][next_item[modality]]
            next_item[modality] += 1
            grid = item.data.get("image_grid_thw", item.data.get("video_grid_thw"))
            second = item.data.get("second_per_grid_t")
            interval = None  # Qwen2-VL (1.0): time ids step by one temporal patch, whatever the fps
            if second is not None and self.config.model_type == "qwen2_5_vl":
                from epd.models.mrope import time_interval  # (epd.models pulls in the LM code)

                interval = time_interval(float(second.reshape(-1)[0]), self.config.vision_config.tokens_per_second)
            placeholders.append(Placeholder(len(out_ids), item.num_tokens, item.item_hash,
                                            None if grid is None else tuple(int(x) for x in grid.tolist()), interval))
            ordered.append(item)
            out_ids.extend([t] * item.num_tokens)
        if items["audio"] and self.modalities.get("audio") == "transcribe":
            raise InvalidRequestError(f"this model hears audio through its speech front end: put "
                                      f"{AUDIO_PLACEHOLDER!r} in the prompt text once per clip", "prompt")
        return ProcessedPrompt(out_ids, placeholders, ordered)
