"""KV staging pack/unpack: Triton vs torch reference, and exact round trips across TP splits."""

import importlib.util

import pytest
import torch

from epd.kernels.kv_staging import (
    pack_kv,
    pack_kv_ref,
    pack_kv_triton,
    staging_shape,
    unpack_kv,
    unpack_kv_ref,
    unpack_kv_triton,
)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _caches(num_layers_blocks, block_size, heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_layers_blocks, block_size, heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_layers_blocks, block_size, heads, head_dim, generator=g).to(dtype)
    return k, v


def _shard(cache, tp, rank):
    h = cache.shape[2] // tp
    return cache[:, :, rank * h:(rank + 1) * h].contiguous()


def _transfer(src_tp, dst_tp, *, heads=4, head_dim=8, block_size=4, num_blocks=9, dtype=torch.float32,
              pack=pack_kv_ref, unpack=unpack_kv_ref, device="cpu"):
    """Full-head caches -> src_tp rank shards -> staging -> dst_tp rank shards; returns
    (source caches, destination shards, src block ids, dst block ids)."""
    k, v = _caches(num_blocks, block_size, heads, head_dim, dtype, seed=src_tp * 10 + dst_tp)
    src_ids = torch.tensor([7, 2, 5, 0], dtype=torch.int64)
    dst_ids = torch.tensor([1, 8, 3, 4], dtype=torch.int32)
    n = len(src_ids)
    staging = torch.full(staging_shape(src_tp, n, block_size, heads, head_dim), -1.0, dtype=dtype, device=device)
    for r in range(src_tp):
        pack(_shard(k, src_tp, r).to(device), _shard(v, src_tp, r).to(device), src_ids.to(device), staging[r])
    # The region the NIXL write moves is one contiguous byte range.
    moved = staging.reshape(-1).clone().reshape(staging.shape)
    hd = heads // dst_tp
    dst = []
    for q in range(dst_tp):
        dk = torch.zeros(num_blocks, block_size, hd, head_dim, dtype=dtype, device=device)
        dv = torch.zeros_like(dk)
        unpack(moved, dk, dv, dst_ids.to(device), q * hd)
        dst.append((dk.cpu(), dv.cpu()))
    return k, v, src_ids, dst_ids, dst


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2), (1, 1)])
def test_round_trip_is_exact(src_tp, dst_tp):
    k, v, src_ids, dst_ids, dst = _transfer(src_tp, dst_tp)
    full_k = torch.cat([dk for dk, _ in dst], dim=2)
    full_v = torch.cat([dv for _, dv in dst], dim=2)
    assert torch.equal(full_k[dst_ids.long()], k[src_ids])
    assert torch.equal(full_v[dst_ids.long()], v[src_ids])
    untouched = [b for b in range(k.shape[0]) if b not in dst_ids.tolist()]
    assert not full_k[untouched].any() and not full_v[untouched].any()


def test_round_trip_bf16_bits():
    k, v, src_ids, dst_ids, dst = _transfer(2, 1, dtype=torch.bfloat16)
    assert torch.equal(dst[0][0][dst_ids.long()].view(torch.int16), k[src_ids].view(torch.int16))


def test_pack_layout_is_documented_one():
    k, v = _caches(5, 4, 2, 3, torch.float32, seed=1)
    out = torch.empty(2, 2, 4, 2, 3)
    pack_kv_ref(k, v, torch.tensor([3, 1]), out)
    assert torch.equal(out[0, 0], k[3]) and torch.equal(out[1, 1], v[1])


def test_bad_arguments_raise():
    k, v = _caches(5, 4, 2, 3, torch.float32, seed=1)
    with pytest.raises(ValueError, match="out must be"):
        pack_kv_ref(k, v, torch.tensor([0]), torch.empty(2, 2, 4, 2, 3))
    with pytest.raises(ValueError, match="block id out of range"):
        pack_kv_ref(k, v, torch.tensor([5]), torch.empty(2, 1, 4, 2, 3))
    with pytest.raises(ValueError, match="outside the"):
        unpack_kv_ref(torch.empty(1, 2, 1, 4, 2, 3), k, v, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="does not divide"):
        staging_shape(3, 1, 4, 2, 3)


@needs_triton
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(src_tp, dst_tp, dtype, device):
    ref = _transfer(src_tp, dst_tp, dtype=dtype, head_dim=6)
    tri = _transfer(src_tp, dst_tp, dtype=dtype, head_dim=6, pack=pack_kv_triton, unpack=unpack_kv_triton,
                    device=device)
    for (rk, rv), (tk, tv) in zip(ref[4], tri[4]):
        assert torch.equal(rk, tk) and torch.equal(rv, tv)


@needs_triton
def test_triton_pack_matches_reference(device):
    k, v = _caches(6, 8, 2, 16, torch.float32, seed=3)
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    a, b = torch.empty(2, 3, 8, 2, 16), torch.empty(2, 3, 8, 2, 16, device=device)
    pack_kv_ref(k, v, ids, a)
    pack_kv_triton(k.to(device), v.to(device), ids.to(device), b)
    assert torch.equal(a, b.cpu())


def test_dispatch_uses_reference_on_cpu():
    k, v = _caches(3, 2, 2, 2, torch.float32, seed=4)
    out = torch.empty(2, 1, 2, 2, 2)
    pack_kv(k, v, torch.tensor([2]), out)
    dk, dv = torch.zeros_like(k[:, :, :1]), torch.zeros_like(v[:, :, :1])
    unpack_kv(out.unsqueeze(0), dk, dv, torch.tensor([0]), 1)
    assert torch.equal(dk[0], k[2, :, 1:]) and torch.equal(dv[0], v[2, :, 1:])


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("kernels", ["ref", pytest.param("triton", marks=needs_triton)])
def test_quantized_rows_cross_tp_with_their_own_heads_scales(kind, src_tp, dst_tp, kernels, device):
    """A quantized cache (uint8 rows: head_dim codes, then that head's scales) staged
    across TP: every destination head dequantizes to exactly the source head's values.
    Heads get scales of very different magnitude (x 10^h), so a row whose codes and
    scales came from different heads, or scales cut off a row, would not match."""
    from epd.kernels.kv_quant import dequantize_kv, quantize_kv, scale_bytes

    heads, head_dim, bs, blocks = 4, 32, 4, 9
    g = torch.Generator().manual_seed(src_tp * 10 + dst_tp)
    mag = torch.logspace(-2, 1, heads).view(1, heads, 1)
    kf, vf = (torch.randn(blocks * bs, heads, head_dim, generator=g) * mag + 0.5 for _ in range(2))
    k = quantize_kv(kf, kind).view(blocks, bs, heads, head_dim + scale_bytes(head_dim))
    v = quantize_kv(vf, kind).view_as(k)
    pack, unpack = (pack_kv_ref, unpack_kv_ref) if kernels == "ref" else (pack_kv_triton, unpack_kv_triton)
    src_ids, dst_ids = torch.tensor([7, 2, 5, 0]), torch.tensor([1, 8, 3, 4], dtype=torch.int32)
    row = k.shape[-1]
    staging = torch.full(staging_shape(src_tp, 4, bs, heads, row), 0xAB, dtype=torch.uint8, device=device)
    for r in range(src_tp):
        pack(_shard(k, src_tp, r).to(device), _shard(v, src_tp, r).to(device), src_ids.to(device), staging[r])
    hd = heads // dst_tp
    got_k, got_v = [], []
    for q in range(dst_tp):
        dk = torch.zeros(blocks, bs, hd, row, dtype=torch.uint8, device=device)
        dv = torch.zeros_like(dk)
        unpack(staging, dk, dv, dst_ids.to(device), q * hd)
        got_k.append(dk.cpu())
        got_v.append(dv.cpu())
    full_k, full_v = torch.cat(got_k, dim=2)[dst_ids.long()], torch.cat(got_v, dim=2)[dst_ids.long()]
    assert torch.equal(full_k, k[src_ids]) and torch.equal(full_v, v[src_ids])  # byte for byte
    want = dequantize_kv(k[src_ids], kind, torch.float32)
    assert torch.equal(dequantize_kv(full_k, kind, torch.float32), want)
    assert float((want - kf.view(blocks, bs, heads, head_dim)[src_ids]).abs().max()) < 0.1 * float(mag.max())
