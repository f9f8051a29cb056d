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
def test_rows_pack_values_then_their_scales_within_the_error_bound(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50).view(50, 1, 1)  # rows of all scales
    x[7, 1] = 0.0  # an all-zero row
    x[9, 2] = 3.0 + 0.01 * torch.randn(64, generator=g)  # an offset channel group (K's outliers)
    y_odd = dequantize_kv(quantize_kv(torch.randn(4, 2, 20, generator=g), kind), kind, torch.float32)
    assert y_odd.shape == (4, 2, 20)  # a head_dim GROUP does not divide: one scale a row
    packed = quantize_kv(x, kind)
    assert scale_bytes(64) == 4 * 64 // GROUP
    assert packed.shape == (50, 3, 64 + scale_bytes(64)) and packed.dtype == torch.uint8
    grouped = x.reshape(50, 3, -1, GROUP)
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    y = dequantize_kv(packed, kind, torch.float32)
    err = (y - x).abs().reshape(50, 3, -1, GROUP).amax(-1)  # [50, 3, groups]
    if kind == "int8":  # float16 (scale, min) per group; codes 0..255 over [min, max]
        meta = packed[..., 64:].contiguous().view(torch.float16).float().reshape(50, 3, -1, 2)
        assert torch.allclose(meta[..., 1], lo, rtol=2 ** -10, atol=2 ** -24)
        assert torch.allclose(meta[..., 0], (hi - meta[..., 1]) / 255, rtol=2 ** -10, atol=2 ** -24)
        # half a code step (min rounded down, scale up: no code is clamped), float32's rounding
        assert bool((meta[..., 1] <= lo).all()) and bool((meta[..., 1] + 255 * meta[..., 0] >= hi).all())
        bound = 0.5 * meta[..., 0] + 2 ** -20 * (lo.abs() + hi.abs())
        assert float(err[9, 2].max()) < 0.1 / 255  # the offset group keeps its 0.01 spread (absmax: 3 / 254)
    else:  # float32 absmax scale per group; e4m3 has 3 mantissa bits: 2^-4 of the value
        scale = packed[..., 64:].contiguous().view(torch.float32)
        assert torch.allclose(scale, grouped.abs().amax(-1) / KV_QUANT[kind][1])
        bound = 2.0 ** -4 * torch.maximum(lo.abs(), hi.abs()) + 1e-30
    assert bool((err <= bound).all()), float((err - bound).max())
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 48, 20, 16])
def test_triton_quantize_store_writes_the_references_bytes(kind, head_dim, device):
    """The fused quantize-and-store kernel writes byte for byte what quantize_kv + the
    reference store write (float16 scale/min rounded down/up as _round_fp16, codes
    rounded half to even), for rows of every scale, all-zero and constant rows, an
    offset group and values beyond float16; slots < 0 are skipped and a strided key
    (a slice of a fused qkv output) works. head_dim 48 has 3 groups, 20 one scale a row."""
    import importlib.util

    from epd.kernels.kv_quant import store_quantized, store_quantized_ref, store_quantized_triton

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    g = torch.Generator().manual_seed(head_dim)
    n, heads, blocks, bs = 12, 2, 5, 4
    qkv = torch.randn(n, 3 * heads * head_dim, generator=g) * torch.logspace(-4, 3, n).view(n, 1)
    key = qkv[:, :heads * head_dim].view(n, heads, head_dim)  # strided
    value = qkv[:, heads * head_dim:2 * heads * head_dim].reshape(n, heads, head_dim)
    key[1, 0] = 0.0
    value[2, 1] = 1.5
    key[3, 1, :16] = 3.0 + 0.01 * torch.randn(16, generator=g)
    value[4, 0, 0] = 1e6  # clamped to float16's range (int8)
    key[5, 1] = -7.25
    slots = torch.tensor([0, 3, 19, -1, 7, 8, 12, 1, 2, 17, 4, -1])
    row = head_dim + scale_bytes(head_dim)
    caches = [torch.full((blocks, bs, heads, row), 0xAB, dtype=torch.uint8) for _ in range(4)]
    store_quantized_ref(key, value, caches[0], caches[1], slots, kind)
    kt, vt = caches[2].to(device), caches[3].to(device)
    store_quantized_triton(key.to(device), value.to(device), kt, vt, slots.to(device), kind)
    assert torch.equal(kt.cpu(), caches[0]) and torch.equal(vt.cpu(), caches[1])
    assert int((caches[0] == 0xAB).all(-1).sum()) == blocks * bs * heads - 10 * heads  # 10 slots written
    ks, vs = caches[0].clone(), caches[1].clone()
    store_quantized(key, value, ks, vs, slots, kind)  # CPU: the reference
    assert torch.equal(ks, caches[0])
    with pytest.raises(ValueError, match="uint8"):
        store_quantized_ref(key, value, caches[0][..., :-1], caches[1][..., :-1], slots, kind)
