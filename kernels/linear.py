"""Linear layers on epd's CPU kernels, and int8 weight-only quantization.

:func:`linear` is ``F.linear`` for the model's layers: on the CPU, for the few rows of a
decode step, it runs the extension's memory-bound kernel (``csrc/linear_cpu.cpp``), which
streams the weights once per call whatever the row count (oneDNN's GEMM pays a fixed
per-call cost that dominates a 135M model's decode step); larger inputs (prefill chunks) go
to torch's GEMM. int8 weights (:func:`quantize_int8`: symmetric, one fp32 scale per output
channel, as vLLM's W8A16 and llama.cpp's q8_0 with a row-long block) are multiplied in place
by the kernel for a few rows, and dequantized to the activations' dtype for a GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epd.kernels.cpu_extension import load

#: rows up to which the CPU kernel runs a linear layer; above it, torch's GEMM (oneDNN)
#: is faster (benchmarks/README.md, "Engine speed": the crossover on this machine)
CPU_KERNEL_MAX_ROWS = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight`` [N, K] (any float dtype).

    Returns ``(qweight [N, K] int8, scale [N] fp32)`` with ``weight ~= qweight * scale[:, None]``
    and ``scale = max(|w_row|) / 127`` (an all-zero row gets scale 1)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] int8 and [N] fp32 -> [N, K] ``dtype``."""
    return (qweight.float() * scale[:, None]).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias).

    Args:
        x: ``[..., K]`` fp32 or bf16 (any float dtype off the CPU kernel's path).
        weight: ``[N, K]`` in x's dtype, or int8 with ``weight_scale`` ``[N]`` fp32.
        bias: ``[N]`` or None, added in fp32 before rounding to x's dtype on the kernel path.

    Returns:
        ``[..., N]`` in x's dtype.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (x.device.type == "cpu" and 0 < rows <= CPU_KERNEL_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16)
            and (weight.dtype == x.dtype or weight_scale is not None)):
        ext = load()
        if ext is not None:
            y = ext.linear(x.reshape(rows, x.shape[-1]), weight, bias, weight_scale)
            return y.view(*x.shape[:-1], weight.shape[0])
    if weight_scale is not None:
        weight = dequantize_int8(weight, weight_scale, x.dtype)
    return F.linear(x, weight, bias)
