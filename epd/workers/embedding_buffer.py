"""A NIXL-registered byte buffer carved into per-request slots (first fit).

Encode workers keep embeddings here until the prefill worker has read them;
prefill/aggregated workers receive embeddings here before copying them out.
"""

from __future__ import annotations

import time

import torch

from epd.errors import CapacityError
from epd.transfer.regions import device_code


class BufferFullError(CapacityError):
    """No free span large enough; retry later or raise the buffer size."""


class EmbeddingBuffer:
    """``capacity_bytes`` of pinned-in-place uint8 memory.

    ``alloc(owner, nbytes) -> offset`` (64-byte aligned); ``free(owner)``
    releases every slot of ``owner``; ``expire(max_age_s)`` frees slots older
    than that (a reader that died never releases). ``addr`` is the base
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
        self._slots: dict[int, tuple[int, str, float]] = {}  # offset -> (size, owner, time)

    @property
    def used_bytes(self) -> int:
        return sum(size for size, _, _ in self._slots.values())

    def alloc(self, owner: str, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        pos = 0
        for off in sorted(self._slots):
            if off - pos >= size:
                break
            pos = off + self._slots[off][0]
        if pos + size > self.capacity:
            raise BufferFullError(f"embedding buffer full: {nbytes} bytes wanted, "
                                  f"{self.capacity - self.used_bytes} of {self.capacity} free")
        self._slots[pos] = (size, owner, time.monotonic())
        return pos

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset:offset + nbytes]

    def region(self, offset: int, nbytes: int) -> tuple[int, int, int]:
        """``(addr, nbytes, device)`` of a slot's span for NIXL."""
        return (self.addr + offset, nbytes, self.device_code)

    def free(self, owner: str) -> int:
        """Free every slot of ``owner``; returns how many."""
        gone = [off for off, (_, o, _) in self._slots.items() if o == owner]
        for off in gone:
            del self._slots[off]
        return len(gone)

    def expire(self, max_age_s: float) -> list[str]:
        now = time.monotonic()
        owners = {o for _, o, t in self._slots.values() if now - t > max_age_s}
        for o in owners:
            self.free(o)
        return sorted(owners)

    def owners(self) -> set[str]:
        return {o for _, o, _ in self._slots.values()}
