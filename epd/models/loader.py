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
            for name in f.keys():
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(name)
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
