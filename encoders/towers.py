"""Encoder towers + projectors: media tensors -> LM input embeddings.

The towers are transformers' own modules (CLIP / SigLIP vision models, the
Qwen2-VL / Qwen2.5-VL vision transformer with its patch merger, the Qwen2-Audio
Whisper-style encoder) and the projectors transformers' own ``multi_modal_projector``; epd only
loads them and selects features exactly as
``LlavaModel.get_image_features`` and ``Qwen2AudioModel.forward`` do, so the
embeddings equal the reference's. The LM half of these checkpoints runs in
epd's own engine, so it is not loaded here: the model is instantiated from the
config with ``text_config.num_hidden_layers = 0`` and transformers'
``from_pretrained`` (with its checkpoint-key conversions) fills the tower and
projector; the skipped decoder layers are reported as unused keys.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

logger = logging.getLogger(__name__)


def _load_without_lm(model_cls, model_dir: str | Path, config: PretrainedConfig, dtype: torch.dtype):
    from transformers.utils import logging as hf_logging

    cfg = copy.deepcopy(config)
    cfg.get_text_config().num_hidden_layers = 0
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the LM layers are unused keys on purpose
    try:
        model = model_cls.from_pretrained(str(model_dir), config=cfg, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


class VisionTower:
    """LLaVA image encoder: ``pixel_values [n, 3, H, W]`` (fp32) -> a list of n
    embeddings ``[tokens_per_image, text_hidden]``.

    Feature layer (``vision_feature_layer``, int or list) and select strategy
    (``default`` drops CLS, ``full`` keeps it) come from the config.
    Source: transformers ``LlavaModel.get_image_features``.
    """

    def __init__(self, model_dir: str | Path, config: PretrainedConfig | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import LlavaForConditionalGeneration

        self.config = config or AutoConfig.from_pretrained(str(model_dir))
        full = _load_without_lm(LlavaForConditionalGeneration, model_dir, self.config, dtype)
        self.tower = full.model.vision_tower.to(device)
        self.projector = full.model.multi_modal_projector.to(device)
        self.layer = self.config.vision_feature_layer
        self.strategy = self.config.vision_feature_select_strategy
        self.device, self.dtype = torch.device(device), dtype

    def num_tokens(self) -> int:
        """Embedding rows per image (fixed-resolution LLaVA)."""
        vc = self.config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        has_cls = vc.model_type == "clip_vision_model"
        return n + (1 if has_cls and self.strategy == "full" else 0)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        out = self.tower(pixel_values.to(self.device, self.dtype), output_hidden_states=True, return_dict=True)
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        feats = [out.hidden_states[i] for i in layers]
        if self.strategy == "default":
            feats = [f[:, 1:] for f in feats]
        emb = self.projector(torch.cat(feats, dim=-1))
        return list(emb)


#: model_type -> the transformers class whose ``model.visual`` is the tower
QWEN_VL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


class QwenVisionTower:
    """Qwen2-VL / Qwen2.5-VL vision encoder (native resolution): the patches of n images,
    ``pixel_values`` [sum_i t_i*h_i*w_i, C * temporal_patch * patch**2] fp32 (the processor's
    flat layout) with their ``grid_thw`` [n, 3] int64 -> a list of n embeddings
    ``[t_i * h_i * w_i / merge**2, text_hidden]`` (Qwen2.5-VL: window attention in all but
    the full-attention blocks, then the 2x2 patch merger into the LM's width).
    Source: transformers ``Qwen2_5_VLModel.get_image_features`` (``visual(...).pooler_output``).
    """

    def __init__(self, model_dir: str | Path, config: PretrainedConfig | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        import transformers

        self.config = config or AutoConfig.from_pretrained(str(model_dir))
        model_cls = getattr(transformers, QWEN_VL_CLASSES[self.config.model_type])
        full = _load_without_lm(model_cls, model_dir, self.config, dtype)
        self.visual = full.model.visual.to(device)
        self.merge = self.config.vision_config.spatial_merge_size
        self.device, self.dtype = torch.device(device), dtype

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Embedding rows per item of ``grid_thw`` [n, 3]: [n] int64."""
        return grid_thw.prod(-1) // self.merge**2

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        grid = grid_thw.to(self.device, torch.int64).reshape(-1, 3)
        out = self.visual(pixel_values.to(self.device, self.dtype), grid_thw=grid)
        return list(torch.split(out.pooler_output, self.num_tokens(grid).tolist()))


class AudioTower:
    """Qwen2-Audio encoder: ``input_features [n, mel, 3000]`` + valid frame
    counts ``[n]`` -> a list of n embeddings ``[output_len_i, text_hidden]``.

    Output length per item: ((frames - 1) // 2 + 1 - 2) // 2 + 1.
    Source: transformers ``Qwen2AudioModel.forward`` / ``Qwen2AudioEncoder``.
    """

    def __init__(self, model_dir: str | Path, config: PretrainedConfig | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import Qwen2AudioForConditionalGeneration

        self.config = config or AutoConfig.from_pretrained(str(model_dir))
        full = _load_without_lm(Qwen2AudioForConditionalGeneration, model_dir, self.config, dtype)
        self.tower = full.model.audio_tower.to(device)
        self.projector = full.model.multi_modal_projector.to(device)
        self.device, self.dtype = torch.device(device), dtype

    @staticmethod
    def output_lengths(num_frames: torch.Tensor | int):
        """(after conv, after pooling) lengths for ``num_frames`` valid mel frames."""
        conv = (num_frames - 1) // 2 + 1
        return conv, (conv - 2) // 2 + 1

    @torch.inference_mode()
    def encode(self, input_features: torch.Tensor, num_frames: torch.Tensor) -> list[torch.Tensor]:
        from transformers.masking_utils import create_bidirectional_mask

        feats = input_features.to(self.device, self.dtype)
        conv_lens, out_lens = self.output_lengths(num_frames.to(self.device))
        n, _, max_mel = feats.shape
        max_len = (max_mel - 2) // 2 + 1
        valid = (torch.arange(max_len, device=self.device)[None, :] < conv_lens[:, None]).long()
        dummy = torch.zeros((n, max_len, 1), dtype=self.dtype, device=self.device)
        mask = create_bidirectional_mask(config=self.tower.config, inputs_embeds=dummy, attention_mask=valid)
        hidden = self.tower(feats, attention_mask=mask).last_hidden_state
        emb = self.projector(hidden)
        return [emb[i, : int(out_lens[i])] for i in range(n)]
