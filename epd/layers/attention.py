"""Paged attention layer: stores new K/V into the cache, then attends.

The step's tokens are flattened as in vLLM v1: decode tokens (one per
sequence) first, then each prefill chunk. ``AttentionMetadata`` describes the
layout; the model runner sets it for the duration of a forward pass with
``set_attention_metadata``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from epd.kernels.kv_quant import ChannelFill, KResidual, complete_channel_blocks, dequantize_blocks, store_quantized
from epd.kernels.paged_attention import paged_decode_attention, paged_prefill_attention_ref
from epd.kernels.store_kv import store_kvcache


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of new tokens: rows [q_start, q_start + q_len) of the
    step; ``context_len`` = cached tokens before the chunk + q_len;
    ``block_table``: [num_blocks] int32."""

    q_start: int
    q_len: int
    context_len: int
    block_table: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """slot_mapping: [num_tokens] int64; decode_block_tables: [num_decodes,
    max_blocks] int32; decode_context_lens: [num_decodes] int32."""

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Called with the layer index right after that layer's K/V is stored (the
    # KV connector's worker-side seam: a prefill worker starts sending layer l
    # while layers l+1.. compute).
    layer_hook: Callable[[int], None] | None = None
    # int8 per-channel K (kv_quant.channel_k): each decode's persistent-batch row and the
    # first offset of its last block held exact in the layer's residual ([num_decodes] int64)
    decode_rows: torch.Tensor | None = None
    decode_resid_from: torch.Tensor | None = None
    # ... and what the step's store does beyond its rows (the residual, the blocks it fills)
    channel_fill: ChannelFill | None = None


_METADATA: AttentionMetadata | None = None


@contextmanager
def set_attention_metadata(metadata: AttentionMetadata):
    global _METADATA
    _METADATA = metadata
    try:
        yield
    finally:
        _METADATA = None


class Attention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads,
    head_dim]; returns [num_tokens, num_heads, head_dim]. ``k_cache`` /
    ``v_cache`` ([num_blocks, block_size, num_kv_heads, head_dim]) are bound by
    the model runner after the cache is allocated; with ``kv_quant`` ("int8",
    "fp8_e4m3") they are uint8 rows of ``head_dim + scale_bytes(head_dim)`` bytes (``epd.kernels.kv_quant``):
    new K/V rows are quantized as they are stored (one Triton kernel on CUDA; int8
    ``channel_k``: K blocks the step fills are rewritten per channel, and decodes keep their
    open block's K exact in ``k_resid``, read in place of the stored rows), decode
    attention reads the rows in place on CUDA (the Triton kernel dequantizes as it loads)
    and elsewhere attends to the step's blocks dequantized to the model's dtype, as a
    prefill over a cached prefix does everywhere. A prefill chunk attends to its own K/V
    in full precision and to earlier tokens' as stored (SGLang's ragged + paged split), so
    with a quantized cache a prefix hit or a chunk boundary changes logprobs by the
    quantization error (tests/engine/test_kv_cache_dtype.py); attending to the stored
    rows everywhere (vLLM's paged prefill) would remove that, at a much lower greedy
    agreement with a full-precision cache (benchmarks/README.md).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.layer_idx = -1
        self.kv_quant: str | None = None
        # int8 with per-channel K blocks (kv_quant.channel_k), and the exact K rows of each
        # decode sequence's partial last block: [rows, block_size, num_kv_heads, head_dim]
        self.channel_k = False
        self.k_resid = torch.empty(0)

    # The paged store and attention kernels stay outside torch.compile's graphs (--compile):
    # they read the step's metadata and the cache by reference, and run eagerly between graphs.
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = _METADATA
        assert md is not None, "attention called outside set_attention_metadata()"
        quant = self.kv_quant
        nd = md.num_decode_tokens
        resid = None
        if self.channel_k and nd and md.decode_rows is not None and self.k_resid.numel():
            resid = KResidual(self.k_resid, md.decode_rows, md.decode_resid_from)
        if quant is None:
            store_kvcache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        else:
            store_quantized(k, v, self.k_cache, self.v_cache, md.slot_mapping, quant)  # Triton on CUDA: one kernel
            if self.channel_k and md.channel_fill is not None:  # filled K blocks per channel; decodes' K kept
                complete_channel_blocks(k, self.k_cache, md.channel_fill, self.k_resid)
        if md.layer_hook is not None:
            md.layer_hook(self.layer_idx)
        out = torch.empty_like(q)
        if nd:
            # a quantized cache: read in place by the Triton kernel, else its blocks dequantized first
            out[:nd] = paged_decode_attention(q[:nd], self.k_cache, self.v_cache, md.decode_block_tables,
                                              md.decode_context_lens, self.scale, kv_quant=quant,
                                              channel_k=self.channel_k, resid=resid)
        for p in md.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.context_len == p.q_len:  # no cached prefix: attend to this chunk's own K/V
                qs, ks, vs = (t[rows].transpose(0, 1) for t in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale,
                                                   enable_gqa=self.num_heads != self.num_kv_heads)
                out[rows] = o.transpose(0, 1)
            else:
                kc, vc, table = self.k_cache, self.v_cache, p.block_table
                if quant is not None:
                    kc, vc, table = dequantize_blocks(kc, vc, table, quant, q.dtype,
                                                      p.context_len if self.channel_k else None)
                out[rows] = paged_prefill_attention_ref(q[rows], kc, vc, table, p.context_len, self.scale)
        return out
