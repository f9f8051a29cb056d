"""Pack / unpack a request's KV blocks through a contiguous staging buffer (heterogeneous TP).

When prefill TP != decode TP, each KV head lives on a different rank on the two sides,
so blocks cannot be copied block-to-block. Instead, per layer:

* prefill rank ``r`` (of ``src_tp``) packs its head slice of the request's blocks into its
  part of one contiguous staging region (:func:`pack_kv`);
* one NIXL write moves the whole region (all prefill ranks' parts) to the decode side;
* decode rank ``q`` (of ``dst_tp``) scatters its head slice out of it into its own paged
  cache (:func:`unpack_kv`).

Staging layout of one request and one layer (row-major, ``n`` = the request's blocks,
``Hs = num_kv_heads // src_tp``)::

    [src_tp, 2 (K, V), n, block_size, Hs, head_dim]

so prefill rank ``r``'s part ``[2, n, block_size, Hs, head_dim]`` is contiguous (on a GPU
build each rank can write its own part), and KV head ``g`` of the model is found in part
``g // Hs`` at head ``g % Hs``. Decode rank ``q`` holds heads
``[q * Hd, (q + 1) * Hd)`` with ``Hd = num_kv_heads // dst_tp``; that range may span
several prefill parts (2 -> 1) or lie inside one (1 -> 2).

Triton kernels for CUDA tensors, torch references everywhere else (the engine's CPU
path). Both are plain copies: no dtype conversion. Source of the idea: DistServe /
vLLM's ``NixlConnector`` heterogeneous-TP handling; the kernels are epd's own.
"""

from __future__ import annotations

import torch

from .triton_support import interpret_mode, next_pow2, triton_importable

__all__ = ["pack_kv", "pack_kv_ref", "pack_kv_triton", "unpack_kv", "unpack_kv_ref", "unpack_kv_triton",
           "staging_shape"]


def staging_shape(src_tp: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, ...]:
    """Shape of one request's staging region for one layer:
    ``(src_tp, 2, num_blocks, block_size, num_kv_heads // src_tp, head_dim)``.

    Raises:
        ValueError: ``src_tp`` does not divide ``num_kv_heads``.
    """
    if src_tp < 1 or num_kv_heads % src_tp:
        raise ValueError(f"TP {src_tp} does not divide the {num_kv_heads} KV heads")
    return (src_tp, 2, num_blocks, block_size, num_kv_heads // src_tp, head_dim)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache/v_cache must be equal [num_blocks, block_size, heads, head_dim], "
                         f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")


def _check_ids(block_ids: torch.Tensor, num_blocks: int) -> None:
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be [n] int32/int64, got {tuple(block_ids.shape)} {block_ids.dtype}")
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks):
        raise ValueError(f"block id out of range [0, {num_blocks})")


def _check_pack(k_cache, v_cache, block_ids, out) -> None:
    _check_cache(k_cache, v_cache)
    _check_ids(block_ids, k_cache.shape[0])
    want = (2, block_ids.numel(), *k_cache.shape[1:])
    if tuple(out.shape) != want or out.dtype != k_cache.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {want} {k_cache.dtype}, got {tuple(out.shape)} {out.dtype}")


def _check_unpack(staging, k_cache, v_cache, block_ids, head_start) -> None:
    _check_cache(k_cache, v_cache)
    _check_ids(block_ids, k_cache.shape[0])
    if staging.dim() != 6 or staging.shape[1] != 2 or staging.dtype != k_cache.dtype:
        raise ValueError(f"staging must be [src_tp, 2, n, block_size, heads_per_rank, head_dim] {k_cache.dtype}, "
                         f"got {tuple(staging.shape)} {staging.dtype}")
    src_tp, _, n, bs, hs, d = staging.shape
    if n != block_ids.numel() or bs != k_cache.shape[1] or d != k_cache.shape[3]:
        raise ValueError(f"staging {tuple(staging.shape)} does not match {block_ids.numel()} blocks of cache "
                         f"{tuple(k_cache.shape)}")
    if not 0 <= head_start or head_start + k_cache.shape[2] > src_tp * hs:
        raise ValueError(f"heads [{head_start}, {head_start + k_cache.shape[2]}) outside the {src_tp * hs} "
                         f"staged KV heads")


def pack_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Gather blocks of one layer of one TP rank's cache into ``out`` (torch reference).

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, heads_of_rank, head_dim]``, one dtype.
        block_ids: ``[n]`` int32/int64, the request's blocks in order.
        out: ``[2, n, block_size, heads_of_rank, head_dim]``, contiguous, cache dtype: this
            rank's part of the staging region; ``out[0, i] = k_cache[block_ids[i]]``,
            ``out[1, i] = v_cache[block_ids[i]]``.

    Raises:
        ValueError: shapes, dtypes or block ids that do not fit.
    """
    _check_pack(k_cache, v_cache, block_ids, out)
    ids = block_ids.to(device=k_cache.device, dtype=torch.long)
    torch.index_select(k_cache, 0, ids, out=out[0])
    torch.index_select(v_cache, 0, ids, out=out[1])


def unpack_kv_ref(staging: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                  head_start: int) -> None:
    """Scatter KV heads ``[head_start, head_start + heads_of_rank)`` of a staging region
    into one layer of one TP rank's paged cache (torch reference).

    Args:
        staging: ``[src_tp, 2, n, block_size, Hs, head_dim]`` (see the module docstring);
            any strides.
        k_cache, v_cache: ``[num_blocks, block_size, heads_of_rank, head_dim]``, the
            staging dtype; written in place at ``block_ids``.
        block_ids: ``[n]`` int32/int64, destination block of each staged block.
        head_start: first model KV head this rank holds (``rank * heads_of_rank``).

    Raises:
        ValueError: shapes, dtypes, block ids or head range that do not fit.
    """
    _check_unpack(staging, k_cache, v_cache, block_ids, head_start)
    src_tp, hs = staging.shape[0], staging.shape[4]
    head_end = head_start + k_cache.shape[2]
    ids = block_ids.to(device=k_cache.device, dtype=torch.long)
    for r in range(src_tp):  # the prefill ranks' parts that hold some of our heads
        lo, hi = max(head_start, r * hs), min(head_end, (r + 1) * hs)
        if lo >= hi:
            continue
        part = staging[r, :, :, :, lo - r * hs:hi - r * hs]  # [2, n, block_size, hi - lo, head_dim]
        k_cache[:, :, lo - head_start:hi - head_start].index_copy_(0, ids, part[0])
        v_cache[:, :, lo - head_start:hi - head_start].index_copy_(0, ids, part[1])


# --------------------------------------------------------------------------- Triton

triton = None  # bound by _get_kernels(): jitted code resolves triton.language through module globals
tl = None
_KERNELS: dict[bool, tuple] = {}


def _get_kernels():
    """Build (once per interpret mode, see ``store_kv._get_kernel``) the two kernels."""
    global triton, tl
    mode = interpret_mode()
    kernels = _KERNELS.get(mode)
    if kernels is not None:
        return kernels

    import triton
    import triton.language as tl

    @triton.jit
    def _pack_kernel(k_ptr, v_ptr, ids_ptr, out_ptr, n, cache_sb, block_elems, BLOCK: tl.constexpr):
        # One program per block: copy its K and V ([block_size, heads, head_dim], contiguous)
        # to out[0, i] and out[1, i].
        i = tl.program_id(0).to(tl.int64)
        blk = tl.load(ids_ptr + i).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        for start in range(0, block_elems, BLOCK):
            o = start + offs
            m = o < block_elems
            k = tl.load(k_ptr + blk * cache_sb + o, mask=m)
            v = tl.load(v_ptr + blk * cache_sb + o, mask=m)
            tl.store(out_ptr + i * block_elems + o, k, mask=m)
            tl.store(out_ptr + (n + i) * block_elems + o, v, mask=m)

    @triton.jit
    def _unpack_kernel(st_ptr, k_ptr, v_ptr, ids_ptr,
                       st_sr, st_skv, st_sb, st_st, st_sh, st_sd,  # staging strides
                       cache_sb, cache_st, cache_sh,               # cache strides (head_dim contiguous)
                       block_size, heads, heads_src, head_start, head_dim,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program per block: for every (token, head) row of this rank, copy head_dim
        # elements of K and V from the staging part that holds that head.
        i = tl.program_id(0).to(tl.int64)
        blk = tl.load(ids_ptr + i).to(tl.int64)
        rows = tl.arange(0, BLOCK_R)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        num_rows = block_size * heads
        for r0 in range(0, num_rows, BLOCK_R):
            r = r0 + rows
            t = r // heads
            h = r % heads
            g = head_start + h
            src = (g // heads_src) * st_sr + i * st_sb + t * st_st + (g % heads_src) * st_sh + d * st_sd
            m = (r < num_rows) & (d < head_dim)
            dst = blk * cache_sb + t * cache_st + h * cache_sh + d
            tl.store(k_ptr + dst, tl.load(st_ptr + src, mask=m), mask=m)
            tl.store(v_ptr + dst, tl.load(st_ptr + st_skv + src, mask=m), mask=m)

    _KERNELS[mode] = (_pack_kernel, _unpack_kernel)
    return _KERNELS[mode]


def pack_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Triton version of :func:`pack_kv_ref` (same arguments); one program per block.
    The caches must be contiguous per block (a layer slice of the engine's cache is)."""
    _check_pack(k_cache, v_cache, block_ids, out)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.stride() != v_cache.stride():
        raise ValueError("pack_kv_triton needs contiguous k_cache and v_cache")
    n = block_ids.numel()
    if n == 0:
        return
    block_elems = k_cache[0].numel()
    pack, _ = _get_kernels()
    pack[(n,)](k_cache, v_cache, block_ids, out, n, k_cache.stride(0), block_elems,
               BLOCK=min(1024, next_pow2(block_elems)))


def unpack_kv_triton(staging: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                     head_start: int) -> None:
    """Triton version of :func:`unpack_kv_ref` (same arguments); one program per block.
    The caches' head_dim must be contiguous and their strides equal."""
    _check_unpack(staging, k_cache, v_cache, block_ids, head_start)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("unpack_kv_triton needs k_cache and v_cache with equal strides and contiguous head_dim")
    n = block_ids.numel()
    if n == 0:
        return
    _, block_size, heads_of_rank, head_dim = k_cache.shape
    block_d = next_pow2(head_dim)
    _, unpack = _get_kernels()
    unpack[(n,)](staging, k_cache, v_cache, block_ids,
                 *staging.stride(),
                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                 block_size, heads_of_rank, staging.shape[4], head_start, head_dim,
                 BLOCK_R=max(1, min(next_pow2(block_size * heads_of_rank), 4096 // block_d)), BLOCK_D=block_d)


def _use_triton(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and triton_importable()


def pack_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Pack blocks into a staging part: Triton on CUDA, else :func:`pack_kv_ref` (same contract).
    A head slice of a cache (``k_cache[:, :, h0:h1]``, per-rank agents splitting a rank's
    heads over several decode ranks) is not contiguous: it takes the torch path on CUDA too."""
    if _use_triton(k_cache, v_cache, block_ids, out) and k_cache.is_contiguous() and v_cache.is_contiguous():
        pack_kv_triton(k_cache, v_cache, block_ids, out)
    else:
        pack_kv_ref(k_cache, v_cache, block_ids, out)


def unpack_kv(staging: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
              head_start: int) -> None:
    """Unpack a rank's heads from a staging region: Triton on CUDA, else :func:`unpack_kv_ref`."""
    if _use_triton(staging, k_cache, v_cache, block_ids):
        unpack_kv_triton(staging, k_cache, v_cache, block_ids, head_start)
    else:
        unpack_kv_ref(staging, k_cache, v_cache, block_ids, head_start)
