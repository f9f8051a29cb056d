"""Multimodal prompt processing: media -> preprocessed tensors, item hashes, placeholders.

Runs where tokenization runs (the API process, or ``LLM`` offline). For each
media item it decodes under limits (``epd.encoders.media``), preprocesses with
the model's own transformers processor (CLIP/SigLIP image processor,
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

from epd.encoders.media import MediaLimits, decode_audio, decode_image, normalize_audio, normalize_image
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

    LLaVA: {"image": "embed"}; Qwen2-Audio: {"audio": "embed"} (or "transcribe"
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
        return {"image": "embed"} | ({"audio": "transcribe"} if audio_mode == "transcribe" else {})
    if model_type == "qwen2_audio":
        return {"audio": "transcribe" if audio_mode == "transcribe" else "embed"}
    if audio_mode == "embed":
        raise ValueError(f"audio_mode='embed' needs an audio tower; {model_type or 'this'} model has none")
    return {"audio": "transcribe"}


class MultiModalProcessor:
    """Turns ``{"image": [...], "audio": [...]}`` into items and placeholder spans.

    Accepted inputs: images as ``PIL.Image`` or encoded bytes; audio as encoded
    bytes or ``(samples, sample_rate)`` with samples ``[n]`` or ``[n, channels]``.

    Raises (from ``process``):
        InvalidRequestError: the model does not take that modality, or
            placeholders and items do not match.
        epd.encoders.media.MediaError: undecodable or over-limit media.
    """

    def __init__(self, model_dir: str | Path, config: PretrainedConfig, *,
                 limits: MediaLimits = MediaLimits(), background: tuple[int, int, int] = (255, 255, 255),
                 max_items_per_prompt: int = 16, audio_mode: str = "auto") -> None:
        self.model_dir = str(model_dir)
        self.config = config
        self.limits = limits
        self.background = tuple(background)
        self.max_items_per_prompt = max_items_per_prompt
        self.modalities = model_modalities(config, audio_mode)
        self.image_processor = None
        self.feature_extractor = None
        self.placeholder_ids: dict[str, int] = {}
        if "image" in self.modalities:
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
            self.placeholder_ids["image"] = config.image_token_id
            self._image_tokens = self._tokens_per_image(config)
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

    # ---- items ----------------------------------------------------------
    def image_item(self, image: Image.Image | bytes) -> MediaItem:
        if "image" not in self.modalities:
            raise InvalidRequestError("this model does not accept images: send text (or audio) only",
                                      "multi_modal_data")
        if isinstance(image, (bytes, bytearray, memoryview)):
            img = decode_image(bytes(image), limits=self.limits, background=self.background)
        elif isinstance(image, Image.Image):
            img = normalize_image(image, limits=self.limits, background=self.background)
        else:
            raise InvalidRequestError(f"an image must be a PIL.Image or encoded bytes, got {type(image).__name__}",
                                      "multi_modal_data")
        pixel_values = self.image_processor(images=[img], return_tensors="pt")["pixel_values"][0].float()
        params = {"processor": self.image_processor.to_dict(), "background": self.background}
        return MediaItem("image", item_hash("image", params, pixel_values), {"pixel_values": pixel_values},
                         self._image_tokens)

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
        for key in mm_data:
            if key not in ("image", "audio"):
                raise InvalidRequestError(f"unknown modality {key!r}: use 'image' or 'audio'", "multi_modal_data")
        images = mm_data.get("image") or []
        audios = mm_data.get("audio") or []
        images = images if isinstance(images, list) else [images]
        audios = audios if isinstance(audios, list) else [audios]
        if len(images) + len(audios) > self.max_items_per_prompt:
            raise InvalidRequestError(f"{len(images) + len(audios)} media items in one prompt; "
                                      f"at most {self.max_items_per_prompt} are allowed", "multi_modal_data")
        if images and "image" not in self.modalities:
            raise InvalidRequestError("this model does not accept images: send text (or audio) only",
                                      "multi_modal_data")
        if audios and "audio" not in self.modalities:
            raise InvalidRequestError("this model does not accept audio: send text (or images) only",
                                      "multi_modal_data")
        items = {"image": [self.image_item(i) for i in images], "audio": [self.audio_item(a) for a in audios]}
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
            placeholders.append(Placeholder(len(out_ids), item.num_tokens, item.item_hash))
            ordered.append(item)
            out_ids.extend([t] * item.num_tokens)
        if items["audio"] and self.modalities.get("audio") == "transcribe":
            raise InvalidRequestError(f"this model hears audio through its speech front end: put "
                                      f"{AUDIO_PLACEHOLDER!r} in the prompt text once per clip", "prompt")
        return ProcessedPrompt(out_ids, placeholders, ordered)
