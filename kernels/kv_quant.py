"""Quantized KV cache (``--kv-cache-dtype int8 | fp8_e4m3``): the packed row layout, and
the torch reference kernels that write and read it.

A quantized cache is a byte tensor ``[num_blocks, block_size, num_kv_heads, head_dim + S]``
``uint8``: each (token, head) row holds its ``head_dim`` 1-byte values and then ``S`` =
``scale_bytes(head_dim)`` bytes of scales, 4 per ``GROUP`` (16) values (16 bytes at head_dim
64, so a row takes 80 bytes where fp32 takes 256: 3.2x).

* **Rows** (:func:`quantize_kv`). ``int8`` (asymmetric): each value is
  ``round((x - min) / scale)`` in 0..255, and each group of 16 values stores ``scale =
  (max - min) / 255`` and ``min`` as two float16s (min rounded down and scale up, so every
  code lies in 0..255 and the error stays within half a step; values beyond float16's range
  are clamped). ``fp8_e4m3`` (symmetric): each value is ``x / scale`` as float8 e4m3, and each
  group stores ``scale = absmax / 448`` as one float32. V is always stored this way, and so
  are K's rows of a block that is not yet full, and every K row of fp8.
* **Per-channel K blocks** (int8, ``block_size >= channel_rows(head_dim)``: 16 at head_dim a
  multiple of 16; :func:`channel_k`). When a step fills a K block, the block is rewritten by
  :func:`quantize_channels`: each row keeps its 64 codes, now over its channel's [min, max] in
  the block, and the rows' scale bytes hold the channels' (float16 scale, float16 min) pairs
  in channel order (4 a row at head_dim 64: rows 0-15 hold channels 0-63). K's outlier
  channels (RoPE's slow pairs carry a large, nearly constant value) then no longer stretch
  the steps of the other channels of their row group. The values it quantizes are exact where
  the step has them (its own rows, the residual) and else the rows as stored.
* **The K residual** (:class:`KResidual`). Each decode sequence keeps the exact K of the rows
  its decode steps computed in its open last block (a block of the model's dtype per
  persistent-batch row, on the worker that decodes); decode attention reads those rows from
  it until the block fills (:func:`overlay_residual`). The prompt's rows of that block
  (prefilled here, or on a prefill worker and transferred) stay as stored: the residual
  never travels.

This is KIVI's layout (per-channel K, per-token V, a full-precision window of recent
tokens), kept within the rows' bytes: the blocks a step has filled never change again, so
the prefix cache, the P->D transfer (NIXL, block by block), heterogeneous TP's staging
pack/unpack (head slices: a head's scales sit in its own rows) and migration move bytes,
unchanged. Greedy agreement with a full-precision cache is checked by
tests/engine/test_kv_cache_dtype.py; ``benchmarks/kv_quant_schemes.py`` simulates this layout
(its ``kivi`` equals this cache token for token) and the alternatives.

On CUDA, :func:`store_quantized_triton` quantizes new rows and writes them in one kernel
(byte for byte :func:`quantize_kv`'s result; the per-channel rewrite of filled blocks and the
residual are torch index operations planned on the host, :func:`channel_fill_plan` and
:func:`complete_channel_blocks`, so no step waits on the device), and the Triton decode kernel
(``paged_attention.paged_decode_attention_triton(kv_quant=..., channel_k=..., resid=...)``)
dequantizes rows, per-channel blocks and the residual as it loads them. Elsewhere (and for a
prefill over a cached prefix) attention dequantizes the blocks a step touches into the
model's dtype and runs the full-precision kernels on them (:func:`dequantize_blocks`).

Source: KIVI (Liu et al., 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV
cache": K per channel over groups of tokens, V per token, a full-precision residual of the
latest tokens) and vLLM's fp8 KV cache (``kv_cache_dtype="fp8_e4m3"``, vllm/attention); the
e4m3 range from the OCP FP8 spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_support import interpret_mode, next_pow2, triton_importable

#: the quantized ``kv_cache_dtype`` names -> (storage dtype of the values, qmax): int8 rows
#: are asymmetric uint8 codes 0..255, fp8 rows symmetric e4m3 in [-448, 448]
KV_QUANT = {"int8": (torch.uint8, 255.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
_FP16_MAX = 65504.0
#: values per scale group: a row of head_dim values has head_dim // GROUP groups of 4 bytes each
#: (int8: float16 scale and min; fp8: a float32 scale)
GROUP = 16


def scale_bytes(head_dim: int) -> int:
    """Bytes of a row's scales: 4 per ``GROUP`` values (int8: float16 scale and min; fp8: a
    float32 scale), or 4 for the whole row when ``GROUP`` does not divide ``head_dim``."""
    return 4 * max(1, head_dim // GROUP) if head_dim % GROUP == 0 else 4

def channel_rows(head_dim: int) -> int:
    """Rows of a block whose scale bytes hold one (float16 scale, float16 min) pair per K
    channel in the per-channel layout: ``scale_bytes(head_dim) // 4`` pairs a row."""
    return -(-head_dim // (scale_bytes(head_dim) // 4))


def channel_k(kind: str | None, block_size: int, head_dim: int) -> bool:
    """Whether a cache of ``kind`` keeps full K blocks per channel (module docstring): int8,
    with ``block_size >= channel_rows(head_dim)`` (16 for head_dim a multiple of 16)."""
    return kind == "int8" and block_size >= channel_rows(head_dim)


__all__ = ["GROUP", "KV_QUANT", "ChannelFill", "KResidual", "scale_bytes", "channel_fill_plan", "channel_k",
           "channel_rows", "complete_channel_blocks",
           "dequantize_blocks", "dequantize_channels", "dequantize_kv", "overlay_residual", "quantize_channels",
           "quantize_kv", "store_quantized", "store_quantized_ref", "store_quantized_triton"]


def _round_fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 ``x`` to float16, rounded toward +inf (``up``) or -inf instead of to nearest."""
    h = x.to(torch.float16)
    inf = torch.full_like(h, float("inf") if up else float("-inf"))
    wrong = h.float() < x if up else h.float() > x
    return torch.where(wrong, torch.nextafter(h, inf), h)


def quantize_kv(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Pack K or V rows for a quantized cache.

    Args:
        x: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype.
        kind: a key of :data:`KV_QUANT`.

    Returns:
        ``[num_tokens, num_kv_heads, head_dim + scale_bytes(head_dim)]`` uint8: the values,
        then each group's scale bytes (module docstring). A constant group (all zeros
        included) has scale 0 and decodes exactly to its value (int8) or to zeros (fp8).

    Raises:
        KeyError: an unknown ``kind``.
    """
    store, qmax = KV_QUANT[kind]
    d = x.shape[-1]
    groups = scale_bytes(d) // 4
    xf = x.to(torch.float32).reshape(*x.shape[:-1], groups, d // groups)
    out = torch.empty(*x.shape[:-1], d + 4 * groups, dtype=torch.uint8, device=x.device)
    if store == torch.uint8:  # asymmetric: codes 0..255 over [min, max], float16 scale and min
        xf = xf.clamp(-_FP16_MAX, _FP16_MAX)
        # min rounded down and scale rounded up to float16, so every code lies in 0..255 and
        # the error stays within half a step (no clamping at the group's ends)
        lo = _round_fp16(xf.amin(dim=-1, keepdim=True), up=False)
        scale = _round_fp16((xf.amax(dim=-1, keepdim=True) - lo.float()) / qmax, up=True)
        s = scale.float()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.where(s > 0, (xf - lo.float()) / safe, torch.zeros_like(xf)).round().clamp(0, qmax)
        out[..., :d] = q.to(torch.uint8).reshape(*x.shape[:-1], d)
        meta = torch.cat([scale, lo], dim=-1)  # [T, H, groups, 2] float16
    else:
        scale = xf.abs().amax(dim=-1, keepdim=True) / qmax  # [T, H, groups, 1]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (xf / safe).clamp(-qmax, qmax).to(store)
        out[..., :d] = q.reshape(*x.shape[:-1], d).view(torch.uint8)
        meta = scale
    out[..., d:] = meta.reshape(*x.shape[:-1], -1).contiguous().view(torch.uint8)
    return out


def dequantize_kv(packed: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Unpack rows of a quantized cache.

    Args:
        packed: ``[..., head_dim + scale_bytes(head_dim)]`` uint8 (any leading shape, e.g.
            a block's ``[block_size, num_kv_heads, head_dim + scale_bytes(head_dim)]``).
        kind: a key of :data:`KV_QUANT`.
        dtype: the float dtype to return.

    Returns:
        ``[..., head_dim]`` ``dtype``: int8 ``code x scale + min``, fp8 ``value x scale``.
    """
    store, _ = KV_QUANT[kind]
    d = _head_dim(packed.shape[-1])
    groups = scale_bytes(d) // 4
    lead = packed.shape[:-1]
    values = packed[..., :d].view(store).to(torch.float32).reshape(*lead, groups, d // groups)
    meta = packed[..., d:].contiguous()
    if store == torch.uint8:
        sz = meta.view(torch.float16).to(torch.float32).reshape(*lead, groups, 2)
        out = values * sz[..., :1] + sz[..., 1:]
    else:
        out = values * meta.view(torch.float32).unsqueeze(-1)  # [..., groups, 1]
    return out.reshape(*lead, d).to(dtype)


def _head_dim(row_bytes: int) -> int:
    """head_dim of a packed row of ``row_bytes`` (= head_dim + scale_bytes(head_dim))."""
    d = row_bytes * GROUP // (GROUP + 4)  # n = d + 4 * d / GROUP when GROUP divides d, else d + 4
    if row_bytes * GROUP % (GROUP + 4) or d % GROUP:
        d = row_bytes - 4
    return d


def quantize_channels(x: torch.Tensor) -> torch.Tensor:
    """Pack full K blocks per channel (int8 only; module docstring).

    Args:
        x: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any float dtype, with
            ``block_size >= channel_rows(head_dim)``.

    Returns:
        ``[num_blocks, block_size, num_kv_heads, head_dim + scale_bytes(head_dim)]`` uint8:
        each row's codes (0..255 over its channel's [min, max] in the block), then in the
        first ``channel_rows(head_dim)`` rows the channels' float16 (scale, min) pairs,
        ``scale_bytes(head_dim) // 4`` a row in channel order (the rest zero). As
        :func:`quantize_kv`, min is rounded down and scale up, so no code is clamped.

    Raises:
        ValueError: a block too small to hold the channels' scales.
    """
    n, bs, heads, d = x.shape
    pairs, rows = scale_bytes(d) // 4, channel_rows(d)
    if bs < rows:
        raise ValueError(f"a block of {bs} rows cannot hold per-channel scales for head_dim {d} (needs {rows})")
    xf = x.to(torch.float32).clamp(-_FP16_MAX, _FP16_MAX)
    lo = _round_fp16(xf.amin(dim=1), up=False)  # [n, heads, d] float16
    scale = _round_fp16((xf.amax(dim=1) - lo.float()) / KV_QUANT["int8"][1], up=True)
    s = scale.float().unsqueeze(1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, (xf - lo.float().unsqueeze(1)) / safe, torch.zeros_like(xf)).round().clamp(0, 255)
    out = torch.zeros(n, bs, heads, d + 4 * pairs, dtype=torch.uint8, device=x.device)
    out[..., :d] = q.to(torch.uint8)
    meta = torch.zeros(n, heads, rows * pairs, 2, dtype=torch.float16, device=x.device)
    meta[:, :, :d] = torch.stack([scale, lo], dim=-1)
    meta = meta.view(n, heads, rows, 2 * pairs).transpose(1, 2).contiguous()  # [n, rows, heads, 2 * pairs]
    out[:, :rows, :, d:] = meta.view(torch.uint8)
    return out


def dequantize_channels(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unpack blocks :func:`quantize_channels` wrote.

    Args:
        packed: ``[num_blocks, block_size, num_kv_heads, head_dim + scale_bytes(head_dim)]`` uint8.
        dtype: the float dtype to return.

    Returns:
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` ``dtype``: ``code x scale + min``
        with each channel's scale and min.
    """
    n, bs, heads, row = packed.shape
    d = _head_dim(row)
    pairs, rows = scale_bytes(d) // 4, channel_rows(d)
    meta = packed[:, :rows, :, d:].contiguous().view(torch.float16).to(torch.float32)  # [n, rows, heads, 2 * pairs]
    meta = meta.view(n, rows, heads, pairs, 2).transpose(1, 2).reshape(n, heads, rows * pairs, 2)[:, :, :d]
    out = packed[..., :d].to(torch.float32) * meta[..., 0].unsqueeze(1) + meta[..., 1].unsqueeze(1)
    return out.to(dtype)


def dequantize_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, kind: str,
                      dtype: torch.dtype, context_lens: torch.Tensor | int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks ``block_tables`` names, dequantized into a compact cache, and the tables
    remapped onto it: full-precision attention on the result equals attention on the
    dequantized cache.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim + scale_bytes(head_dim)]``
            uint8.
        block_tables: ``[num_seqs, max_blocks]`` or ``[max_blocks]`` int (entries past a
            sequence's context may be any in-range id or negative padding).
        kind: a key of :data:`KV_QUANT`; dtype: the float dtype of the result.
        context_lens: for a cache that keeps full K blocks per channel (:func:`channel_k`),
            each sequence's tokens (``[num_seqs]`` int, or an int for a 1-D table): the blocks
            they fill are read per channel, the last partial one per row. None: every row
            has its own scales.

    Returns:
        ``(k, v, tables)``: ``[n, block_size, num_kv_heads, head_dim]`` ``dtype`` each
        (``n`` distinct blocks), and ``tables`` of ``block_tables``' shape, int32, indexing them.
    """
    flat = block_tables.reshape(-1).to(torch.long).clamp(min=0)
    ids, inverse = torch.unique(flat, return_inverse=True)
    k = dequantize_kv(k_cache.index_select(0, ids), kind, dtype)
    v = dequantize_kv(v_cache.index_select(0, ids), kind, dtype)
    if context_lens is not None:
        bs, width = k_cache.shape[1], block_tables.shape[-1]
        ctx = torch.as_tensor(context_lens, device=flat.device).reshape(-1, 1)
        filled = ((torch.arange(width, device=flat.device) + 1) * bs <= ctx).reshape(-1)
        full = torch.zeros(len(ids), dtype=torch.bool, device=flat.device)
        full[inverse[filled]] = True
        if bool(full.any()):
            k[full] = dequantize_channels(k_cache.index_select(0, ids[full]), dtype)
    return k, v, inverse.reshape(block_tables.shape).to(torch.int32)


@dataclass(slots=True)
class KResidual:
    """Decode sequences' exact K rows of their partial last block (int8 per-channel layout).

    k: ``[rows, block_size, num_kv_heads, head_dim]`` float, one block-sized row per
    persistent-batch row; rows: ``[num_seqs]`` int, each decode sequence's row of ``k``;
    start: ``[num_seqs]`` int, the first offset of the sequence's last block the residual
    holds (rows before it were stored by a prefill or arrived by transfer;
    ``block_size``: none)."""

    k: torch.Tensor
    rows: torch.Tensor
    start: torch.Tensor


def overlay_residual(k: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     resid: KResidual) -> None:
    """Put decode sequences' exact K residual over their partial last block, in place.

    Args:
        k: ``[n, block_size, num_kv_heads, head_dim]`` float (dequantized blocks).
        block_tables: ``[num_seqs, max_blocks]`` int indexing ``k``; context_lens: ``[num_seqs]``
            int, each sequence's tokens, its new one included.
        resid: the sequences' residual (:class:`KResidual`).

    A block the new token filled is read per channel, not from the residual.
    """
    k_resid, rows, resid_from = resid.k, resid.rows, resid.start
    bs = k.shape[1]
    last = (context_lens.to(torch.long) - 1)
    off = last % bs
    j = torch.arange(bs, device=k.device)
    m = (j >= resid_from.to(torch.long).unsqueeze(1)) & (j <= off.unsqueeze(1)) & (off < bs - 1).unsqueeze(1)
    ii, jj = m.nonzero(as_tuple=True)
    if len(ii):
        blk = block_tables[ii, last[ii] // bs].to(torch.long)
        k[blk, jj] = k_resid[rows.to(torch.long)[ii], jj].to(k.dtype)


@dataclass(slots=True)
class ChannelFill:
    """What a step stores beyond its rows in an int8 cache with per-channel K blocks, as
    index tensors worked out on the host (:func:`channel_fill_plan`), so the device never
    waits on a data-dependent shape. All ``[n]`` int64:

    resid_tok / resid_row / resid_off: the decode tokens whose exact K goes into the
    residual, at (row, offset). blocks: the K blocks the step fills, sorted. fill_tok /
    fill_idx / fill_off: the step's tokens in those blocks (index into ``blocks``, offset).
    res_idx / res_row / res_off: the residual's rows of the blocks decode tokens fill
    (index into ``blocks``, residual row, offset)."""

    resid_tok: torch.Tensor
    resid_row: torch.Tensor
    resid_off: torch.Tensor
    blocks: torch.Tensor
    fill_tok: torch.Tensor
    fill_idx: torch.Tensor
    fill_off: torch.Tensor
    res_idx: torch.Tensor
    res_row: torch.Tensor
    res_off: torch.Tensor

    def to(self, device: torch.device | str) -> ChannelFill:
        return ChannelFill(*(getattr(self, f).to(device) for f in self.__slots__))


def channel_fill_plan(slot_mapping: torch.Tensor, num_decode_tokens: int, rows: torch.Tensor,
                      resid_from: torch.Tensor, block_size: int) -> ChannelFill:
    """A step's :class:`ChannelFill` (CPU tensors).

    Args:
        slot_mapping: ``[num_tokens]`` int, the step's slots (decode tokens first; ``< 0``:
            padding).
        num_decode_tokens: how many tokens are decodes; rows / resid_from: ``[num_decode_tokens]``
            int, each decode's residual row and the first offset of its last block the
            residual holds (``block_size``: none; :class:`KResidual`).
        block_size: tokens a block.
    """
    slots = slot_mapping.to(torch.long).cpu()
    nd, bs = num_decode_tokens, block_size
    rows, start = rows.to(torch.long).cpu()[:nd], resid_from.to(torch.long).cpu()[:nd]
    valid = slots >= 0
    off = slots.remainder(bs)
    resid_tok = (valid[:nd] & (off[:nd] >= start)).nonzero().flatten()
    done = valid & (off == bs - 1)
    blocks = torch.unique(slots[done] // bs)
    b_all = slots.clamp(min=0) // bs
    if len(blocks):
        idx = torch.searchsorted(blocks, b_all).clamp(max=len(blocks) - 1)
        hit = valid & (blocks[idx] == b_all)
    else:
        idx, hit = torch.zeros_like(slots), torch.zeros_like(valid)
    fill_tok = hit.nonzero().flatten()
    j = torch.arange(bs)
    m = (done[:nd] & hit[:nd]).unsqueeze(1) & (j >= start.unsqueeze(1)) & (j < bs - 1)
    ii, jj = m.nonzero(as_tuple=True)
    return ChannelFill(resid_tok, rows[resid_tok], off[resid_tok], blocks, fill_tok, idx[fill_tok], off[fill_tok],
                       idx[ii], rows[ii], jj)


def complete_channel_blocks(key: torch.Tensor, k_cache: torch.Tensor, fill: ChannelFill,
                            k_resid: torch.Tensor | None = None) -> None:
    """After a step's rows were stored one by one (:func:`store_quantized`, int8): keep the
    decode tokens' exact K in the residual, and rewrite each K block the step filled per
    channel (:func:`quantize_channels`), from exact values where known (the step's rows,
    the residual's) and else from the rows as stored. Index tensors only: no host sync.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]`` float, the step's K (decode tokens first).
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim + scale_bytes(head_dim)]``
            uint8, an int8 cache; written in place.
        fill: the step's :class:`ChannelFill`, on ``key``'s device.
        k_resid: the residual (``KResidual.k``), written here; may be None when ``fill``
            names none of its rows.
    """
    if fill.resid_tok.numel():
        k_resid[fill.resid_row, fill.resid_off] = key[fill.resid_tok].to(k_resid.dtype)
    if not fill.blocks.numel():
        return
    x = dequantize_kv(k_cache.index_select(0, fill.blocks), "int8", torch.float32)
    x[fill.fill_idx, fill.fill_off] = key[fill.fill_tok].to(torch.float32)
    if fill.res_idx.numel():
        x[fill.res_idx, fill.res_off] = k_resid[fill.res_row, fill.res_off].to(torch.float32)
    k_cache[fill.blocks] = quantize_channels(x)


# --------------------------------------------------------------------------- Triton: quantize + store

triton = None  # bound by _get_kernel(): jitted code resolves triton.language through module globals
tl = None
_MIN = _MAX = _fp16_directed = _round_half_even = _quant_row = None
_KERNELS: dict[bool, object] = {}


def _get_kernel():
    """Build (once per interpret mode, as ``store_kv._get_kernel``) the quantize-and-store kernel.

    Like the decode kernel it calls no triton ``@jit`` helper (``tl.zeros_like``, ``tl.max``):
    those are jitted when triton is imported, and the interpreter cannot call compiled-mode
    ones, which they are if anything imported triton before ``TRITON_INTERPRET=1`` was set."""
    # jitted code resolves names (triton, tl, the helpers below) through module globals
    global triton, tl, _MIN, _MAX, _fp16_directed, _round_half_even, _quant_row
    mode = interpret_mode()
    kernel = _KERNELS.get(mode)
    if kernel is not None:
        return kernel

    import triton
    import triton.language as tl

    _MIN, _MAX = tl.standard._elementwise_min, tl.standard._elementwise_max

    @triton.jit
    def _fp16_directed(v, UP: tl.constexpr):
        # float32 v -> float16 rounded toward +inf (UP) or -inf: the nearest float16, moved
        # one step when it lies on the wrong side of v (as _round_fp16)
        h = v.to(tl.float16)
        hf = h.to(tl.float32)
        bits = h.to(tl.int16, bitcast=True)
        if UP:
            wrong = hf < v
            step = tl.where(hf > 0.0, bits + 1, tl.where(hf < 0.0, bits - 1, 1))
        else:
            wrong = hf > v
            step = tl.where(hf > 0.0, bits - 1, tl.where(hf < 0.0, bits + 1, -32767))  # 0x8001
        return tl.where(wrong, step.to(tl.int16), bits).to(tl.float16, bitcast=True)

    @triton.jit
    def _round_half_even(x):
        r = tl.floor(x + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)

    @triton.jit
    def _quant_row(x_ptr, xs_h, xs_d, c_ptr, h, gg, j, m, head_dim, qmax,
                   GSIZE: tl.constexpr, QUANT: tl.constexpr):
        # one (token, head) row: x [BLOCK_G, GSIZE] (group gg, lane j) -> codes and scales at c_ptr
        idx = gg[:, None] * GSIZE + j
        x = tl.load(x_ptr + h * xs_h + idx * xs_d, mask=m, other=0.0).to(tl.float32)
        mg = gg * GSIZE < head_dim  # [BLOCK_G] groups that exist
        meta = head_dim + gg * 4
        if QUANT == 1:
            x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
            lo = _fp16_directed(tl.reduce(tl.where(m, x, float("inf")), 1, _MIN), False)
            hi = tl.reduce(tl.where(m, x, float("-inf")), 1, _MAX)
            s = _fp16_directed(tl.math.div_rn(hi - lo.to(tl.float32), tl.full(hi.shape, qmax, tl.float32)), True)
            sf = s.to(tl.float32)
            safe = tl.where(sf > 0.0, sf, 1.0)
            q = tl.math.div_rn(x - lo.to(tl.float32)[:, None], tl.broadcast_to(safe[:, None], x.shape))
            q = tl.where(sf[:, None] > 0.0, q, 0.0)
            q = tl.minimum(tl.maximum(_round_half_even(q), 0.0), qmax)
            tl.store(c_ptr + idx, q.to(tl.uint8), mask=m)
            tl.store((c_ptr + meta).to(tl.pointer_type(tl.float16)), s, mask=mg)
            tl.store((c_ptr + meta + 2).to(tl.pointer_type(tl.float16)), lo, mask=mg)
        else:
            amax = tl.reduce(tl.where(m, tl.abs(x), 0.0), 1, _MAX)
            s = tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32))
            safe = tl.where(s > 0.0, s, 1.0)
            q = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape))
            q = tl.minimum(tl.maximum(q, -qmax), qmax)
            # round to e4m3's grid here (to nearest even: 3 mantissa bits, a fixed 2^-9 step below
            # 2^-6), so the cast below is exact: Triton's interpreter mis-rounds some values
            # (124.7 -> 64), the hardware's cvt rounds the same way as this
            bits = q.to(tl.uint32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
            sub = _round_half_even(tl.abs(q) * 512.0) / 512.0
            q = tl.where(tl.abs(q) < 0.015625, tl.where(q < 0.0, -sub, sub), normal)  # keeps -0.0
            q = q.to(tl.float8e4nv)
            tl.store(c_ptr + idx, q.to(tl.uint8, bitcast=True), mask=m)
            tl.store((c_ptr + meta).to(tl.pointer_type(tl.float32)), s, mask=mg)

    @triton.jit
    def _quant_store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                            k_st, k_sh, k_sd, v_st, v_sh, v_sd,
                            c_sb, c_so, c_sh,  # cache strides (uint8 rows contiguous; K and V alike)
                            block_size, head_dim, qmax,
                            BLOCK_G: tl.constexpr, GSIZE: tl.constexpr, QUANT: tl.constexpr):
        # One program per (token, KV head): quantize its K and V rows and write them, codes
        # then scales, into the slot's row (slot < 0: padding, skipped).
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            row = (slot // block_size) * c_sb + (slot % block_size) * c_so + h * c_sh
            gg = tl.arange(0, BLOCK_G)
            j = tl.arange(0, GSIZE)[None, :]
            m = (gg[:, None] * GSIZE + j) < head_dim
            _quant_row(k_ptr + t * k_st, k_sh, k_sd, kc_ptr + row, h, gg, j, m, head_dim, qmax, GSIZE, QUANT)
            _quant_row(v_ptr + t * v_st, v_sh, v_sd, vc_ptr + row, h, gg, j, m, head_dim, qmax, GSIZE, QUANT)

    _KERNELS[mode] = _quant_store_kernel
    return _quant_store_kernel


def store_quantized_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kind: str) -> None:
    """Quantize new K/V rows and scatter them into a quantized paged cache, in one Triton
    kernel: byte for byte what :func:`store_quantized_ref` writes.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype, any strides;
            ``head_dim % 4 == 0`` (the scales are stored aligned).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim + scale_bytes(head_dim)]``
            uint8 with contiguous rows and equal strides; written in place.
        slot_mapping: ``[num_tokens]`` int32/int64; ``slot < 0`` skips the token.
        kind: a key of :data:`KV_QUANT`.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    _check_store(key, value, k_cache, v_cache, slot_mapping, kind)
    d = key.shape[-1]
    if d % 4 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"store_quantized_triton needs head_dim % 4 == 0 (got {d}) and caches with equal "
                         f"strides and contiguous rows")
    n, heads = key.shape[:2]
    if n == 0:
        return
    groups = scale_bytes(d) // 4
    gsize = GROUP if groups > 1 or d == GROUP else next_pow2(d)
    _get_kernel()[(n, heads)](key, value, k_cache, v_cache, slot_mapping, *key.stride(), *value.stride(),
                              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], d,
                              KV_QUANT[kind][1], BLOCK_G=next_pow2(groups), GSIZE=gsize,
                              QUANT=1 if kind == "int8" else 2)


def _check_store(key, value, k_cache, v_cache, slot_mapping, kind) -> None:
    if kind not in KV_QUANT:
        raise ValueError(f"unknown quantized kind {kind!r}")
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must be equal [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    want = (key.shape[1], key.shape[2] + scale_bytes(key.shape[2]))
    if (k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != want
            or k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8):
        raise ValueError(f"k_cache/v_cache must be equal [num_blocks, block_size, {want[0]}, {want[1]}] uint8, got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0] or slot_mapping.dtype not in (torch.int32,
                                                                                                       torch.int64):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}] int32/int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")


def store_quantized_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, kind: str) -> None:
    """Torch reference of :func:`store_quantized_triton` (same arguments; any head_dim):
    :func:`quantize_kv`, then ``store_kv.store_kvcache_ref``."""
    from .store_kv import store_kvcache_ref

    _check_store(key, value, k_cache, v_cache, slot_mapping, kind)
    store_kvcache_ref(quantize_kv(key, kind), quantize_kv(value, kind), k_cache, v_cache, slot_mapping)


def store_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kind: str) -> None:
    """Quantize and store new K/V rows (arguments of :func:`store_quantized_triton`): the
    Triton kernel when every tensor is on CUDA, triton imports and ``head_dim % 4 == 0``,
    else :func:`store_quantized_ref`."""
    if (key.is_cuda and value.is_cuda and k_cache.is_cuda and v_cache.is_cuda and slot_mapping.is_cuda
            and key.shape[-1] % 4 == 0 and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and triton_importable()):
        store_quantized_triton(key, value, k_cache, v_cache, slot_mapping, kind)
    else:
        store_quantized_ref(key, value, k_cache, v_cache, slot_mapping, kind)
