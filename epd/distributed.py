"""Tensor-parallel process group helpers (torch.distributed: gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over TP ranks in place (no-op at TP=1)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's ``x`` along the last dim on rank 0; None elsewhere.

    x: [..., n_local] -> [..., n_local * tp_size] on rank 0.
    """
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None
