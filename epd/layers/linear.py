"""Tensor-parallel linear layers (Megatron-LM column/row split).

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that
copies this rank's slice of a full checkpoint tensor. Source: Megatron-LM
(Shoeybi et al. 2019), vLLM ``model_executor/layers/linear.py``, nano-vllm.
"""

from __future__ import annotations

import torch
from torch import nn

from epd.distributed import all_reduce, tp_rank, tp_size
from epd.kernels.linear import PackedWeight, linear, prepare_weight


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.weight_scale: torch.Tensor | None = None  # [out] fp32 once the weight is int8
        self.packed: PackedWeight | None = None  # the CPU kernel's copy, then the only one

    def process_weights_after_loading(self, quantization: str | None) -> None:
        """Once the checkpoint is loaded (vLLM's name for the step): quantize the weight
        (``quantization="int8"``: per output channel, ``epd.kernels.linear.quantize_int8``),
        then, on the CPU, pack it for the kernel and drop the [out, in] copy."""
        w, self.weight_scale = prepare_weight(self.weight.data, quantization)
        if isinstance(w, PackedWeight):
            self.packed, w = w, w.data.new_empty(0)  # (an empty weight of the packed dtype)
        self.weight = nn.Parameter(w, requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            size = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        param.data.copy_(loaded)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks: W: [out / tp, in]; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        assert out_features % tp_size() == 0, (out_features, tp_size())
        super().__init__(in_features, out_features // tp_size(), bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed or self.weight, self.bias, self.weight_scale)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused in one matmul
    (gate|up). Shard ``i`` of the checkpoint fills rows of output ``i``."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        dst = param.data.narrow(0, offset, size)
        dst.copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v projection; heads split over ranks (KV heads too, GQA).

    Output per rank: [num_heads/tp * head_dim + 2 * num_kv_heads/tp * head_dim].
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = num_kv_heads // tp
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(_Linear):
    """Input features split over ranks: W: [out, in / tp]; the partial outputs are
    summed with an all-reduce; the bias is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        assert in_features % tp_size() == 0, (in_features, tp_size())
        super().__init__(in_features // tp_size(), out_features, bias, 1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: whole on every rank
            param.data.copy_(loaded)
        else:
            super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.packed or self.weight, None, self.weight_scale)
        if self.tp_size > 1:
            all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
