"""The CPU paged decode attention kernel (``csrc/paged_decode_cpu.cpp``, in the extension of
``epd.kernels.cpu_extension``).

The kernel reads the paged KV cache in place, block by block, with an online softmax
(fp32 accumulation; fp32 and bf16 caches), split over (sequence, KV head) pairs on
torch's intra-op threads. Where the extension cannot be built, callers use the torch
reference (``paged_decode_attention_ref``). Source of the algorithm: vLLM's
``paged_attention_v1`` (csrc/attention), FlashAttention's online softmax.
"""

from __future__ import annotations

import torch

from epd.kernels.cpu_extension import load

__all__ = ["load", "paged_decode_attention_cpu"]


@torch.compiler.disable  # an opaque extension call: torch.compile leaves it out of its graphs
def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged decode attention on CPU tensors, reading the cache in place.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` fp32 or bf16, one query per sequence.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype,
            contiguous. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        block_tables: ``[num_seqs, max_num_blocks]`` int32; only the first
            ``ceil(context_lens[i] / block_size)`` entries of row i are read.
        context_lens: ``[num_seqs]`` int32, tokens per sequence, the current one included.
        scale: softmax scale.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in q's dtype (zeros for an empty context).

    Raises:
        RuntimeError: the kernel is not built (check :func:`load` first), or a block id
            read is outside the cache, or the shapes or dtypes disagree.
    """
    ext = load()
    if ext is None:
        raise RuntimeError("the CPU paged decode kernel is not built")
    return ext.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, float(scale))
