"""StagingPool: contiguous ranges, merge on free, addressing, shared memory across processes."""

import multiprocessing as mp
import os

import pytest
import torch

from epd.transfer.staging import StagingPool, StagingPoolError


def test_alloc_free_merge_and_leak_free():
    pool = StagingPool(2, 10, 4, torch.float32)
    a = pool.alloc("a", 3)
    b = pool.alloc("b", 4)
    c = pool.alloc("c", 3)
    assert (a, b, c) == (0, 3, 7) and pool.num_free_blocks == 0
    assert pool.alloc("d", 1) is None  # full: the caller waits
    pool.free("b")
    assert pool.alloc("d", 5) is None and pool.can_alloc(4) and not pool.can_alloc(5)
    pool.free("a")  # merges with b's range: 0..6 free
    assert pool.alloc("d", 7) == 0 and pool.owned("d") == (0, 7)
    for rid in ("c", "d", "d", "unknown"):  # double and unknown frees are no-ops
        pool.free(rid)
    assert pool.num_free_blocks == 10 and pool.alloc("e", 10) == 0


def test_alloc_errors():
    pool = StagingPool(1, 4, 2, torch.float32)
    with pytest.raises(StagingPoolError, match="needs 5 staging blocks but the pool has 4"):
        pool.alloc("a", 5)
    pool.alloc("a", 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.alloc("a", 1)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.view(0, 3, 2)


def test_regions_are_contiguous_per_layer():
    pool = StagingPool(3, 8, 6, torch.float32)
    start = pool.alloc("r", 3)
    for layer in range(3):
        addr, nbytes, dev = pool.region(layer, start, 3)
        assert nbytes == 3 * 6 * 4 and dev == 0
        assert addr == pool.layer_regions()[layer][0] + start * 6 * 4
    assert pool.region(1, 0, 1)[0] - pool.region(0, 0, 1)[0] == 8 * 6 * 4


def _child_write(path: str) -> None:
    pool = StagingPool(1, 2, 4, torch.float32, shm_path=path, create=False)
    pool.view(0, 1, 1).fill_(7.0)


def test_shared_memory_seen_by_another_process(tmp_path):
    path = str(tmp_path / "staging")
    pool = StagingPool(1, 2, 4, torch.float32, shm_path=path)
    p = mp.get_context("spawn").Process(target=_child_write, args=(path,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    pool.unlink()
    assert not os.path.exists(path)
    assert torch.equal(pool.view(0, 1, 1), torch.full((4,), 7.0)) and not pool.view(0, 0, 1).any()
