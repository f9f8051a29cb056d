"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like transformers' LlamaRMSNorm."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps); x: [..., hidden]. With ``residual``,
    returns (norm(x + residual), x + residual) — the pre-norm residual stream."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual
