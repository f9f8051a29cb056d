"""store_kvcache: torch reference vs a plain per-token loop, Triton vs the reference."""

import importlib.util

import pytest
import torch

from epd.kernels import store_kvcache, store_kvcache_ref, store_kvcache_triton

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")


def naive_store(key, value, k_cache, v_cache, slot_mapping):
    """One token at a time, exactly as the contract reads."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = value[t].to(v_cache.dtype)


def make_case(num_tokens, num_blocks, block_size, num_heads, head_dim, dtype, cache_dtype,
              slot_dtype, device, num_skipped=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    skipped = torch.randperm(num_tokens, generator=g)[:num_skipped]
    slots[skipped] = -1
    # Start from non-zero content so untouched slots are checked too.
    k_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=g).to(cache_dtype)
    to = dict(device=device)
    return (key.to(**to), value.to(**to), k_cache.to(**to), v_cache.to(**to),
            slots.to(device=device, dtype=slot_dtype))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_naive(block_size, slot_dtype, dtype):
    key, value, kc, vc, slots = make_case(40, 12, block_size, 2, 16, dtype, dtype, slot_dtype, "cpu")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kvcache_ref(key, value, kc_ref, vc_ref, slots)
    naive_store(key, value, kc, vc, slots)
    assert torch.equal(kc_ref, kc) and torch.equal(vc_ref, vc)


def test_ref_only_writes_valid_slots():
    key, value, kc, vc, slots = make_case(20, 6, 16, 2, 8, torch.float32, torch.float32,
                                          torch.int64, "cpu", num_skipped=20)
    before_k, before_v = kc.clone(), vc.clone()
    store_kvcache_ref(key, value, kc, vc, slots)  # every slot is -1
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)
    store_kvcache_ref(key[:0], value[:0], kc, vc, slots[:0])  # no tokens at all
    assert torch.equal(kc, before_k)


def test_ref_noncontiguous_inputs_and_cache_view():
    # key/value as column slices of a fused qkv projection; caches as views of a
    # [2, num_blocks, ...] buffer (one layer of a kv cache tensor).
    g = torch.Generator().manual_seed(1)
    T, H, D, NB, BS = 24, 2, 8, 5, 8
    qkv = torch.randn(T, 4 * H * D, generator=g)
    key = qkv[:, 2 * H * D:3 * H * D].view(T, H, D)
    value = qkv[:, 3 * H * D:].view(T, H, D)
    assert not key.is_contiguous()
    buf = torch.zeros(2, NB, BS, H, D)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    store_kvcache_ref(key, value, buf[0], buf[1], slots)
    kc, vc = torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, D)
    naive_store(key, value, kc, vc, slots)
    assert torch.equal(buf[0], kc) and torch.equal(buf[1], vc)


def test_dispatch_on_cpu_uses_reference():
    key, value, kc, vc, slots = make_case(10, 4, 8, 2, 8, torch.float32, torch.float32,
                                          torch.int64, "cpu")
    kc2, vc2 = kc.clone(), vc.clone()
    store_kvcache(key, value, kc, vc, slots)
    naive_store(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_triton
@pytest.mark.parametrize(
    "block_size,num_heads,head_dim,dtype,cache_dtype,slot_dtype",
    [
        (16, 2, 64, torch.float32, torch.float32, torch.int64),
        (8, 4, 32, torch.float32, torch.float32, torch.int32),
        (16, 3, 40, torch.float32, torch.float32, torch.int64),   # non-power-of-two H and D
        (16, 2, 64, torch.float16, torch.float16, torch.int64),
        (8, 2, 64, torch.bfloat16, torch.bfloat16, torch.int32),
        (16, 2, 64, torch.float32, torch.bfloat16, torch.int64),  # cast on store (RTNE)
    ],
)
def test_triton_matches_ref(device, block_size, num_heads, head_dim, dtype, cache_dtype, slot_dtype):
    key, value, kc, vc, slots = make_case(48, 10, block_size, num_heads, head_dim, dtype,
                                          cache_dtype, slot_dtype, device, num_skipped=5)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kvcache_ref(key, value, kc_ref, vc_ref, slots)
    store_kvcache_triton(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref)
    assert torch.equal(vc, vc_ref)


@needs_triton
def test_triton_noncontiguous_key_value(device):
    g = torch.Generator().manual_seed(2)
    T, H, D, NB, BS = 30, 2, 16, 6, 8
    qkv = torch.randn(T, 4 * H * D, generator=g).to(device)
    key = qkv[:, 2 * H * D:3 * H * D].view(T, H, D)
    value = qkv[:, 3 * H * D:].view(T, H, D)
    slots = torch.randperm(NB * BS, generator=g)[:T].to(device)
    slots[::7] = -1
    buf = torch.zeros(2, NB, BS, H, D, device=device)
    ref = buf.clone()
    store_kvcache_triton(key, value, buf[0], buf[1], slots)
    store_kvcache_ref(key, value, ref[0], ref[1], slots)
    assert torch.equal(buf, ref)


@needs_triton
def test_kernel_is_built_for_current_interpret_mode(device):
    from epd.kernels import store_kv

    kernel = store_kv._get_kernel()
    if device == "cpu":
        assert type(kernel).__name__ == "InterpretedFunction"
    else:
        assert type(kernel).__name__ == "JITFunction"
