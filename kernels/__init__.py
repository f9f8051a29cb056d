"""Triton kernels with torch references (imported as ``epd.kernels``).

Public wrappers dispatch to Triton for CUDA tensors and to the torch reference otherwise.
Importing this package does not import triton.
"""

from .kv_staging import pack_kv, pack_kv_ref, pack_kv_triton, unpack_kv, unpack_kv_ref, unpack_kv_triton
from .paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
)
from .store_kv import store_kvcache, store_kvcache_ref, store_kvcache_triton

__all__ = [
    "pack_kv",
    "pack_kv_ref",
    "pack_kv_triton",
    "unpack_kv",
    "unpack_kv_ref",
    "unpack_kv_triton",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "paged_prefill_attention_ref",
    "store_kvcache",
    "store_kvcache_ref",
    "store_kvcache_triton",
]
