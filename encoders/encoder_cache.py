"""LRU cache of encoder outputs (embeddings), bounded in bytes, keyed by item hash."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class EncoderCache:
    """item hash (full hex digest) -> embedding ``[n_tokens, hidden]``.

    ``capacity_bytes`` bounds the sum of ``tensor.nbytes``; the least recently
    used entries are evicted first; an entry larger than the capacity is not
    stored. ``hits`` / ``misses`` count ``get`` calls. Thread-safe.
    Source: vLLM v1 ``EncoderCacheManager`` (there in tokens; here in bytes).
    """

    def __init__(self, capacity_bytes: int = 512 * 2**20) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            emb = self._entries.get(key)
            if emb is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return emb

    def put(self, key: str, emb: torch.Tensor) -> None:
        size = emb.nbytes
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            if size > self.capacity_bytes:
                return
            while self.used_bytes + size > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.used_bytes -= old.nbytes
            self._entries[key] = emb
            self.used_bytes += size
