"""Staging pool: contiguous per-request KV regions for heterogeneous-TP transfers.

A pool is one buffer ``[num_layers, num_blocks * block_elems]`` (``block_elems`` =
2 (K, V) x block_size x num_kv_heads x head_dim, i.e. one block of KV with *all*
heads), registered with NIXL once at start. A request takes a contiguous range of
``n`` staging blocks; layer ``l`` of that request is the byte range
``[l, start * block_elems : (start + n) * block_elems]``, laid out as
``epd.kernels.kv_staging.staging_shape(src_tp, n, ...)``. Contiguity is what makes
one NIXL write per layer possible.

On CPU the buffer lives in a file under ``/dev/shm`` mapped by every TP rank of the
instance: each rank packs (prefill) or unpacks (decode) its own head slice in it, and
rank 0's single NIXL agent registers it, so one write moves every rank's part. The
file is unlinked as soon as all ranks mapped it (:meth:`StagingPool.unlink`), so a
killed instance leaves nothing behind. With per-rank agents (``--kv-agents per-rank``,
``epd.transfer.rank_agent``) every rank instead has its own private pool of its own KV
heads (``block_elems`` / tp, allocated alike on every rank) and its own NIXL agent, as
vLLM's ``NixlConnector`` does, and writes its part itself.

The allocator (first fit over free ranges, ranges merged on free) runs on rank 0
only; other ranks are told ``(start, n)`` with each step.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch

from epd.transfer.regions import tensor_region

__all__ = ["StagingPool", "StagingPoolError"]


class StagingPoolError(ValueError):
    """A request needs more staging blocks than the whole pool has."""


class StagingPool:
    """Args:
        num_layers, num_blocks: buffer size in layers and staging blocks.
        block_elems: elements of one staging block of one layer (2 * block_size * kv_heads * head_dim).
        dtype: the KV cache dtype.
        shm_path: when set, the buffer is (or is mapped from) this shared-memory file;
            ``create`` makes it (rank 0) instead of opening an existing one.
        device: where a private pool lives (``"cpu"``, or the rank's ``"cuda:i"``: device
            staging, registered as VRAM, packed and unpacked by device kernels).

    Raises:
        ValueError: non-positive sizes, or a shared-memory pool on a device.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_elems: int, dtype: torch.dtype,
                 shm_path: str | None = None, create: bool = True, device: str | torch.device = "cpu") -> None:
        if num_layers < 1 or num_blocks < 1 or block_elems < 1:
            raise ValueError(f"staging pool needs positive sizes, got {num_layers} layers, {num_blocks} blocks, "
                             f"{block_elems} elements per block")
        if shm_path is not None and torch.device(device).type != "cpu":
            raise ValueError(f"a shared-memory staging pool lives in host memory, not on {device}")
        self.num_layers, self.num_blocks, self.block_elems, self.dtype = num_layers, num_blocks, block_elems, dtype
        self.shm_path = shm_path
        numel = num_layers * num_blocks * block_elems
        if shm_path is None:
            flat = torch.zeros(numel, dtype=dtype, device=device)
        else:
            if create:
                nbytes = numel * torch.tensor([], dtype=dtype).element_size()
                with open(shm_path, "xb") as f:
                    f.truncate(nbytes)
            flat = torch.from_file(shm_path, shared=True, size=numel, dtype=dtype)
        self.buffer = flat.view(num_layers, num_blocks * block_elems)
        self._free: list[tuple[int, int]] = [(0, num_blocks)]  # sorted (start, length)
        self._owned: dict[str, tuple[int, int]] = {}

    @staticmethod
    def new_shm_path(tag: str) -> str:
        """A fresh path under /dev/shm (or the temp dir where there is none) for ``tag``."""
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in tag)
        return str(base / f"epd-staging-{safe}-{os.getpid()}-{secrets.token_hex(4)}")

    def unlink(self) -> None:
        """Remove the shared-memory file (mappings stay valid). Idempotent."""
        if self.shm_path is not None:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass

    # ---- allocation ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return sum(n for _, n in self._free)

    def can_alloc(self, num_blocks: int) -> bool:
        return any(n >= num_blocks for _, n in self._free)

    def alloc(self, request_id: str, num_blocks: int) -> int | None:
        """Reserve ``num_blocks`` contiguous staging blocks for ``request_id``; returns
        the first block, or None when no free range is long enough right now.

        Raises:
            StagingPoolError: ``num_blocks`` exceeds the whole pool (it never fits).
            ValueError: ``request_id`` already holds a range, or ``num_blocks`` < 1.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_blocks > self.num_blocks:
            raise StagingPoolError(
                f"the request needs {num_blocks} staging blocks but the pool has {self.num_blocks}; "
                f"raise --kv-staging-mb or shorten the prompt")
        if request_id in self._owned:
            raise ValueError(f"request {request_id!r} already holds staging blocks")
        for i, (start, n) in enumerate(self._free):
            if n >= num_blocks:
                if n == num_blocks:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_blocks, n - num_blocks)
                self._owned[request_id] = (start, num_blocks)
                return start
        return None

    def free(self, request_id: str) -> None:
        """Return ``request_id``'s range to the pool. Unknown ids are ignored."""
        rng = self._owned.pop(request_id, None)
        if rng is None:
            return
        self._free.append(rng)
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged

    def owned(self, request_id: str) -> tuple[int, int] | None:
        """``(start, num_blocks)`` held by ``request_id``, or None."""
        return self._owned.get(request_id)

    # ---- addressing ---------------------------------------------------------------------
    def view(self, layer: int, start: int, num_blocks: int) -> torch.Tensor:
        """Flat view ``[num_blocks * block_elems]`` of layer ``layer``'s part of a range."""
        if not (0 <= start and start + num_blocks <= self.num_blocks and 0 <= layer < self.num_layers):
            raise ValueError(f"staging range ({layer}, {start}, {num_blocks}) outside the pool")
        e = self.block_elems
        return self.buffer[layer, start * e:(start + num_blocks) * e]

    def region(self, layer: int, start: int, num_blocks: int) -> tuple[int, int, int]:
        """``(addr, nbytes, device)`` of :meth:`view` for NIXL (``tensor_region``)."""
        return tensor_region(self.view(layer, start, num_blocks))

    def layer_regions(self) -> list[tuple[int, int, int]]:
        """One region per layer covering the whole pool (what peers may write)."""
        return [self.region(layer, 0, self.num_blocks) for layer in range(self.num_layers)]
