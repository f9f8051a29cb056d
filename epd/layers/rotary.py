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


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE (Qwen2-VL / Qwen2.5-VL): each of the head_dim / 2 rotary frequencies
    follows one of three position rows, by ``mrope_section`` (e.g. [16, 24, 24]: the first 16
    frequencies time, the next 24 height, the last 24 width; both rotate-half halves alike).

    positions: [3, num_tokens] int64 (rows time, height, width; ``epd.models.mrope``) or
    [num_tokens] (all three rows equal, as for text and every decoded token: then the same
    as :class:`RotaryEmbedding`); q / k as there. cos/sin are computed per step from the
    positions (fp32), not looked up in a table: a video's time ids may run past the
    context length (sparse samples of a long video), and must not index out of a table.
    Source: transformers ``Qwen2_5_VLRotaryEmbedding`` (its ``mrope_section`` split).

    Raises:
        ValueError: ``mrope_section`` does not sum to head_dim / 2, or a rope_type other than default.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int,
                 mrope_section: list[int]) -> None:
        super().__init__()
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
        rope_type = _rope_parameters(config).get("rope_type", "default")
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"M-RoPE with rope_type {rope_type!r} is not supported")
        self.register_buffer("inv_freq", default_inv_freq(config, head_dim), persistent=False)
        row = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(mrope_section)])
        self.register_buffer("row", row, persistent=False)  # [head_dim / 2]: each frequency's position row

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        pos = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(3, -1)
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq  # [3, T, head_dim / 2]
        freqs = freqs.gather(0, self.row.view(1, 1, -1).expand(1, pos.shape[1], -1))[0]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, head_dim]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        rot = RotaryEmbedding._rotate_half
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin
