"""The CPU paged decode attention kernel (``csrc/paged_decode_cpu.cpp``), built on first use.

The kernel reads the paged KV cache in place, block by block, with an online softmax
(fp32 accumulation; fp32 and bf16 caches), split over (sequence, KV head) pairs on
torch's intra-op threads. It is compiled once per machine with
``torch.utils.cpp_extension.load`` (g++ and ninja; ``make install`` builds it) into
torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``);
processes that start while it builds wait on the build's lock file. Where it cannot be
built, :func:`load` returns None once, with a warning, and callers use the torch
reference (``paged_decode_attention_ref``). Source of the algorithm: vLLM's
``paged_attention_v1`` (csrc/attention), FlashAttention's online softmax.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
_LOCK = threading.Lock()
_EXT = None
_TRIED = False


def load():
    """The compiled extension module (``paged_decode_attention_cpu``), or None when it
    cannot be built here (the reason is logged once)."""
    global _EXT, _TRIED
    if _TRIED:
        return _EXT
    with _LOCK:
        if _TRIED:
            return _EXT
        try:
            try:  # the `ninja` wheel's binary, when the venv's bin is not on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
            # its import warns "No CUDA runtime is found" on every CPU-only machine: noise here
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            from torch.utils.cpp_extension import load as build

            _EXT = build(name="epd_paged_decode_cpu", sources=[str(_SOURCE)],
                         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # no compiler, no ninja, a read-only cache...
            logger.warning("the CPU paged decode kernel could not be built (%s: %s); decode attention "
                           "falls back to the slower torch reference", type(e).__name__, str(e).splitlines()[0]
                           if str(e) else "")
            _EXT = None
        _TRIED = True
    return _EXT


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
