"""Quantized KV cache rows (epd.kernels.kv_quant): the packing, the error bound, and
attention on a quantized cache against attention on full-precision K/V."""

from __future__ import annotations

import pytest
import torch

from epd.kernels.kv_quant import GROUP, KV_QUANT, dequantize_blocks, dequantize_kv, quantize_kv, scale_bytes
from epd.kernels.paged_attention import paged_decode_attention_ref
from epd.kernels.store_kv import store_kvcache_ref

KINDS = list(KV_QUANT)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_pack_values_then_their_scale_within_the_error_bound(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50).view(50, 1, 1)  # rows of all scales
    x[7, 1] = 0.0  # an all-zero row
    y_odd = dequantize_kv(quantize_kv(torch.randn(4, 2, 20, generator=g), kind), kind, torch.float32)
    assert y_odd.shape == (4, 2, 20)  # a head_dim GROUP does not divide: one scale a row
    packed = quantize_kv(x, kind)
    assert scale_bytes(64) == 4 * 64 // GROUP
    assert packed.shape == (50, 3, 64 + scale_bytes(64)) and packed.dtype == torch.uint8
    scale = packed[..., 64:].contiguous().view(torch.float32)  # [50, 3, groups]
    assert torch.allclose(scale, x.reshape(50, 3, -1, GROUP).abs().amax(-1) / KV_QUANT[kind][1])
    y = dequantize_kv(packed, kind, torch.float32)
    group_max = x.reshape(50, 3, -1, GROUP).abs().amax(-1, keepdim=True).expand(-1, -1, -1, GROUP).reshape(50, 3, 64)
    err = (y - x).abs() / group_max.clamp(min=1e-30)
    # int8: half a step of absmax/127; e4m3: 3 mantissa bits, relative error <= 2^-4 of the value
    bound = 0.5 / 127 + 1e-6 if kind == "int8" else 2.0 ** -4
    assert float(err.max()) <= bound, float(err.max())
    assert torch.equal(y[7, 1], torch.zeros(64))


@pytest.mark.parametrize("kind", KINDS)
def test_decode_attention_on_a_quantized_cache_is_close_to_full_precision(kind):
    g = torch.Generator().manual_seed(1)
    blocks, bs, kv_heads, heads, d = 12, 8, 2, 4, 32
    ctx = torch.tensor([5, 17, 40], dtype=torch.int32)
    tables = torch.tensor([[3, 0, 0, 0, 0], [7, 1, 9, 0, 0], [2, 4, 6, 8, 10]], dtype=torch.int32)
    k = torch.randn(blocks * bs, kv_heads, d, generator=g)
    v = torch.randn(blocks * bs, kv_heads, d, generator=g)
    slots = torch.arange(blocks * bs)
    kc = torch.zeros(blocks, bs, kv_heads, d)
    vc = torch.zeros_like(kc)
    store_kvcache_ref(k, v, kc, vc, slots)
    kq = torch.zeros(blocks, bs, kv_heads, d + scale_bytes(d), dtype=torch.uint8)
    vq = torch.zeros_like(kq)
    store_kvcache_ref(quantize_kv(k, kind), quantize_kv(v, kind), kq, vq, slots)
    q = torch.randn(3, heads, d, generator=g)
    ref = paged_decode_attention_ref(q, kc, vc, tables, ctx, d ** -0.5)
    kd, vd, remapped = dequantize_blocks(kq, vq, tables, kind, torch.float32)
    assert kd.shape[0] == len(torch.unique(tables)) and remapped.shape == tables.shape
    out = paged_decode_attention_ref(q, kd, vd, remapped, ctx, d ** -0.5)
    # the same as attention over the dequantized cache, block for block
    full = paged_decode_attention_ref(q, dequantize_kv(kq, kind, torch.float32), dequantize_kv(vq, kind, torch.float32),
                                      tables, ctx, d ** -0.5)
    assert torch.allclose(out, full, atol=1e-6)
    tol = 0.02 if kind == "int8" else 0.1
    assert float((out - ref).abs().max()) < tol, float((out - ref).abs().max())
