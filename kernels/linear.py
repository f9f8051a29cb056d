"""Linear layers on epd's CPU kernel, and int8 weight-only quantization.

On the CPU, once its weights are loaded, a linear layer packs them into the layout of the
extension's GEMM (``csrc/linear_cpu.cpp``: column blocks of 16 output channels, k pairs
interleaved for AVX512-BF16) and keeps only the packed copy (:class:`PackedWeight`). The
kernel streams each weight once per call whatever the row count, so a decode step's few
rows run at the memory bound, where oneDNN's GEMM pays a fixed per-call cost that
dominates a small model's step; it is as fast as oneDNN on prefill chunks too
(benchmarks/README.md, "Engine speed"). int8 weights (:func:`quantize_int8`: symmetric,
one fp32 scale per output channel, as vLLM's W8A16 and llama.cpp's q8_0 with a row-long
block) are widened in registers. Off the CPU, or where the extension is not built, the
layer keeps its [N, K] weight for ``F.linear`` (int8 dequantized per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epd.kernels.cpu_extension import load


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear layer's weight in the CPU kernel's layout.

    data: [ceil(N / 16), ceil(K / 2), 16, 2] bf16 or int8, or [ceil(N / 16), K, 16] fp32,
    zero-padded; out_features: N; in_features: K; scale: [N] fp32 for int8 (else None)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    scale: torch.Tensor | None = None


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


def pack_weight(weight: torch.Tensor, scale: torch.Tensor | None = None,
                x_dtype: torch.dtype | None = None) -> PackedWeight | None:
    """``weight`` [N, K] (fp32, bf16, or int8 with ``scale`` [N]) packed for the CPU
    kernel, or None where it does not apply: not on the CPU, another dtype, activations
    (``x_dtype``, when given) other than fp32 / bf16 (an fp16 model's int8
    weights are dequantized per call instead), or no extension."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16, torch.int8)
            or (x_dtype is not None and x_dtype not in (torch.float32, torch.bfloat16))):
        return None
    ext = load()
    if ext is None:
        return None
    return PackedWeight(ext.pack_linear_weight(weight), weight.shape[0], weight.shape[1], scale)


def prepare_weight(weight: torch.Tensor, quantization: str | None) -> tuple[torch.Tensor | PackedWeight,
                                                                          torch.Tensor | None]:
    """A loaded ``weight`` [N, K] made ready for :func:`linear`: int8 per output channel
    when ``quantization == "int8"``, then packed for the CPU kernel where that applies
    (:func:`pack_weight`, for the model's dtype, ``weight.dtype``). Returns ``(weight,
    scale)``: a :class:`PackedWeight`, or the [N, K] tensor (int8 with its [N] fp32 scale,
    else ``weight`` itself and None)."""
    x_dtype, scale = weight.dtype, None
    if quantization == "int8":
        weight, scale = quantize_int8(weight)
        scale = scale.to(weight.device)
    return pack_weight(weight, scale, x_dtype) or weight, scale


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias).

    Args:
        x: ``[..., K]`` (fp32 or bf16 on the packed path).
        weight: a :class:`PackedWeight` (the CPU kernel; bf16 weights take bf16 x, fp32
            weights fp32 x, int8 either), or ``[N, K]`` in x's dtype, or int8 with
            ``weight_scale`` ``[N]`` fp32.
        bias: ``[N]`` or None (added in fp32 before rounding on the packed path).

    Returns:
        ``[..., N]`` in x's dtype.

    Raises:
        RuntimeError: x's dtype or width does not match a packed weight.
    """
    if isinstance(weight, PackedWeight):
        return _packed_linear(x, weight, bias)
    if weight_scale is not None:
        weight = dequantize_int8(weight, weight_scale, x.dtype)
    return F.linear(x, weight, bias)


@torch.compiler.disable  # an opaque extension call: torch.compile (--compile) runs it between graphs
def _packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = load().linear(x.reshape(-1, x.shape[-1]), weight.data, weight.out_features, bias, weight.scale)
    return y.view(*x.shape[:-1], weight.out_features)
