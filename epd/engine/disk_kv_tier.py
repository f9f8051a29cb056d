"""The disk tier of the prefix cache, under the host tier: blocks the host tier evicts are
written to a bounded file, keyed by their block hash, and read back on a later hit.

This is the third layer of SGLang HiCache and LMCache's local disk backend (vLLM's
``OffloadingConnector`` with a file medium), for one instance. Plain positional file I/O
(``os.pwrite`` / ``os.preadv``) on one anonymous file in ``--kv-disk-cache-dir``: the file
is created with ``O_TMPFILE`` (no name, mode 0600) so it disappears with the process, even
on SIGKILL, and nothing read from it was written by anyone else. Its size is fixed at
``num_disk_blocks`` slots; the least recently stored or hit entry is overwritten first.

Writes run on one background thread, off the engine step: ``store`` copies the block
into a private buffer and returns. At most ``MAX_QUEUED_WRITES`` wait (a slow disk makes
``store`` wait for the oldest, so the copies cannot grow without bound). A read of a slot
waits for that slot's writes first (the thread runs them in order). A failed write
(ENOSPC, EIO) drops its entry and is counted in ``write_errors``, a failed read in
``read_errors``: the block is a cache miss, never wrong KV.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["DiskKVTier"]

logger = logging.getLogger(__name__)

#: block writes queued at most (each holds a copy of its block until written)
MAX_QUEUED_WRITES = 64


class DiskKVTier:
    """``num_disk_blocks`` slots in one file under ``directory``, each one KV block of
    every layer, K then V.

    ``block_shape``: one block of one cache, [num_layers, block_size, num_kv_heads,
    head_dim]; ``dtype``: the storage dtype of the KV cache (uint8 for a quantized one).
    A slot holds 2 x that many elements (about ``2 * layers * block_size * heads *
    head_dim * itemsize`` bytes).

    Raises:
        ValueError: ``num_disk_blocks`` < 1.
        OSError: ``directory`` cannot hold an anonymous file (missing, not writable, or a
            file system without ``O_TMPFILE``).
    """

    def __init__(self, directory: str | os.PathLike, block_shape: tuple[int, ...], dtype: torch.dtype,
                 num_disk_blocks: int) -> None:
        if num_disk_blocks < 1:
            raise ValueError(f"the disk KV tier needs at least one block, got {num_disk_blocks}")
        self.block_shape = (2, *block_shape)
        self.dtype = dtype
        self.block_bytes = torch.Size(self.block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.num_blocks = num_disk_blocks
        self._file = tempfile.TemporaryFile(dir=directory)  # O_TMPFILE on Linux: never named, 0600
        self._fd = self._file.fileno()
        os.ftruncate(self._fd, num_disk_blocks * self.block_bytes)  # sparse until written
        self.index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.free_slots = list(range(num_disk_blocks - 1, -1, -1))
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="epd-kv-disk")
        self._pending: dict[int, Future] = {}  # slot -> its latest write
        self._queued: deque[Future] = deque()  # writes in submission order, for the bound
        self._failed: set[int] = set()  # slots whose latest write failed (their entry goes at the next touch)
        self.stores = 0  # blocks written
        self.loads = 0  # blocks read back
        self.evictions = 0  # entries dropped for newer ones
        self.write_errors = 0
        self.read_errors = 0
        self.on_drop: Callable[[bytes], None] | None = None  # called with each hash evicted or found unwritten

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def store(self, block_hash: bytes, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one block (``k`` / ``v``: [num_layers, block_size, num_kv_heads, head_dim]
        of ``dtype``) under ``block_hash``. A hash already held is only marked recently
        used. The bytes are copied before this returns; the write is queued."""
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            dropped, slot = self.index.popitem(last=False)
            self.evictions += 1
            if self.on_drop is not None:
                self.on_drop(dropped)
        while self._queued and (self._queued[0].done() or len(self._queued) >= MAX_QUEUED_WRITES):
            self._queued.popleft().exception()  # waits for the oldest when full; errors are read at load
        data = torch.stack((k, v)).contiguous().view(torch.uint8).reshape(-1).numpy().copy()
        self._failed.discard(slot)
        self._pending[slot] = fut = self._writer.submit(self._write, slot, data)
        self._queued.append(fut)
        self.index[block_hash] = slot
        self.stores += 1

    def _write(self, slot: int, data) -> None:
        view = memoryview(data)
        offset = slot * self.block_bytes
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def _settled(self, slot: int) -> bool:
        """Wait for ``slot``'s queued writes; False when the latest one failed."""
        fut = self._pending.pop(slot, None)
        if fut is not None:
            try:
                fut.result()
            except OSError:
                self.write_errors += 1
                self._failed.add(slot)
        return slot not in self._failed

    def readable(self, block_hash: bytes) -> bool:
        """``block_hash`` is held and its write landed (waited for): it is marked most
        recently used. An entry whose write failed is dropped (False)."""
        slot = self.index.get(block_hash)
        if slot is None:
            return False
        if not self._settled(slot):
            self._failed.discard(slot)
            self._drop(block_hash, slot)
            return False
        self.index.move_to_end(block_hash)
        return True

    def load(self, block_hash: bytes, k_out: torch.Tensor, v_out: torch.Tensor) -> bool:
        """Read ``block_hash``'s block into ``k_out`` / ``v_out`` (shaped as ``store``'s
        inputs) and mark it recently used. False (outputs untouched) when it is not
        held, or its write or this read failed (the entry is dropped)."""
        if not self.readable(block_hash):
            return False
        slot = self.index[block_hash]
        buf = bytearray(self.block_bytes)
        try:
            n = os.preadv(self._fd, [buf], slot * self.block_bytes)
        except OSError as e:
            n, err = -1, e
        if n != self.block_bytes:
            self.read_errors += 1
            logger.warning("disk KV tier: read of slot %d failed (%s): a miss", slot,
                           err if n < 0 else f"{n} of {self.block_bytes} bytes")
            self._drop(block_hash, slot)
            return False
        kv = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).view(self.block_shape)
        k_out.copy_(kv[0])
        v_out.copy_(kv[1])
        self.loads += 1
        return True

    def _drop(self, block_hash: bytes, slot: int) -> None:
        """Forget ``block_hash``'s entry (its slot is free again) and say so."""
        del self.index[block_hash]
        self.free_slots.append(slot)
        if self.on_drop is not None:
            self.on_drop(block_hash)

    def clear(self) -> None:
        """Forget every entry (queued writes still land; their slots are free)."""
        self.index.clear()
        self.free_slots = list(range(self.num_blocks - 1, -1, -1))

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._file.close()

    def stats(self) -> dict[str, float]:
        return {"kv_disk_blocks": self.num_blocks, "kv_disk_used_blocks": len(self.index),
                "kv_disk_stored_blocks": self.stores, "kv_disk_loaded_blocks": self.loads,
                "kv_disk_evicted_blocks": self.evictions, "kv_disk_write_errors": self.write_errors,
                "kv_disk_read_errors": self.read_errors}
