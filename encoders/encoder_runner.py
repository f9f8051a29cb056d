"""E-pool compute: media items -> embeddings (or transcripts), through the encoder cache."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from epd.encoders.encoder_cache import EncoderCache
from epd.encoders.processor import model_modalities
from epd.multimodal import MediaItem


class EncoderRunner:
    """Runs the towers of one model.

    ``encode(items)`` returns one embedding ``[item.num_tokens, text_hidden]``
    per item (images are batched through the vision tower; audio windows
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
            from epd.encoders.towers import VisionTower

            self._vision = VisionTower(self.model_dir, self.config, self.dtype, self.device)
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

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        results: list[torch.Tensor | None] = [self.cache.get(it.item_hash) for it in items]
        todo = [i for i, r in enumerate(results) if r is None]
        images = [i for i in todo if items[i].modality == "image"]
        audios = [i for i in todo if items[i].modality == "audio"]
        if images:
            pixels = torch.stack([items[i].data["pixel_values"] for i in images])
            for i, emb in zip(images, self.vision.encode(pixels)):
                results[i] = emb
        for i in audios:
            data = items[i].data
            windows = self.audio.encode(data["input_features"], data["num_frames"])
            results[i] = torch.cat(windows)
        for i in todo:
            emb = results[i]
            if emb.shape[0] != items[i].num_tokens:
                raise RuntimeError(f"{items[i].modality} encoder produced {emb.shape[0]} rows, "
                                   f"expected {items[i].num_tokens}")
            self.cache.put(items[i].item_hash, emb.detach().contiguous())
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
