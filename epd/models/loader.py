"""Load safetensors checkpoints into epd models, each rank taking its TP shard."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


# Where multimodal checkpoints keep their LM half (transformers 4.x layout and
# transformers 5 layout), and the tower/projector prefixes the LM skips.
_LM_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                ("language_model.lm_head.", "lm_head."))
_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.", "audio_tower.", "model.audio_tower.",
                   "multi_modal_projector.", "model.multi_modal_projector.", "visual.", "model.visual.")


def lm_checkpoint_name(name: str) -> str | None:
    """The LM parameter name for checkpoint tensor ``name``; None for tower/projector tensors."""
    if name.startswith(_TOWER_PREFIXES):
        return None
    for old, new in _LM_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every tensor of ``model_dir/*.safetensors`` into ``model``.

    Checkpoint names are mapped through ``model.packed_modules_mapping`` onto
    fused parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

    Raises:
        ValueError: a checkpoint tensor has no parameter, or a parameter was
            not in the checkpoint (the message names it).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded_names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for ckpt_name in f.keys():
                name = lm_checkpoint_name(ckpt_name)
                if name is None or "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(ckpt_name)
                target, shard = name, None
                for ckpt_key, (fused, shard_id) in mapping.items():
                    if f".{ckpt_key}." in name:
                        target, shard = name.replace(f".{ckpt_key}.", f".{fused}."), shard_id
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {file.name} has no matching parameter")
                loader = getattr(param, "weight_loader", None)
                tensor = tensor.to(param.dtype)
                if loader is None:
                    default_weight_loader(param, tensor)
                elif shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
                loaded_names.add(target)
    if tied:
        loaded_names.add("lm_head.weight")
    missing = [n for n in params if n not in loaded_names]
    if missing:
        raise ValueError(f"parameters missing from the checkpoint in {model_dir}: {missing[:5]}")
