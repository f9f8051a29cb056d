"""Host and device memory in one NIXL agent: the region device field (0 host, 1 + i
cuda:i), NIXL's descriptors for each side of a transfer, and device staging's limits.

The VRAM path itself runs on a GPU only (tests/gpu/check.py); here the bookkeeping that
decides what NIXL is asked to move, which a wrong device number would silently break.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epd.messages import RankTarget
from epd.transfer.rank_agent import plan_send
from epd.transfer.regions import HOST, device_code, layer_regions, nixl_descs, tensor_region
from epd.transfer.staging import StagingPool


def test_host_regions_keep_nixl_device_zero():
    arr = np.array([[4096, 64, HOST], [8192, 32, HOST]], dtype=np.int64)
    mem, descs = nixl_descs(arr, "x")
    assert mem == "DRAM"
    assert descs.dtype == np.uint64 and descs.tolist() == arr.tolist()


def test_device_regions_become_vram_of_their_gpu():
    arr = np.array([[4096, 64, 1], [8192, 32, 3]], dtype=np.int64)  # cuda:0 and cuda:2
    mem, descs = nixl_descs(arr, "x")
    assert mem == "VRAM"
    assert descs[:, 2].tolist() == [0, 2]
    assert descs[:, :2].tolist() == arr[:, :2].tolist()
    assert arr[:, 2].tolist() == [1, 3]  # the caller's array is not changed


def test_host_and_device_in_one_side_of_a_transfer_is_refused():
    with pytest.raises(ValueError, match="host and device regions mixed"):
        nixl_descs(np.array([[4096, 64, HOST], [8192, 32, 1]], dtype=np.int64), "WRITE local")


def test_cpu_tensors_are_host_regions():
    cache = torch.zeros(3, 4, 8)
    assert device_code(cache) == HOST
    regions = layer_regions(cache)
    assert [r[0] for r in regions] == [cache[i].data_ptr() for i in range(3)]
    assert {r[1] for r in regions} == {4 * 8 * 4} and {r[2] for r in regions} == {HOST}
    assert tensor_region(cache) == (cache.data_ptr(), cache.nbytes, HOST)


def test_shared_memory_staging_cannot_live_on_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="host memory"):
        StagingPool(2, 4, 16, torch.float32, shm_path=str(tmp_path / "pool"), device="cuda:0")
    assert not (tmp_path / "pool").exists()


def test_private_staging_regions_carry_their_device():
    pool = StagingPool(2, 4, 16, torch.float32)  # a per-rank pool, on the CPU here
    assert [r[2] for r in pool.layer_regions()] == [HOST, HOST]
    assert pool.region(1, 2, 1) == (pool.buffer[1, 32:48].data_ptr(), 64, HOST)


def test_rank_writes_target_the_decode_ranks_memory():
    """A decode rank whose staging is VRAM of cuda:1 (device field 2): every write planned
    to it names that memory, so NIXL builds VRAM descriptors for the remote side."""
    from epd.messages import KVLayout, RankKV

    block = 2 * 4 * 4 * 16 * 4  # K and V, block_size 4, 4 heads, head_dim 16, fp32
    ranks = [RankKV("d", b"", [], [], [(1 << 30, 1 << 20, 2), (1 << 31, 1 << 20, 2)]),
             RankKV("d.tp1", b"", [], [], [(1 << 32, 1 << 20, 3), (1 << 33, 1 << 20, 3)])]
    layout = KVLayout(2, 8, 4, 2, 16, "float32", [], [], tp=2, staging_block_bytes=block,
                      kv_agents="per-rank", ranks=ranks)
    send = plan_send("r", 0, 3, block, 1, layout, 1)
    assert {(t.agent, t.device) for t in send.targets} == {("d", 2), ("d.tp1", 3)}
    old = RankTarget(0, "d", 0, 1, [1 << 30])  # a plan without the field: host memory
    assert old.device == HOST
