"""A NIXL-registered byte buffer carved into per-request slots (first fit).

Encode workers keep embeddings here until the prefill worker has read them;
prefill/aggregated workers receive embeddings here before copying them out.
"""

from __future__ import annotations

import secrets
import time

import torch

from epd.errors import CapacityError
from epd.transfer.regions import device_code

#: bytes of a span's generation word (int64, little-endian), after its data
GENERATION_BYTES = 8


def generation_offset(nbytes: int) -> int:
    """Offset of a span's generation word from the span's start: the data's ``nbytes``
    rounded up to 8."""
    return -(-nbytes // GENERATION_BYTES) * GENERATION_BYTES


class BufferFullError(CapacityError):
    """No free span large enough; retry later or raise the buffer size."""


class EmbeddingBuffer:
    """``capacity_bytes`` of pinned-in-place uint8 memory.

    ``alloc(owner, nbytes) -> offset`` (64-byte aligned); ``free(owner)`` releases every
    slot of ``owner``. ``alloc_span`` also writes a random nonzero *generation* word
    after the data (``generation_offset``), which ``free`` zeroes before the slot can be
    reused: a reader that reads the word back after reading the data and finds its
    generation knows the data was that span's. ``end(owner)`` notes that the router
    ended ``owner``'s request; ``expire(ttl_s)`` frees the slots of owners ended more
    than ``ttl_s`` ago (never those of a request still running). ``addr`` is the base
    address registered with NIXL.
    """

    ALIGN = 64

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu") -> None:
        """``device``: where the buffer lives ("cpu", or a worker's "cuda:i": registered
        as VRAM, so embeddings move GPU to GPU)."""
        self.tensor = torch.zeros(capacity_bytes, dtype=torch.uint8, device=device)
        self.capacity = capacity_bytes
        self.addr = self.tensor.data_ptr()
        self.device_code = device_code(self.tensor)  # the region device field (epd.transfer.regions)
        self._slots: dict[int, tuple[int, str, int]] = {}  # offset -> (size, owner, generation word offset or -1)
        self._ended: dict[str, float] = {}  # owner -> monotonic time the router ended its request

    @property
    def used_bytes(self) -> int:
        return sum(size for size, _, _ in self._slots.values())

    def alloc(self, owner: str, nbytes: int) -> int:
        """A 64-byte aligned slot of ``nbytes`` for ``owner``: its offset. Raises BufferFullError."""
        return self._alloc(owner, nbytes, -1)

    def _alloc(self, owner: str, nbytes: int, word: int) -> int:
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        pos = 0
        for off in sorted(self._slots):
            if off - pos >= size:
                break
            pos = off + self._slots[off][0]
        if pos + size > self.capacity:
            raise BufferFullError(f"embedding buffer full: {nbytes} bytes wanted, "
                                  f"{self.capacity - self.used_bytes} of {self.capacity} free")
        self._slots[pos] = (size, owner, -1 if word < 0 else pos + word)
        return pos

    def alloc_span(self, owner: str, nbytes: int) -> tuple[int, int]:
        """A slot for ``nbytes`` of data followed by a generation word: ``(offset,
        generation)``, generation a random nonzero 63-bit int written at ``offset +
        generation_offset(nbytes)``. Raises BufferFullError."""
        word = generation_offset(nbytes)
        off = self._alloc(owner, word + GENERATION_BYTES, word)
        generation = secrets.randbits(63) or 1
        self._write_word(off + word, generation)
        return off, generation

    def _write_word(self, at: int, value: int) -> None:
        raw = torch.tensor([value], dtype=torch.int64).view(torch.uint8)
        self.tensor[at:at + GENERATION_BYTES].copy_(raw)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset:offset + nbytes]

    def region(self, offset: int, nbytes: int) -> tuple[int, int, int]:
        """``(addr, nbytes, device)`` of a slot's span for NIXL."""
        return (self.addr + offset, nbytes, self.device_code)

    def free(self, owner: str) -> int:
        """Free every slot of ``owner`` (zeroing their generation words first); returns how many."""
        gone = [off for off, (_, o, _) in self._slots.items() if o == owner]
        for off in gone:
            word = self._slots.pop(off)[2]
            if word >= 0:
                self._write_word(word, 0)
        self._ended.pop(owner, None)
        return len(gone)

    def end(self, owner: str) -> None:
        """The router ended ``owner``'s request: its slots may be reclaimed by ``expire``."""
        if owner in self.owners():
            self._ended.setdefault(owner, time.monotonic())

    def expire(self, ttl_s: float) -> list[str]:
        """Free the slots of owners ended more than ``ttl_s`` seconds ago; returns them."""
        now = time.monotonic()
        owners = [o for o, t in self._ended.items() if now - t >= ttl_s]
        for o in owners:
            self.free(o)
        return sorted(owners)

    def owners(self) -> set[str]:
        return {o for _, o, _ in self._slots.values()}
