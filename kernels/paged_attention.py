"""Attention over the paged KV cache: decode (one query per sequence) and chunked prefill.

Decode has a Triton kernel for CUDA tensors and a batched torch reference; prefill is torch.
A quantized cache (``kv_quant``, ``epd.kernels.kv_quant``: uint8 rows of codes then scales)
is read in place by the Triton kernel, which dequantizes each row as it loads it; the
reference dequantizes the blocks the step reads first (``dequantize_blocks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .triton_support import interpret_mode, next_pow2, triton_importable

if TYPE_CHECKING:
    from epd.kernels.kv_quant import KResidual

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "paged_prefill_attention_ref",
]


def _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, kv_quant=None, int8_only=False) -> None:
    if int8_only and kv_quant != "int8":
        raise ValueError(f"per-channel K blocks and a K residual are an int8 layout, got kv_quant={kv_quant!r}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] "
                         f"and equal, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if kv_quant is not None:
        from epd.kernels.kv_quant import KV_QUANT, scale_bytes

        if kv_quant not in KV_QUANT or k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8:
            raise ValueError(f"a {kv_quant!r} cache must be uint8 rows, got {k_cache.dtype} / {v_cache.dtype}")
        if k_cache.shape[3] != head_dim + scale_bytes(head_dim):
            raise ValueError(f"a {kv_quant} cache row of head_dim {head_dim} takes "
                             f"{head_dim + scale_bytes(head_dim)} bytes, got {k_cache.shape[3]}")
    elif k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim}, cache {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_num_blocks], "
                         f"got {tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens must be [num_seqs={num_seqs}], got {tuple(context_lens.shape)}")


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Decode attention over a paged KV cache, batched torch reference.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``, one query token per sequence (fp32/fp16/bf16).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``. GQA:
            ``num_heads % num_kv_heads == 0`` and query head ``h`` reads kv head
            ``h // (num_heads // num_kv_heads)``.
        block_tables: ``[num_seqs, max_num_blocks]`` int32 (int64 fine). Only the first
            ``ceil(context_lens[i] / block_size)`` entries of row ``i`` are read; later
            entries may hold anything (-1, 0, stale ids).
        context_lens: ``[num_seqs]`` int32, valid tokens per sequence (>= 1), the current
            token included (already stored in the cache).
        scale: softmax scale (usually ``head_dim ** -0.5``).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``; scores, softmax and the weighted
        sum are computed in fp32.

    Same contract as vLLM's ``paged_attention_v1`` (csrc/attention) and nano-vllm's decode
    path (``flash_attn_with_kvcache`` with ``block_table``). Sequences are gathered
    together (``k_cache[block_tables]`` -> ``[B, blocks*block_size, Hkv, D]``, padded to the
    longest context; in chunks of a few MiB for long contexts), upcast to fp32, and fed to
    ``F.scaled_dot_product_attention`` with a length mask and ``enable_gqa``.
    """
    _check_decode_args(q, k_cache, v_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    device = k_cache.device
    if num_seqs == 0:
        return torch.empty_like(q)

    ctx = context_lens.to(device=device, dtype=torch.long)
    max_ctx = int(ctx.max())
    # Gather in chunks of sequences: one huge gather is slower on CPU (fresh pages, no
    # cache reuse) than a few small ones, and peak memory stays bounded.
    seq_bytes = -(-max_ctx // block_size) * block_size * num_kv_heads * head_dim * 4
    rows = max(1, _DECODE_CHUNK_BYTES // max(1, seq_bytes))
    if rows >= num_seqs:
        return _decode_chunk(q, k_cache, v_cache, block_tables, ctx, scale)
    out = torch.empty_like(q)
    for start in range(0, num_seqs, rows):
        end = min(num_seqs, start + rows)
        out[start:end] = _decode_chunk(q[start:end], k_cache, v_cache, block_tables[start:end],
                                       ctx[start:end], scale)
    return out


_DECODE_CHUNK_BYTES = 16 << 20  # gathered fp32 K per chunk in the decode reference


def _decode_chunk(q, k_cache, v_cache, block_tables, ctx, scale) -> torch.Tensor:
    """Decode attention for a few sequences at once; ``ctx`` is int64 on the cache device."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    device = k_cache.device
    max_ctx = int(ctx.max())
    num_blocks = max(1, -(-max_ctx // block_size))
    tables = block_tables[:, :num_blocks].to(device=device, dtype=torch.long)
    # Entries past each sequence's last block are garbage: point them at block 0.
    needed = (torch.arange(num_blocks, device=device) * block_size)[None, :] < ctx[:, None]
    tables = torch.where(needed, tables, torch.zeros_like(tables))
    max_tokens = num_blocks * block_size

    # [B, nblk, bs, Hkv, D] -> [B, T, Hkv, D] -> (view) [B, Hkv, T, D], fp32
    valid = torch.arange(max_tokens, device=device)[None, :] < ctx[:, None]  # [B, T]
    k = k_cache[tables].view(num_seqs, max_tokens, num_kv_heads, head_dim)
    v = v_cache[tables].view(num_seqs, max_tokens, num_kv_heads, head_dim)
    # Slots past the context may hold anything (stale data, NaN from torch.empty): zero
    # them in the fresh gathered copies, since a masked score does not mask 0 * NaN.
    pad = ~valid[:, :, None, None]
    k.masked_fill_(pad, 0)
    v.masked_fill_(pad, 0)
    k = k.transpose(1, 2).to(torch.float32)
    v = v.transpose(1, 2).to(torch.float32)
    qf = q.to(device=device, dtype=torch.float32).unsqueeze(2)  # [B, H, 1, D]
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=valid[:, None, None, :],
                                         scale=float(scale),
                                         enable_gqa=num_heads != num_kv_heads)
    out = out.squeeze(2)
    if bool((ctx <= 0).any()):  # empty context: zeros (as the Triton kernel), not NaN
        out = torch.where((ctx > 0)[:, None, None], out, torch.zeros_like(out))
    return out.to(device=q.device, dtype=q.dtype)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, context_len: int,
                                scale: float) -> torch.Tensor:
    """Causal attention of one sequence's chunk of new tokens over its paged cache (torch).

    Args:
        q: ``[num_new_tokens, num_heads, head_dim]``: queries for absolute positions
            ``context_len - num_new_tokens ... context_len - 1``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the new
            tokens' K/V are already stored, as are the ``context_len - num_new_tokens``
            earlier (prefix-cached or previous-chunk) tokens. GQA as in decode.
        block_table: ``[num_blocks_of_seq]`` int32, this sequence's blocks only; entries past
            ``ceil(context_len / block_size)`` are ignored.
        context_len: int (or 0-d tensor), all tokens of the sequence so far, new ones included.
        scale: softmax scale.

    Returns:
        ``[num_new_tokens, num_heads, head_dim]`` in ``q.dtype``. Query ``i`` attends to key
        positions ``<= context_len - num_new_tokens + i``; computed in fp32 with
        ``F.scaled_dot_product_attention`` (boolean causal-with-offset mask, ``enable_gqa``).

    Matches chunked prefill in vLLM (``context_attention_fwd`` /
    ``flash_attn_varlen_func`` with ``block_table``) and nano-vllm's prefix-cache prefill.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_new_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and equal")
    num_new, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    context_len = int(context_len)
    if num_new > context_len:
        raise ValueError(f"num_new_tokens={num_new} > context_len={context_len}")
    if num_new == 0:
        return torch.empty_like(q)
    device = k_cache.device
    num_blocks = -(-context_len // block_size)
    if block_table.shape[0] < num_blocks:
        raise ValueError(f"block_table has {block_table.shape[0]} blocks, context_len={context_len} "
                         f"needs {num_blocks}")
    table = block_table[:num_blocks].to(device=device, dtype=torch.long)
    k = k_cache[table].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:context_len]
    v = v_cache[table].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:context_len]

    q_pos = torch.arange(context_len - num_new, context_len, device=device)
    k_pos = torch.arange(context_len, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]  # [n, T]; every row has key 0

    qf = q.to(device=device, dtype=torch.float32).transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kf = k.to(torch.float32).transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
    vf = v.to(torch.float32).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=float(scale),
                                         enable_gqa=num_heads != num_kv_heads)
    return out[0].transpose(0, 1).to(device=q.device, dtype=q.dtype)


# --------------------------------------------------------------------------- Triton

# Bound by _get_kernel(): jitted code must see triton.language as a module global (the
# interpreter resolves names through the kernel's globals, not its closure).
triton = None
tl = None
_SUM = None  # combine functions for tl.reduce
_MAX = None
_KERNELS: dict[bool, object] = {}


def _get_kernel():
    """Build (once per interpret mode) and return the jitted decode kernel.

    Triton picks compiled vs interpreted when ``@triton.jit`` runs, so the kernel is
    defined lazily (importing this module never imports triton). The kernel avoids
    triton's own ``@jit`` helpers (``tl.sum``, ``tl.max``, ``tl.cdiv``, ``tl.zeros``): they
    are jitted once, when triton is imported, and the interpreter cannot call compiled-mode
    ones -- which is what they are if anything imported triton before
    ``TRITON_INTERPRET=1`` was set. Reductions go through the builtin ``tl.reduce`` with
    triton's standard combine functions instead (the interpreter maps those to numpy).
    """
    global triton, tl, _SUM, _MAX
    mode = interpret_mode()
    kernel = _KERNELS.get(mode)
    if kernel is not None:
        return kernel

    import triton
    import triton.language as tl

    if _SUM is None:
        _SUM = getattr(tl.standard, "_sum_combine", None)
        _MAX = getattr(tl.standard, "_elementwise_max", None)
    if _SUM is None or _MAX is None:  # not expected (present since triton 2.x)

        @triton.jit
        def _sum_combine(a, b):
            return a + b

        @triton.jit
        def _max_combine(a, b):
            return tl.maximum(a, b)

        _SUM, _MAX = _sum_combine, _max_combine

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        scale,
        q_ss, q_sh, q_sd,            # q strides: seq, head, dim
        o_ss, o_sh, o_sd,            # out strides
        kc_sb, kc_so, kc_sh, kc_sd,  # k_cache strides: block, offset, head, dim
        vc_sb, vc_so, vc_sh, vc_sd,  # v_cache strides
        bt_ss, bt_sb,                # block_tables strides
        # HAS_RESID: exact K [rows, block, head, dim]; each sequence's row of it; its first offset
        resid_ptr, resid_rows_ptr, resid_from_ptr,
        rs_r, rs_o, rs_h, rs_d,      # residual strides
        head_dim,
        qgroup,                      # quantized: values per scale group (>= head_dim: one a row)
        cpr,                         # CHANNEL_K: per-channel (scale, min) pairs a row
        GROUP: tl.constexpr,         # query heads per kv head
        BLOCK_G: tl.constexpr,       # next_pow2(GROUP)
        BLOCK_SIZE: tl.constexpr,    # cache block size
        TOKENS: tl.constexpr,        # tokens per step: a power of two dividing BLOCK_SIZE
        BLOCK_D: tl.constexpr,       # next_pow2(head_dim)
        BF16_RTNE: tl.constexpr,     # interpreter only: round fp32 -> bf16 to nearest even
        QUANT: tl.constexpr,         # 0: float cache; 1: int8 rows; 2: fp8_e4m3 rows (kv_quant layout)
        CHANNEL_K: tl.constexpr,     # int8: full K blocks are per channel (kv_quant.quantize_channels)
        HAS_RESID: tl.constexpr,     # CHANNEL_K: the partial last block's K rows from resid_from on are exact
    ):
        # One program per (sequence, kv head): the GROUP query heads sharing that kv head
        # walk the sequence's blocks once, with an online (flash-decoding) softmax in fp32.
        seq = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        offs = tl.arange(0, TOKENS)
        g_mask = g < GROUP
        d_mask = d < head_dim
        heads = kvh * GROUP + g
        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + seq * q_ss + heads[:, None] * q_sh + d[None, :] * q_sd,
                    mask=q_mask, other=0.0).to(tl.float32)
        q = q * scale

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_G], 0.0, tl.float32)
        acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)

        if HAS_RESID:
            rrow = tl.load(resid_rows_ptr + seq).to(tl.int64)
            rfrom = tl.load(resid_from_ptr + seq).to(tl.int32)
            last_blk = (ctx - 1) // BLOCK_SIZE
            last_open = ((ctx - 1) % BLOCK_SIZE) < (BLOCK_SIZE - 1)  # a block the new token filled is per channel

        num_steps = (ctx + TOKENS - 1) // TOKENS
        for i in range(0, num_steps):
            start = i * TOKENS  # TOKENS divides BLOCK_SIZE: a step never straddles blocks
            blk = tl.load(block_tables_ptr + seq * bt_ss + (start // BLOCK_SIZE) * bt_sb).to(tl.int64)
            slot = start % BLOCK_SIZE + offs
            t_mask = (start + offs) < ctx
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k_row = k_cache_ptr + blk * kc_sb + slot[:, None] * kc_so + kvh * kc_sh
            v_row = v_cache_ptr + blk * vc_sb + slot[:, None] * vc_so + kvh * vc_sh
            if QUANT == 0:
                k = tl.load(k_row + d[None, :] * kc_sd, mask=kv_mask, other=0.0).to(tl.float32)
                v = tl.load(v_row + d[None, :] * vc_sd, mask=kv_mask, other=0.0).to(tl.float32)
            else:
                # a row: head_dim codes (bytes, kc_sd == 1), then 4 bytes per group of qgroup
                # values: int8 a float16 scale and a float16 min, fp8 a float32 scale
                kq = tl.load(k_row + d[None, :], mask=kv_mask, other=0)
                vq = tl.load(v_row + d[None, :], mask=kv_mask, other=0)
                meta = head_dim + (d[None, :] // qgroup) * 4
                if QUANT == 1:
                    ks = tl.load((k_row + meta).to(tl.pointer_type(tl.float16)), mask=kv_mask, other=0.0)
                    km = tl.load((k_row + meta + 2).to(tl.pointer_type(tl.float16)), mask=kv_mask, other=0.0)
                    vs = tl.load((v_row + meta).to(tl.pointer_type(tl.float16)), mask=kv_mask, other=0.0)
                    vm = tl.load((v_row + meta + 2).to(tl.pointer_type(tl.float16)), mask=kv_mask, other=0.0)
                    k = kq.to(tl.float32) * ks.to(tl.float32) + km.to(tl.float32)
                    v = vq.to(tl.float32) * vs.to(tl.float32) + vm.to(tl.float32)
                    if CHANNEL_K:
                        # a full block: channel c's (scale, min) at row c // cpr, pair c % cpr
                        full = (start // BLOCK_SIZE + 1) * BLOCK_SIZE <= ctx
                        cptr = k_cache_ptr + blk * kc_sb + (d // cpr) * kc_so + kvh * kc_sh + head_dim + (d % cpr) * 4
                        c_mask = d_mask & full
                        cs = tl.load(cptr.to(tl.pointer_type(tl.float16)), mask=c_mask, other=0.0).to(tl.float32)
                        cm = tl.load((cptr + 2).to(tl.pointer_type(tl.float16)), mask=c_mask, other=0.0).to(tl.float32)
                        k = tl.where(full, kq.to(tl.float32) * cs[None, :] + cm[None, :], k)
                        if HAS_RESID:
                            use = t_mask & (slot >= rfrom) & last_open & ((start // BLOCK_SIZE) == last_blk)
                            r_mask = use[:, None] & d_mask[None, :]
                            r_row = resid_ptr + rrow * rs_r + slot[:, None] * rs_o + kvh * rs_h
                            kr = tl.load(r_row + d[None, :] * rs_d, mask=r_mask, other=0.0).to(tl.float32)
                            k = tl.where(r_mask, kr, k)
                else:
                    ks = tl.load((k_row + meta).to(tl.pointer_type(tl.float32)), mask=kv_mask, other=0.0)
                    vs = tl.load((v_row + meta).to(tl.pointer_type(tl.float32)), mask=kv_mask, other=0.0)
                    k = kq.to(tl.float8e4nv, bitcast=True).to(tl.float32) * ks
                    v = vq.to(tl.float8e4nv, bitcast=True).to(tl.float32) * vs
            # scores [BLOCK_G, TOKENS] by broadcast-multiply-reduce (no tl.dot: it needs
            # every dim >= 16, and GROUP / block_size may be smaller).
            s = tl.reduce(q[:, None, :] * k[None, :, :], 2, _SUM)
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
            acc = acc * alpha[:, None] + tl.reduce(p[:, :, None] * v[None, :, :], 1, _SUM)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        if BF16_RTNE:
            # The interpreter truncates on fp32 -> bf16 casts (GPUs round to nearest even):
            # round the bits here so the cast below is exact.
            bits = out.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            out = bits.to(tl.float32, bitcast=True)
        tl.store(out_ptr + seq * o_ss + heads[:, None] * o_sh + d[None, :] * o_sd,
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)

    _KERNELS[mode] = _paged_decode_kernel
    return _paged_decode_kernel


_MAX_TILE = 4096  # fp32 elements of one [BLOCK_G, TOKENS, BLOCK_D] product in the kernel


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, kv_quant: str | None = None, channel_k: bool = False,
                                  resid: KResidual | None = None) -> torch.Tensor:
    """Triton version of :func:`paged_decode_attention_ref` (same arguments and result, for a
    quantized cache those of the reference on the dequantized cache: see below).

    Grid ``(num_seqs, num_kv_heads)``: each program serves the ``num_heads // num_kv_heads``
    query heads of one kv head, walks the sequence's cache blocks (a whole power-of-two
    block per step, or a power-of-two part of it for wide head groups / odd block sizes)
    and keeps an online softmax in fp32, as vLLM's ``paged_attention_v1`` /
    flash-decoding do without the split over the context. Any head_dim and block_size
    work (masked to the next power of two); inputs of any float dtype are upcast to fp32
    in the kernel; any strides. On CPU tensors it runs only under ``TRITON_INTERPRET=1``.

    ``kv_quant`` ("int8", "fp8_e4m3"): the caches are ``[num_blocks, block_size,
    num_kv_heads, head_dim + scale_bytes(head_dim)]`` uint8 rows (``epd.kernels.kv_quant``,
    contiguous rows); each K/V row is dequantized to fp32 as it is loaded (int8
    ``code x scale + min``, fp8 ``value x scale``), so the result equals attention over the
    dequantized cache up to fp32 rounding. ``channel_k`` (int8): the K blocks a sequence
    fills are per channel (``kv_quant.quantize_channels``), and ``resid`` (a
    ``kv_quant.KResidual``) holds exact K rows of each sequence's partial last block,
    read in place of the stored ones (``kv_quant.overlay_residual``).

    Raises:
        ValueError: shapes or dtypes that do not fit (a quantized row of another length).
    """
    _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, kv_quant, channel_k or resid is not None)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    quant = {None: 0, "int8": 1, "fp8_e4m3": 2}[kv_quant]
    if quant and (k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or head_dim % 4):
        raise ValueError(f"a quantized cache needs contiguous rows and head_dim % 4 == 0 (aligned scales), "
                         f"got strides {k_cache.stride()} and head_dim {head_dim}")
    from epd.kernels.kv_quant import GROUP as QGROUP
    from epd.kernels.kv_quant import scale_bytes

    qgroup = QGROUP if head_dim % QGROUP == 0 else max(head_dim, 1)
    group = num_heads // num_kv_heads
    block_g, block_d = next_pow2(group), next_pow2(head_dim)
    # Tokens per step: the largest power of two dividing block_size (all of it for the
    # usual power-of-two sizes), shrunk so the [BLOCK_G, TOKENS, BLOCK_D] fp32 products stay
    # within _MAX_TILE elements (no register spills with 4 warps; checked with ptxas for sm_90).
    tokens = block_size & -block_size
    while tokens > 1 and block_g * tokens * block_d > _MAX_TILE:
        tokens //= 2
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    kernel = _get_kernel()
    kernel[(num_seqs, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens,
        float(scale),
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), block_tables.stride(1),
        *((resid.k, resid.rows, resid.start, *resid.k.stride()) if resid is not None
          else (k_cache, context_lens, context_lens, 0, 0, 0, 0)),
        head_dim, qgroup, max(1, scale_bytes(head_dim) // 4),
        GROUP=group, BLOCK_G=block_g, BLOCK_SIZE=block_size, TOKENS=tokens, BLOCK_D=block_d,
        BF16_RTNE=interpret_mode() and q.dtype == torch.bfloat16, QUANT=quant,
        CHANNEL_K=bool(channel_k), HAS_RESID=resid is not None,
    )
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, kv_quant: str | None = None, channel_k: bool = False,
                           resid: KResidual | None = None) -> torch.Tensor:
    """Paged decode attention: Triton when all tensors are on CUDA and triton imports, else
    :func:`paged_decode_attention_ref`. q ``[num_seqs, num_heads, head_dim]``, caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, block_tables
    ``[num_seqs, max_num_blocks]`` int32, context_lens ``[num_seqs]`` int32; returns
    ``[num_seqs, num_heads, head_dim]`` in q's dtype (vLLM ``paged_attention_v1`` contract).
    On the CPU (fp32 / bf16), the in-place kernel of ``epd.kernels.cpu_attention`` when it
    is built, else the reference.

    ``kv_quant`` ("int8", "fp8_e4m3"): the caches are quantized uint8 rows
    (``epd.kernels.kv_quant``); the Triton kernel reads them in place, the other paths
    dequantize the blocks the step reads (``dequantize_blocks``) and attend to those;
    ``channel_k`` and ``resid``: as :func:`paged_decode_attention_triton`."""
    if (q.is_cuda and k_cache.is_cuda and v_cache.is_cuda and block_tables.is_cuda
            and context_lens.is_cuda and triton_importable() and (kv_quant is None or q.shape[-1] % 4 == 0)):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, kv_quant,
                                             channel_k, resid)
    if kv_quant is not None:
        from epd.kernels.kv_quant import dequantize_blocks, overlay_residual

        _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, kv_quant,
                           channel_k or resid is not None)
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, block_tables, kv_quant, q.dtype,
                                                           context_lens if channel_k else None)
        if resid is not None:
            overlay_residual(k_cache, block_tables, context_lens, resid)
    if (not q.is_cuda and not k_cache.is_cuda and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype == q.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()):
        from epd.kernels import cpu_attention

        if cpu_attention.load() is not None:
            return cpu_attention.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)

