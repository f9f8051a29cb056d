"""Paged attention: torch references vs plain per-sequence attention, Triton vs the reference.

Every cache slot that no sequence owns, and every block that padded block-table entries
point at, holds NaN: a kernel that reads past a context or through a padding entry
produces NaN and fails.
"""

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from epd.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
    store_kvcache_ref,
    store_kvcache_triton,
)
from epd.kernels.cpu_attention import load as load_cpu_kernel
from epd.kernels.cpu_attention import paged_decode_attention_cpu

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")


# ----------------------------------------------------------------------------- helpers

def make_paged(ctx_lens, num_kv_heads, head_dim, block_size, dtype, device="cpu", *,
               pad_cols=2, poison_blocks=2, garbage=(-1,), seed=0):
    """Random paged caches for sequences of ``ctx_lens`` tokens.

    Blocks are shuffled over the cache; unowned slots and ``poison_blocks`` extra blocks
    are NaN. Block-table entries past each sequence's blocks cycle through ``garbage``
    (ints, or "poison" for a NaN block).
    """
    g = torch.Generator().manual_seed(seed)
    needed = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(needed) + poison_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    poison = perm[sum(needed):]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    max_cols = max(needed) + pad_cols
    tables = torch.empty(len(ctx_lens), max_cols, dtype=torch.int32)
    at = 0
    for i, (ctx, n) in enumerate(zip(ctx_lens, needed)):
        ids = perm[at:at + n]
        at += n
        for j in range(max_cols):
            if j < n:
                tables[i, j] = ids[j]
            else:
                gv = garbage[(i + j) % len(garbage)]
                tables[i, j] = poison[j % len(poison)] if gv == "poison" else gv
        pos = torch.arange(ctx)
        slots = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return (k_cache.to(device=device, dtype=dtype), v_cache.to(device=device, dtype=dtype),
            tables.to(device), ctx.to(device))


def gather_seq(k_cache, v_cache, table, ctx):
    """A sequence's keys/values, token by token (float64)."""
    block_size = k_cache.shape[1]
    keys, values = [], []
    for pos in range(int(ctx)):
        blk = int(table[pos // block_size])
        keys.append(k_cache[blk, pos % block_size])
        values.append(v_cache[blk, pos % block_size])
    return torch.stack(keys).double().cpu(), torch.stack(values).double().cpu()


def naive_decode(q, k_cache, v_cache, tables, ctx_lens, scale):
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for i in range(num_seqs):
        keys, values = gather_seq(k_cache, v_cache, tables[i], ctx_lens[i])
        for h in range(num_heads):
            scores = keys[:, h // group] @ q[i, h].double().cpu() * scale
            out[i, h] = torch.softmax(scores, dim=0) @ values[:, h // group]
    return out


def naive_prefill(q, k_cache, v_cache, table, ctx, scale):
    n, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    keys, values = gather_seq(k_cache, v_cache, table, ctx)
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float64)
    for i in range(n):
        last = ctx - n + i  # absolute position of query i
        for h in range(num_heads):
            scores = keys[:last + 1, h // group] @ q[i, h].double() * scale
            out[i, h] = torch.softmax(scores, dim=0) @ values[:last + 1, h // group]
    return out


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4),
       torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


# ----------------------------------------------------------------- decode: reference

@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_ref_matches_naive(num_heads, num_kv_heads, block_size, dtype):
    head_dim = 32
    ctx_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 50]
    kc, vc, tables, ctx = make_paged(ctx_lens, num_kv_heads, head_dim, block_size, dtype,
                                     garbage=(-1, 0, "poison", 10**6))
    q = torch.randn(len(ctx_lens), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention_ref(q, kc, vc, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_decode(q, kc, vc, tables, ctx, scale), **TOL[dtype])


def test_decode_ref_chunked_path(monkeypatch):
    from epd.kernels import paged_attention

    ctx_lens = [70, 3, 33, 64, 17, 1, 90]
    kc, vc, tables, ctx = make_paged(ctx_lens, 2, 16, 16, torch.float32, garbage=(-1, "poison"))
    q = torch.randn(len(ctx_lens), 4, 16)
    whole = paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.25)
    monkeypatch.setattr(paged_attention, "_DECODE_CHUNK_BYTES", 1)  # one sequence per chunk
    chunked = paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.25)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(chunked.double(), naive_decode(q, kc, vc, tables, ctx, 0.25),
                               **TOL[torch.float32])


def test_decode_ref_int64_tables_and_dispatch_on_cpu():
    kc, vc, tables, ctx = make_paged([5, 20, 9], 2, 8, 8, torch.float32)
    q = torch.randn(3, 4, 8)
    ref = paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.3)
    torch.testing.assert_close(paged_decode_attention_ref(q, kc, vc, tables.long(), ctx.long(), 0.3), ref)
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, tables, ctx, 0.3), ref)


# ------------------------------------------------------- decode: CPU kernel (in place)

needs_cpu_kernel = pytest.mark.skipif(load_cpu_kernel() is None, reason="the CPU kernel cannot be built here")


@needs_cpu_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1), (9, 3)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_cpu_kernel_matches_naive(num_heads, num_kv_heads, block_size, dtype, head_dim):
    """The in-place kernel reads only each sequence's own blocks (NaN elsewhere, garbage
    table entries past the context) and matches float64 attention."""
    ctx_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 50, 7]
    kc, vc, tables, ctx = make_paged(ctx_lens, num_kv_heads, head_dim, block_size, dtype,
                                     garbage=(-1, 0, "poison", 10**6))
    q = torch.randn(len(ctx_lens), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention_cpu(q, kc, vc, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_decode(q, kc, vc, tables, ctx, scale), **TOL[dtype])
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, tables, ctx, scale), out)  # dispatch: the kernel


@needs_cpu_kernel
def test_decode_cpu_kernel_edges():
    """An empty context gives zeros; a block id outside the cache inside a context is an
    error, never a read out of bounds; a q that is a strided view is read correctly."""
    kc, vc, tables, ctx = make_paged([5, 20], 2, 16, 8, torch.float32)
    q = torch.randn(2, 4, 16)
    zero = paged_decode_attention_cpu(q, kc, vc, tables, torch.tensor([0, 20], dtype=torch.int32), 0.25)
    assert torch.equal(zero[0], torch.zeros_like(zero[0])) and torch.isfinite(zero[1]).all()
    bad = tables.clone()
    bad[1, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode_attention_cpu(q, kc, vc, bad, ctx, 0.25)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        paged_decode_attention_cpu(q, kc, vc, tables[:, :2], torch.tensor([5, 20], dtype=torch.int32), 0.25)
    wide = torch.randn(2, 8, 16)[:, ::2]
    torch.testing.assert_close(paged_decode_attention_cpu(wide, kc, vc, tables, ctx, 0.25),
                               paged_decode_attention_ref(wide, kc, vc, tables, ctx, 0.25), **TOL[torch.float32])


# ---------------------------------------------------------------- prefill: reference

@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,num_new,ctx_len",
    [
        (4, 4, 16, 20, 20),   # whole prompt, no cached prefix
        (8, 2, 16, 13, 45),   # chunk after a 32-token cached prefix, partial last block
        (6, 3, 8, 8, 40),     # chunk ends exactly on a block boundary
        (4, 1, 8, 1, 17),     # a single new token (decode-shaped)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_ref_matches_naive(num_heads, num_kv_heads, block_size, num_new, ctx_len, dtype):
    head_dim = 16
    kc, vc, tables, _ = make_paged([ctx_len], num_kv_heads, head_dim, block_size, dtype,
                                   pad_cols=3, garbage=(-1, "poison", 10**6))
    q = torch.randn(num_new, num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = paged_prefill_attention_ref(q, kc, vc, tables[0], ctx_len, scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = naive_prefill(q, kc, vc, tables[0], ctx_len, scale)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


def test_prefill_last_row_equals_decode():
    kc, vc, tables, ctx = make_paged([37], 2, 16, 8, torch.float32, garbage=(-1,))
    q = torch.randn(5, 4, 16)
    pre = paged_prefill_attention_ref(q, kc, vc, tables[0], torch.tensor(37), 0.25)
    dec = paged_decode_attention_ref(q[-1:], kc, vc, tables, ctx, 0.25)
    torch.testing.assert_close(pre[-1:], dec, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------- decode: Triton

@needs_triton
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        (4, 4, 32, 16, torch.float32),
        (8, 2, 64, 16, torch.float32),
        (6, 2, 48, 8, torch.float32),    # head_dim and group not powers of two
        (8, 1, 32, 8, torch.float32),    # MQA
        (4, 2, 32, 12, torch.float32),   # block_size not a power of two (4 tokens per step)
        (8, 2, 64, 16, torch.float16),
        (8, 2, 64, 8, torch.bfloat16),
    ],
)
def test_decode_triton_matches_ref(device, num_heads, num_kv_heads, head_dim, block_size, dtype):
    ctx_lens = [1, block_size, block_size + 3, 2 * block_size, 45]
    kc, vc, tables, ctx = make_paged(ctx_lens, num_kv_heads, head_dim, block_size, dtype, device,
                                     garbage=(-1, "poison"), seed=3)
    q = torch.randn(len(ctx_lens), num_heads, head_dim).to(device=device, dtype=dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention_triton(q, kc, vc, tables, ctx, scale)
    ref = paged_decode_attention_ref(q, kc, vc, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), naive_decode(q, kc, vc, tables, ctx, scale),
                                   **TOL[dtype])


@needs_triton
def test_decode_triton_partial_block_steps(device, monkeypatch):
    # A small tile budget makes each step cover part of a block (as for wide GQA groups).
    from epd.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "_MAX_TILE", 2 * 4 * 16)  # 2 tokens per step
    kc, vc, tables, ctx = make_paged([1, 7, 16, 29], 1, 16, 16, torch.float32, device,
                                     garbage=(-1, "poison"), seed=5)
    q = torch.randn(4, 4, 16, device=device)
    out = paged_decode_attention_triton(q, kc, vc, tables, ctx, 0.25)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.25),
                               **TOL[torch.float32])


@needs_triton
def test_decode_triton_strided_q(device):
    # q as a slice of a fused qkv projection output (not contiguous).
    B, H, Hkv, D, BS = 3, 4, 2, 16, 8
    kc, vc, tables, ctx = make_paged([9, 30, 16], Hkv, D, BS, torch.float32, device)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, device=device)
    q = qkv[:, :H * D].view(B, H, D)
    assert not q.is_contiguous()
    out = paged_decode_attention_triton(q, kc, vc, tables, ctx, 0.25)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.25),
                               **TOL[torch.float32])


@needs_triton
def test_store_then_decode_triton_matches_dense_attention(device):
    """End to end: scatter whole sequences with the store kernel, attend with the decode
    kernel, compare with dense attention over the unpaged K/V."""
    B, H, Hkv, D, BS = 3, 4, 2, 32, 8
    ctx_lens = [11, 24, 5]
    num_blocks = 12
    g = torch.Generator().manual_seed(7)
    keys = [torch.randn(n, Hkv, D, generator=g) for n in ctx_lens]
    values = [torch.randn(n, Hkv, D, generator=g) for n in ctx_lens]
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((B, 4), -1, dtype=torch.int32)
    slots, at = [], 0
    for i, n in enumerate(ctx_lens):
        nb = math.ceil(n / BS)
        tables[i, :nb] = perm[at:at + nb].int()
        at += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // BS].long() * BS + pos % BS)
    kc = torch.zeros(num_blocks, BS, Hkv, D, device=device)
    vc = torch.zeros_like(kc)
    store_kvcache_triton(torch.cat(keys).to(device), torch.cat(values).to(device), kc, vc,
                         torch.cat(slots).to(device))
    q = torch.randn(B, H, D, generator=g)
    out = paged_decode_attention_triton(q.to(device), kc, vc, tables.to(device),
                                        torch.tensor(ctx_lens, dtype=torch.int32, device=device), D ** -0.5)
    for i in range(B):
        k = keys[i].repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, n, D]
        v = values[i].repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
        p = torch.softmax(q[i][:, None, :] @ k.transpose(1, 2) * D ** -0.5, dim=-1)
        dense = (p @ v)[:, 0]
        torch.testing.assert_close(out[i].cpu(), dense, atol=1e-5, rtol=1e-4)
    # The reference store + reference decode agree too.
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kvcache_ref(torch.cat(keys).to(device), torch.cat(values).to(device), kc2, vc2,
                      torch.cat(slots).to(device))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter path")
def test_interpreter_works_when_set_after_import(tmp_path):
    """epd.kernels imported (and even a compiled-mode kernel requested) before
    TRITON_INTERPRET is set: kernels are built lazily per mode, so the interpreter still
    runs them."""
    script = textwrap.dedent("""
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import torch
        import epd.kernels as K
        from epd.kernels import paged_attention, store_kv
        assert type(store_kv._get_kernel()).__name__ == "JITFunction"
        os.environ["TRITON_INTERPRET"] = "1"
        kc = torch.zeros(2, 8, 1, 4); vc = torch.zeros_like(kc)
        key = torch.randn(5, 1, 4); val = torch.randn(5, 1, 4)
        slots = torch.tensor([0, 3, -1, 9, 15])
        K.store_kvcache_triton(key, val, kc, vc, slots)
        kr = torch.zeros_like(kc); vr = torch.zeros_like(vc)
        K.store_kvcache_ref(key, val, kr, vr, slots)
        assert torch.equal(kc, kr) and torch.equal(vc, vr)
        q = torch.randn(1, 2, 4)
        bt = torch.tensor([[0, 1]], dtype=torch.int32); cl = torch.tensor([16], dtype=torch.int32)
        o = K.paged_decode_attention_triton(q, kc, vc, bt, cl, 0.5)
        torch.testing.assert_close(o, K.paged_decode_attention_ref(q, kc, vc, bt, cl, 0.5))
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


@needs_triton
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(8, 2, 64, 16), (6, 2, 20, 8)])
def test_decode_triton_reads_a_quantized_cache_in_place(device, kind, num_heads, num_kv_heads, head_dim, block_size):
    """The kernel dequantizes uint8 rows (codes, then each group's scales: int8 float16
    scale and min, fp8 a float32 scale; head_dim 20: one scale group a row) as it loads
    them: equal to attention over the dequantized cache; and the dispatcher's reference
    path (dequantize_blocks) gives the same. Per-head magnitudes differ by 10^3, so
    codes read with another group's or head's scales would be far off."""
    from epd.kernels.kv_quant import dequantize_kv, quantize_kv, scale_bytes
    from epd.kernels.paged_attention import paged_decode_attention

    ctx_lens = [1, block_size + 3, 45]
    kc, vc, tables, ctx = make_paged(ctx_lens, num_kv_heads, head_dim, block_size, torch.float32,
                                     garbage=(-1, 0), seed=11)
    mag = torch.logspace(-1.5, 1.5, num_kv_heads).view(1, 1, num_kv_heads, 1)
    row = head_dim + scale_bytes(head_dim)
    kq, vq = (quantize_kv(torch.nan_to_num(c * mag).view(-1, num_kv_heads, head_dim), kind)
              .view(*c.shape[:3], row) for c in (kc, vc))
    kd, vd = dequantize_kv(kq, kind, torch.float32), dequantize_kv(vq, kind, torch.float32)
    q = torch.randn(len(ctx_lens), num_heads, head_dim)
    scale = head_dim ** -0.5
    ref = paged_decode_attention_ref(q, kd, vd, tables, ctx, scale)
    out = paged_decode_attention_triton(q.to(device), kq.to(device), vq.to(device), tables.to(device),
                                        ctx.to(device), scale, kv_quant=kind)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5 * float(mag.max()), rtol=1e-4)
    torch.testing.assert_close(paged_decode_attention(q, kq, vq, tables, ctx, scale, kv_quant=kind), ref,
                               atol=1e-5 * float(mag.max()), rtol=1e-4)
    with pytest.raises(ValueError, match="takes"):
        paged_decode_attention_triton(q.to(device), kq[..., :-4].to(device), vq[..., :-4].to(device),
                                      tables.to(device), ctx.to(device), scale, kv_quant=kind)
