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


# ------------------------------------------------- int8: per-channel K blocks and the residual
def test_channel_blocks_hold_each_channels_scale_and_min():
    """A full int8 K block (quantize_channels): each channel's codes span its own [min, max]
    over the block's rows, so an offset channel (K's outliers: a large value that barely
    varies, as RoPE's slow pairs) keeps its small spread, which per-row scales lose; the
    (scale, min) pairs sit in the rows' scale bytes in channel order."""
    from epd.kernels.kv_quant import channel_k, channel_rows, dequantize_channels, quantize_channels

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 16, 2, 64, generator=g) * torch.logspace(-2, 1, 64)
    x[..., 5] = 40.0 + 0.01 * torch.randn(3, 16, 2, generator=g)  # the offset channel
    packed = quantize_channels(x)
    assert packed.shape == (3, 16, 2, 80) and packed.dtype == torch.uint8
    meta = packed[..., 64:].contiguous().view(torch.float16).float().reshape(3, 16, 2, 4, 2)
    meta = meta.permute(0, 2, 1, 3, 4).reshape(3, 2, 64, 2)  # channel c: row c // 4, pair c % 4
    lo, hi = x.amin(1), x.amax(1)
    assert bool((meta[..., 1] <= lo).all()) and bool((meta[..., 1] + 255 * meta[..., 0] >= hi).all())
    assert torch.allclose(meta[..., 0], (hi - meta[..., 1]) / 255, rtol=2 ** -10, atol=2 ** -24)
    y = dequantize_channels(packed, torch.float32)
    err = (y - x).abs().amax(1)
    assert bool((err <= 0.5 * meta[..., 0] + 2 ** -20 * (lo.abs() + hi.abs())).all())
    assert float(err[..., 5].max()) < 0.05 / 255 * 2  # per-row scales: 40 / 255 at best
    assert float((dequantize_kv(quantize_kv(x.view(-1, 2, 64), "int8"), "int8", torch.float32).view_as(x)
                  - x)[..., 5].abs().max()) > 10 * float(err[..., 5].max())
    assert channel_rows(64) == 16 and channel_rows(16) == 16 and channel_rows(20) == 20
    assert channel_k("int8", 16, 64) and channel_k("int8", 32, 128)
    assert not channel_k("int8", 8, 64) and not channel_k("fp8_e4m3", 16, 64) and not channel_k(None, 16, 64)
    with pytest.raises(ValueError, match="cannot hold"):
        quantize_channels(x[:, :8])


def _store(key, kc, vc, slots, nd=0, resid=None):
    from epd.kernels.kv_quant import channel_fill_plan, complete_channel_blocks, store_quantized

    store_quantized(key, key, kc, vc, slots, "int8")
    rows, start = (resid.rows, resid.start) if resid is not None else (torch.zeros(0), torch.zeros(0))
    fill = channel_fill_plan(slots, nd, rows, start, kc.shape[1])
    complete_channel_blocks(key, kc, fill, None if resid is None else resid.k)


def test_blocks_a_step_fills_become_per_channel_from_exact_rows():
    """One sequence: a 20-token prefill (block 0 filled, rows 0-3 of block 1 stored per row),
    then 12 decode steps keeping their exact K in the residual from offset 4 on. While
    block 1 is open, attention reads block 0 per channel, rows 0-3 as stored and rows 4.. exact;
    the 12th decode fills it, and it becomes per channel, byte for byte, from rows 0-3 as
    stored and rows 4-15 exact."""
    from epd.kernels.kv_quant import KResidual, dequantize_channels, overlay_residual, quantize_channels

    g = torch.Generator().manual_seed(3)
    bs, heads, d = 16, 2, 64
    k = torch.randn(32, heads, d, generator=g) + 30.0 * (torch.arange(d) == 7)  # an offset channel
    kc = torch.zeros(4, bs, heads, d + scale_bytes(d), dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)  # blocks 2 then 0
    slots = torch.cat([torch.arange(16) + 2 * bs, torch.arange(16)])
    _store(k[:20], kc, vc, slots[:20])
    assert torch.equal(kc[2], quantize_channels(k[:16].unsqueeze(0))[0])
    stored = dequantize_kv(kc[0, :4], "int8", torch.float32)  # rows 0-3 of block 0, per row
    resid = KResidual(torch.zeros(3, bs, heads, d), torch.tensor([1]), torch.tensor([4]))
    for t in range(20, 32):
        _store(k[t:t + 1], kc, vc, slots[t:t + 1], nd=1, resid=resid)
        if t < 31:
            kd, _, tables = dequantize_blocks(kc, vc, table, "int8", torch.float32, torch.tensor([t + 1]))
            overlay_residual(kd, tables, torch.tensor([t + 1]), resid)
            assert torch.equal(kd[tables[0, 0]], dequantize_channels(kc[2:3], torch.float32)[0])
            assert torch.equal(kd[tables[0, 1], :4], stored)
            assert torch.equal(kd[tables[0, 1], 4:t + 1 - 16], k[20:t + 1])
    assert torch.equal(resid.k[1, 4:], k[20:32]) and not resid.k[[0, 2]].any()
    assert torch.equal(kc[0], quantize_channels(torch.cat([stored, k[20:32]]).unsqueeze(0))[0])
    kd, _, tables = dequantize_blocks(kc, vc, table[:, :2], "int8", torch.float32, torch.tensor([32]))
    overlay_residual(kd, tables, torch.tensor([32]), resid)  # a filled block: not from the residual
    assert torch.equal(kd[tables[0, 1]], dequantize_channels(kc[0:1], torch.float32)[0])
    assert float((kd[tables[0, 1], 4:] - k[20:32]).abs().max()) < 0.02


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_triton_reads_channel_blocks_and_the_residual(device, block_size):
    """The Triton decode kernel reads full int8 K blocks per channel and the partial last
    block's rows from the residual where it holds them: equal to the reference path
    (dequantize_blocks + overlay_residual + attention), for a sequence with no residual
    (start = block_size), one whose new token just filled its block (read per channel), one
    with part of its last block in the residual, one with all of it; and the residual's
    values matter (zeroing it changes the output)."""
    import importlib.util

    from epd.kernels.kv_quant import KResidual, quantize_channels
    from epd.kernels.paged_attention import paged_decode_attention, paged_decode_attention_triton

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    g = torch.Generator().manual_seed(block_size)
    heads, kv_heads, d, blocks = 6, 2, 64, 12
    row = d + scale_bytes(d)
    kc = torch.zeros(blocks, block_size, kv_heads, row, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    kf = torch.randn(blocks, block_size, kv_heads, d, generator=g) + 20.0 * (torch.arange(d) == 3)
    vf = torch.randn(blocks, block_size, kv_heads, d, generator=g)
    kc[:] = quantize_kv(kf.view(-1, kv_heads, d), "int8").view_as(kc)
    vc[:] = quantize_kv(vf.view(-1, kv_heads, d), "int8").view_as(vc)
    bs = block_size
    ctx = torch.tensor([bs + 5, 2 * bs, 2 * bs + 9, bs + 7], dtype=torch.int32)
    tables = torch.tensor([[1, 4, -1], [5, 6, -1], [7, 2, 9], [3, 10, -1]], dtype=torch.int32)
    for b in (1, 5, 6, 7, 2, 3):  # the blocks each sequence has filled
        kc[b] = quantize_channels(kf[b:b + 1])[0]
    resid = KResidual(torch.randn(5, bs, kv_heads, d, generator=g) + 20.0 * (torch.arange(d) == 3),
                      torch.tensor([0, 3, 1, 4]), torch.tensor([bs, 0, 2, 0]))
    q = torch.randn(4, heads, d, generator=g)
    scale = d ** -0.5
    ref = paged_decode_attention(q, kc, vc, tables, ctx, scale, kv_quant="int8", channel_k=True, resid=resid)
    out = paged_decode_attention_triton(q.to(device), kc.to(device), vc.to(device), tables.to(device), ctx.to(device),
                                        scale, kv_quant="int8", channel_k=True,
                                        resid=KResidual(*(t.to(device) for t in (resid.k, resid.rows, resid.start))))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-4)
    zeroed = KResidual(torch.zeros_like(resid.k), resid.rows, resid.start)
    other = paged_decode_attention(q, kc, vc, tables, ctx, scale, kv_quant="int8", channel_k=True, resid=zeroed)
    changed = (other - ref).abs().amax(dim=(1, 2)) > 1e-3
    assert changed.tolist() == [False, False, True, True]
    per_row = paged_decode_attention(q, kc, vc, tables, ctx, scale, kv_quant="int8")
    assert bool(((per_row - ref).abs().amax(dim=(1, 2)) > 1e-3).all())  # full blocks are read per channel
    with pytest.raises(ValueError, match="int8 layout"):
        paged_decode_attention(q, kc, vc, tables, ctx, scale, kv_quant="fp8_e4m3", channel_k=True)


def test_a_mixed_steps_fill_plan():
    """One step of two decodes, a padding slot and a 20-token prefill chunk
    (channel_fill_plan, then complete_channel_blocks): the decode that fills its block
    rewrites it per channel from its stored rows 0-2, its residual's rows 3-14 and its own
    K; the other decode only adds its K to the residual; the chunk's filled block is per
    channel from its 4 stored rows and its 12 exact ones, its next block stays per row."""
    from epd.kernels.kv_quant import channel_fill_plan, complete_channel_blocks, quantize_channels, store_quantized

    g = torch.Generator().manual_seed(4)
    bs, d = 16, 16
    a, b, c, dd = 6, 2, 4, 1  # block ids
    kc = torch.zeros(8, bs, 1, d + scale_bytes(d), dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    before = torch.randn(8, bs, 1, d, generator=g)
    kc[:] = quantize_kv(before.view(-1, 1, d), "int8").view_as(kc)
    resid = torch.randn(3, bs, 1, d, generator=g)
    key = torch.randn(23, 1, d, generator=g)
    slots = torch.cat([torch.tensor([a * bs + 15, b * bs + 7, -1]), c * bs + torch.arange(4, 16),
                       dd * bs + torch.arange(8)])
    rows, start = torch.tensor([0, 2, 1]), torch.tensor([3, 0, 0])
    stored = dequantize_kv(kc, "int8", torch.float32)
    fill = channel_fill_plan(slots, 3, rows, start, bs)
    assert fill.blocks.tolist() == [c, a] and fill.resid_tok.tolist() == [0, 1]
    want_a = quantize_channels(torch.cat([stored[a, :3], resid[0, 3:15], key[:1]]).unsqueeze(0))[0]
    want_c = quantize_channels(torch.cat([stored[c, :4], key[3:15]]).unsqueeze(0))[0]
    store_quantized(key, key, kc, vc, slots, "int8")
    rowwise_b, rowwise_d = kc[b].clone(), kc[dd].clone()
    complete_channel_blocks(key, kc, fill, resid)
    assert torch.equal(kc[a], want_a) and torch.equal(kc[c], want_c)
    assert torch.equal(kc[b], rowwise_b) and torch.equal(kc[dd], rowwise_d)
    assert torch.equal(resid[0, 15], key[0]) and torch.equal(resid[2, 7], key[1])
