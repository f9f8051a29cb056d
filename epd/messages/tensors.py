"""Tensors on the wire: ``TensorBlob`` (dtype name, shape, raw bytes) and its checks.

A ``torch.Tensor`` field of a control message travels as a ``TensorBlob`` (the encoder's
``enc_hook`` / decoder's ``dec_hook``), checked on decode against an allow-list of
dtypes, the byte count implied by the shape and ``MAX_TENSOR_BYTES``.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

from epd.messages.base import MessageError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
MAX_TENSOR_BYTES = 256 * 2**20


class TensorBlob(msgspec.Struct, frozen=True):
    """A tensor on the wire: ``dtype`` name, ``shape``, raw little-endian bytes.

    Every ``torch.Tensor`` field of a message (``MediaItem.data``) is sent as one
    (``enc_hook``) and checked by ``to_tensor`` on decode (``dec_hook``); engine
    workers check embeddings read over NIXL the same way."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TensorBlob:
        t = t.detach().contiguous().cpu()
        if t.dtype not in _DTYPE_NAMES:
            raise MessageError(f"dtype {t.dtype} cannot be sent")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(_DTYPE_NAMES[t.dtype], list(t.shape), raw)

    def to_tensor(self) -> torch.Tensor:
        """Raises MessageError when dtype, shape and byte count disagree."""
        buf = np.frombuffer(self.data, dtype=np.uint8).copy()
        return typed_view(torch.from_numpy(buf), self.dtype, self.shape)


def typed_view(raw: torch.Tensor, dtype: str, shape: list[int]) -> torch.Tensor:
    """``raw`` (uint8 ``[nbytes]``, on any device) viewed as a ``dtype`` tensor of ``shape``,
    after checking the header another process sent (``TensorBlob``'s dtype names).

    Raises:
        MessageError: an unknown dtype, a negative dimension, or a byte count that does
            not match (or exceeds ``MAX_TENSOR_BYTES``).
    """
    torch_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MessageError(f"bad tensor header: dtype={dtype!r} shape={shape}")
    expected = math.prod(shape) * torch.tensor([], dtype=torch_dtype).element_size()
    if expected != raw.numel() or expected > MAX_TENSOR_BYTES:
        raise MessageError(f"tensor of shape {shape} ({dtype}) needs {expected} bytes, "
                           f"got {raw.numel()} (limit {MAX_TENSOR_BYTES})")
    return raw.view(torch_dtype).reshape(shape)




def enc_hook(obj):
    """``torch.Tensor`` -> ``TensorBlob`` (``MessageError`` for a dtype off the allow-list)."""
    if isinstance(obj, torch.Tensor):
        return TensorBlob.from_tensor(obj)
    raise TypeError(f"Encoding objects of type {type(obj).__name__} is unsupported")


def dec_hook(tp, obj):
    """A ``TensorBlob`` map -> ``torch.Tensor``, checked by ``TensorBlob.to_tensor``; any
    error becomes a ``msgspec.ValidationError`` (so ``MessageError`` from ``decode``)."""
    if tp is torch.Tensor:
        if not isinstance(obj, dict) or not isinstance(obj.get("data"), bytes):  # convert() would take base64 text
            raise MessageError("a tensor must be a TensorBlob map with raw bytes")
        blob = msgspec.convert(obj, TensorBlob)
        try:
            return blob.to_tensor()
        except MessageError:
            raise
        except Exception as e:  # e.g. torch refusing a view: still a bad message, never a crash
            raise MessageError(f"bad tensor {blob.dtype} {blob.shape}: {e}") from None
    raise TypeError(f"{tp} cannot be received")
