"""What every wire channel shares: memory regions, the decode error, and ``Shutdown``."""

from __future__ import annotations

import msgspec

Region = tuple[int, int, int]  # (addr, nbytes, device): device 0 = host (DRAM), 1 + i = VRAM of cuda:i


class MessageError(ValueError):
    """A message failed to decode or validate (the sender is buggy or hostile)."""



class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Router -> any worker, and rank 0 -> the other TP ranks of an instance: exit."""
