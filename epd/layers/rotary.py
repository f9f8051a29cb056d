"""Rotary position embedding (Su et al. 2021, RoFormer), neox/rotate-half layout.

Inverse frequencies and the attention scaling come from transformers'
``ROPE_INIT_FUNCTIONS`` so every scaling variant of the config (linear,
llama3, yarn, longrope, dynamic up to ``max_position_embeddings``) matches the
reference implementation exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


def default_inv_freq(config: PretrainedConfig, head_dim: int) -> torch.Tensor:
    base = _rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k.

    positions: [num_tokens] int64; q: [num_tokens, num_heads, head_dim];
    k: [num_tokens, num_kv_heads, head_dim]. cos/sin are precomputed in fp32 for
    ``max_positions`` positions.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        rope_type = _rope_parameters(config).get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = default_inv_freq(config, head_dim), 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
