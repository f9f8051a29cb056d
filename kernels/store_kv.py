"""Write new tokens' keys and values into the paged KV cache (slot-mapped scatter).

Triton kernel for CUDA tensors, torch reference everywhere else.
"""

from __future__ import annotations

import torch

from .triton_support import interpret_mode, next_pow2, triton_importable

__all__ = ["store_kvcache", "store_kvcache_ref", "store_kvcache_triton"]


def _check_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must be [num_tokens, num_kv_heads, head_dim] and equal, "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] "
                         f"and equal, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match key "
                         f"{tuple(key.shape[1:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` rows into the paged caches, in place (torch reference).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the
            cache dtype on write).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype;
            any strides (written through advanced indexing, never through a copy).
        slot_mapping: ``[num_tokens]`` int64 or int32. Token ``t`` goes to block
            ``slot // block_size``, offset ``slot % block_size``; ``slot < 0`` skips it
            (padding). Duplicate slots give an unspecified winner.

    Semantics follow vLLM's ``reshape_and_cache`` (csrc/cache_kernels.cu) and nano-vllm's
    ``store_kvcache`` (nanovllm/layers/attention.py). No Python loop over tokens.
    """
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    key = key.to(device=k_cache.device, dtype=k_cache.dtype)
    value = value.to(device=v_cache.device, dtype=v_cache.dtype)
    if bool((slots < 0).any()):
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


# --------------------------------------------------------------------------- Triton

# Bound by _get_kernel(): jitted code must see triton.language as a module global (the
# interpreter resolves names through the kernel's globals, not its closure).
triton = None
tl = None
_KERNELS: dict[bool, object] = {}


def _get_kernel():
    """Build (once per interpret mode) and return the jitted store kernel.

    Triton decides between compiled and interpreted functions when ``@triton.jit`` runs,
    so the kernel is defined here, lazily, instead of at import time: importing this
    module never imports triton, and setting ``TRITON_INTERPRET=1`` any time before the
    first launch takes effect. The kernel uses builtins only (no triton ``@jit`` helpers
    such as ``tl.zeros``), so it also runs in the interpreter when triton itself was
    imported before ``TRITON_INTERPRET=1`` was set.
    """
    global triton, tl
    mode = interpret_mode()
    kernel = _KERNELS.get(mode)
    if kernel is not None:
        return kernel

    import triton
    import triton.language as tl

    @triton.jit
    def _store_kvcache_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        k_st, k_sh, k_sd,            # key strides: token, head, dim
        v_st, v_sh, v_sd,            # value strides
        kc_sb, kc_so, kc_sh, kc_sd,  # k_cache strides: block, offset, head, dim
        vc_sb, vc_so, vc_sh, vc_sd,  # v_cache strides
        block_size, num_heads, head_dim,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16_RTNE: tl.constexpr,     # interpreter only: round fp32 -> bf16 to nearest even
    ):
        # One program per token: copy its num_heads x head_dim key and value rows.
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot < 0:
            return
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_heads) & (d < head_dim)
        k = tl.load(key_ptr + tok * k_st + h * k_sh + d * k_sd, mask=mask)
        v = tl.load(value_ptr + tok * v_st + h * v_sh + d * v_sd, mask=mask)
        if BF16_RTNE:
            # The interpreter truncates on fp32 -> bf16 casts (GPUs round to nearest even):
            # round the bits here so the cast below is exact.
            kb = k.to(tl.float32).to(tl.uint32, bitcast=True)
            kb = ((kb + 0x7FFF + ((kb >> 16) & 1)) >> 16) << 16
            k = kb.to(tl.float32, bitcast=True)
            vb = v.to(tl.float32).to(tl.uint32, bitcast=True)
            vb = ((vb + 0x7FFF + ((vb >> 16) & 1)) >> 16) << 16
            v = vb.to(tl.float32, bitcast=True)
        kc = k_cache_ptr + blk * kc_sb + off * kc_so + h * kc_sh + d * kc_sd
        vc = v_cache_ptr + blk * vc_sb + off * vc_so + h * vc_sh + d * vc_sd
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    _KERNELS[mode] = _store_kvcache_kernel
    return _store_kvcache_kernel


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of :func:`store_kvcache_ref` (same arguments, shapes and dtypes).

    One program per token; a token whose slot is negative returns at once. Each program
    copies ``num_kv_heads * head_dim`` elements for K and for V (masked to the next power
    of two, so any head count and head_dim work), casting to the cache dtype. All strides
    are passed, so non-contiguous views are fine. Modelled on nano-vllm's
    ``store_kvcache_kernel`` and vLLM's ``reshape_and_cache``. On CPU tensors it runs only
    under ``TRITON_INTERPRET=1``.
    """
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernel = _get_kernel()
    kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        k_cache.shape[1], num_heads, head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
        BF16_RTNE=(interpret_mode() and k_cache.dtype == torch.bfloat16
                   and (key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16)),
    )


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store KV into the paged cache in place: Triton when all tensors are on CUDA and
    triton imports, else :func:`store_kvcache_ref`. Shapes/dtypes as in the reference:
    key/value ``[num_tokens, num_kv_heads, head_dim]``, caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, slot_mapping ``[num_tokens]``
    int32/int64 with ``slot < 0`` = skip (vLLM ``reshape_and_cache`` semantics)."""
    if (key.is_cuda and value.is_cuda and k_cache.is_cuda and v_cache.is_cuda
            and slot_mapping.is_cuda and triton_importable()):
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)
