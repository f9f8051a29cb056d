"""Memory regions as the data plane sees them: ``(addr, nbytes, device)`` triples.

Descriptor tables cross the control plane as plain integer triples (``Region``; the
device field folds in the memory type: ``HOST`` 0 = DRAM, ``1 + i`` = VRAM of
``cuda:i``). Everything here validates them (``as_region_array``), checks that a
range lies inside exactly one registered or advertised region (``RegionTable``),
merges adjacent pairs (``coalesce``) and builds them from tensors (``tensor_region``,
``layer_regions``, ``block_regions``) or for NIXL (``nixl_descs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from epd.messages import Region

__all__ = ["HOST", "RegionTable", "as_region_array", "block_regions", "check_disjoint", "coalesce", "device_code",
           "layer_regions", "nixl_descs", "tensor_region"]

HOST = 0  # the device field of a host (DRAM) region; 1 + i: VRAM of cuda:i
# Addresses and lengths are kept in int64 with the device folded into the top bits of
# a sort key: user-space (and CUDA UVA) addresses are far below 2**56.
_ADDR_LIMIT = 1 << 56
_MAX_DEVICE = 127


def as_region_array(regions: Any, what: str) -> np.ndarray:
    """Validate (addr, nbytes, dev) triples; return an int64 [N, 3] array (a copy)."""
    if isinstance(regions, np.ndarray):
        arr = regions
    else:
        try:
            arr = np.asarray(regions)
        except (ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"{what}: not a list of (addr, nbytes, dev) integers: {e}") from e
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0:
        raise ValueError(f"{what}: expected a non-empty list of (addr, nbytes, dev), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: region fields must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u":
        if (arr > _ADDR_LIMIT).any():
            raise ValueError(f"{what}: address or length out of range")
    arr = arr.astype(np.int64)
    addr, nbytes, dev = arr[:, 0], arr[:, 1], arr[:, 2]
    bad = (addr < 0) | (addr > _ADDR_LIMIT) | (nbytes <= 0) | (nbytes > _ADDR_LIMIT)
    bad |= (dev < 0) | (dev > _MAX_DEVICE)
    if not bad.any():
        bad |= addr + nbytes > _ADDR_LIMIT
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{what}: invalid region #{i} {tuple(int(v) for v in arr[i])}")
    return arr


def _keys(arr: np.ndarray) -> np.ndarray:
    return (arr[:, 2] << 56) | arr[:, 0]


def check_disjoint(arr: np.ndarray, what: str) -> None:
    """Ranges on the same device must not overlap."""
    if len(arr) < 2:
        return
    order = np.argsort(_keys(arr), kind="stable")
    s = arr[order]
    same_dev = s[1:, 2] == s[:-1, 2]
    overlap = same_dev & (s[1:, 0] < s[:-1, 0] + s[:-1, 1])
    if overlap.any():
        i = int(np.flatnonzero(overlap)[0])
        raise ValueError(
            f"{what}: ranges {tuple(int(v) for v in s[i])} and {tuple(int(v) for v in s[i + 1])} overlap"
        )


class RegionTable:
    """Disjoint regions, searchable for 'is this range inside exactly one region'."""

    def __init__(self, arr: np.ndarray, what: str):
        check_disjoint(arr, what)
        order = np.argsort(_keys(arr), kind="stable")
        self.arr = arr[order]
        self.keys = _keys(self.arr)
        self.ends = self.arr[:, 0] + self.arr[:, 1]

    def locate(self, descs: np.ndarray, what: str) -> np.ndarray:
        """Index of the region holding each descriptor; ValueError if any lies outside."""
        idx = np.searchsorted(self.keys, _keys(descs), side="right") - 1
        ok = idx >= 0
        idx_c = np.maximum(idx, 0)
        ok &= self.arr[idx_c, 2] == descs[:, 2]
        ok &= descs[:, 0] + descs[:, 1] <= self.ends[idx_c]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"{what} #{i} {tuple(int(v) for v in descs[i])} lies outside the allowed regions")
        return idx


def coalesce(
    local: np.ndarray, remote: np.ndarray, lidx: np.ndarray, ridx: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merge consecutive pairs that are adjacent on both sides and inside the same
    registered/advertised region on both sides (pairs are first sorted by local addr)."""
    if len(local) == 1:
        return local, remote
    order = np.lexsort((local[:, 0], local[:, 2]))
    local, remote, lidx, ridx = local[order], remote[order], lidx[order], ridx[order]
    join = (local[1:, 0] == local[:-1, 0] + local[:-1, 1]) & (remote[1:, 0] == remote[:-1, 0] + remote[:-1, 1])
    join &= (lidx[1:] == lidx[:-1]) & (ridx[1:] == ridx[:-1])
    if not join.any():
        return local, remote
    starts = np.flatnonzero(np.concatenate(([True], ~join)))
    lengths = np.add.reduceat(local[:, 1], starts)
    out_l, out_r = local[starts].copy(), remote[starts].copy()
    out_l[:, 1] = lengths
    out_r[:, 1] = lengths
    return out_l, out_r


def device_code(t: torch.Tensor) -> int:
    """The region device field of tensor ``t``'s memory: ``HOST`` (0) for CPU memory,
    ``1 + i`` for ``cuda:i`` (VRAM)."""
    dev = t.get_device()
    return HOST if dev < 0 else 1 + int(dev)


def tensor_region(t: torch.Tensor) -> Region:
    """(addr, nbytes, device) of a contiguous tensor (device: ``device_code``)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return (int(t.data_ptr()), int(t.numel() * t.element_size()), device_code(t))


def layer_regions(cache: torch.Tensor) -> list[Region]:
    """One region per layer of a contiguous ``[num_layers, ...]`` tensor (a paged KV
    cache ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``)."""
    return [tensor_region(cache[i]) for i in range(cache.shape[0])]


def nixl_descs(arr: np.ndarray, what: str) -> tuple[str, np.ndarray]:
    """NIXL's memory type and ``[N, 3]`` uint64 (addr, nbytes, device id) descriptors of
    validated regions ``arr`` (``as_region_array``) that are all host or all device memory.

    Raises:
        ValueError: host and device regions mixed in one side of one transfer.
    """
    host = arr[:, 2] == HOST
    if host.all():
        return "DRAM", arr.astype(np.uint64)
    if host.any():
        raise ValueError(f"{what}: host and device regions mixed in one transfer")
    out = arr.copy()
    out[:, 2] -= 1
    return "VRAM", out.astype(np.uint64)


def block_regions(base: Region, block_nbytes: int, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Regions [N, 3] (int64) of blocks `block_ids` of a buffer laid out as
    [num_blocks, block_nbytes] starting at `base`; ids are checked against the buffer."""
    addr, nbytes, dev = base
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if block_nbytes <= 0 or nbytes % block_nbytes:
        raise ValueError(f"block size {block_nbytes} does not divide the region size {nbytes}")
    if len(ids) and (ids.min() < 0 or ids.max() >= nbytes // block_nbytes):
        raise ValueError("block id out of range")
    out = np.empty((len(ids), 3), dtype=np.int64)
    out[:, 0] = addr + ids * block_nbytes
    out[:, 1] = block_nbytes
    out[:, 2] = dev
    return out
