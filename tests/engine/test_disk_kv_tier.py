"""The prefix cache's disk tier (``epd.engine.disk_kv_tier``) under the host tier: what
the host tier evicts is written to one anonymous file and read back on a later hit, bytes
intact, in LRU order; a failed write is a miss, never wrong KV; greedy output after a
block went device -> host -> disk -> device equals transformers' ``generate``."""

from __future__ import annotations

import os

import pytest
import torch

from epd import LLM, SamplingParams
from epd.engine.disk_kv_tier import DiskKVTier
from epd.engine.host_kv_tier import HostKVTier
from tests.conftest import hf_greedy

BS = 4
NUM_BLOCKS = 6


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers 2, blocks, BS, heads 1, dim 2] with every block's K distinct."""
    k = torch.arange(2 * NUM_BLOCKS * BS * 2, dtype=torch.float32).reshape(2, NUM_BLOCKS, BS, 1, 2).to(dtype)
    return k, (255 - k) if dtype == torch.uint8 else -k


def _disk(path, dtype: torch.dtype, num_blocks: int) -> DiskKVTier:
    return DiskKVTier(path, (2, BS, 1, 2), dtype, num_blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_host_evictions_go_to_disk_and_come_back_intact(tmp_path, dtype):
    k, v = _caches(dtype)
    want_k, want_v = k.clone(), v.clone()
    tier = HostKVTier(k, v, 1, disk=_disk(tmp_path, dtype, 8))
    try:
        for i, h in enumerate((b"a", b"b", b"c")):
            tier.offload(h, i)  # a, then b, are pushed down to disk
        assert set(tier.index) == {b"c"} and set(tier.disk.index) == {b"a", b"b"}
        assert b"a" in tier and b"z" not in tier
        assert list(tmp_path.iterdir()) == []  # the file has no name: nothing outlives the process
        k.zero_(), v.zero_()
        slot = tier.lookup(b"a")  # read back into the host slot (c goes down to disk)
        assert slot is not None and tier.disk_hits == 1 and set(tier.index) == {b"a"}
        tier.load(slot, 5)
        assert torch.equal(k[:, 5], want_k[:, 0]) and torch.equal(v[:, 5], want_v[:, 0])
        slot = tier.lookup(b"c")
        tier.load(slot, 4)
        assert torch.equal(k[:, 4], want_k[:, 2]) and torch.equal(v[:, 4], want_v[:, 2])
        assert tier.stats()["kv_disk_loaded_blocks"] == 2 and tier.stats()["kv_disk_stored_blocks"] == 3
    finally:
        tier.close()


def test_full_disk_tier_drops_least_recently_used(tmp_path):
    k, v = _caches(torch.float32)
    disk = _disk(tmp_path, torch.float32, 2)
    try:
        for i, h in enumerate((b"a", b"b")):
            disk.store(h, k[:, i], v[:, i])
        out_k, out_v = torch.zeros_like(k[:, 0]), torch.zeros_like(v[:, 0])
        assert disk.load(b"a", out_k, out_v)  # a is now the most recently used
        disk.store(b"c", k[:, 2], v[:, 2])
        assert set(disk.index) == {b"a", b"c"} and disk.evictions == 1
        assert not disk.load(b"b", out_k, out_v)
        assert disk.load(b"c", out_k, out_v) and torch.equal(out_k, k[:, 2]) and torch.equal(out_v, v[:, 2])
    finally:
        disk.close()
    with pytest.raises(ValueError, match="at least one block"):
        _disk(tmp_path, torch.float32, 0)


def test_a_failed_write_is_a_miss_not_wrong_kv(tmp_path):
    """Writes to a full device (``/dev/full``: ENOSPC) drop their entries: the host
    tier's lookup misses, the caller's block is untouched, the error is counted."""
    k, v = _caches(torch.float32)
    tier = HostKVTier(k, v, 1, disk=_disk(tmp_path, torch.float32, 4))
    full = os.open("/dev/full", os.O_WRONLY)
    real_fd, tier.disk._fd = tier.disk._fd, full
    try:
        tier.offload(b"a", 0)
        tier.offload(b"b", 1)  # a's write to disk fails
        assert b"a" in tier  # not known to have failed until it is read
        assert tier.lookup(b"a") is None
        assert b"a" not in tier and tier.disk.write_errors == 1 and tier.disk_hits == 0
        assert set(tier.index) == {b"b"}  # found failed before a host slot was taken: b stays
        tier.disk._fd = real_fd
        tier.offload(b"c", 2)  # b goes down, written for real this time
        k.zero_()
        assert tier.lookup(b"b") is not None and tier.disk_hits == 1
    finally:
        tier.disk._fd = real_fd
        os.close(full)
        tier.close()


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return tiny_model_dirs["llama"]


def test_greedy_parity_after_eviction_to_disk_and_back(llama, tmp_path):
    """A 12-block cache and a 2-block host tier: prompt A, then B and C push A's blocks
    through the host tier to disk; A again reads them back (disk hits) and answers as
    transformers does."""
    from epd.config import EngineConfig

    prompts = [list(range(20, 61)), [7 + (k * 37) % 300 for k in range(41)], [9 + (k * 53) % 400 for k in range(41)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = hf_greedy(llama, prompts[:1], 8)[0]
    block_gb = EngineConfig(llama, dtype="float32", block_size=8).kv_bytes_per_block() / 2**30
    llm = LLM(llama, dtype="float32", block_size=8, num_kv_blocks=12, kv_host_cache_gb=2 * block_gb,
              kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01)
    try:
        for p in prompts:
            llm.generate([p], params)
        s = llm.engine.stats()
        assert s["kv_host_blocks"] == 2 and s["kv_disk_stored_blocks"] >= 3, s
        out = llm.generate([prompts[0]], params)[0].outputs[0]
        s = llm.engine.stats()
        assert s["prefix_cache_host_hit_tokens"] == 5 * 8 and s["prefix_cache_disk_hit_tokens"] >= 3 * 8, s
        assert list(out.token_ids) == want
        assert s["num_free_blocks"] == 12 and s["kv_disk_write_errors"] == 0
    finally:
        llm.shutdown()


def test_disk_tier_needs_a_directory_a_size_and_the_host_tier(llama, tmp_path):
    from epd.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="under the host tier"):
        EngineConfig(llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=1.0)
    with pytest.raises(ConfigError, match="both kv_disk_cache_dir and kv_disk_cache_gb"):
        EngineConfig(llama, kv_host_cache_gb=1.0, kv_disk_cache_gb=1.0)
    with pytest.raises(ConfigError, match="not a directory"):
        EngineConfig(llama, kv_host_cache_gb=1.0, kv_disk_cache_dir=str(tmp_path / "nope"), kv_disk_cache_gb=1.0)


def test_a_failed_read_is_a_miss(tmp_path):
    k, v = _caches(torch.float32)
    disk = _disk(tmp_path, torch.float32, 2)
    dropped = []
    disk.on_drop = dropped.append
    write_only = os.open("/dev/full", os.O_WRONLY)
    try:
        disk.store(b"a", k[:, 0], v[:, 0])
        assert disk.readable(b"a")
        real_fd, disk._fd = disk._fd, write_only  # reads now fail (EBADF)
        out_k, out_v = torch.zeros_like(k[:, 0]), torch.zeros_like(v[:, 0])
        assert not disk.load(b"a", out_k, out_v)
        assert disk.read_errors == 1 and b"a" not in disk and dropped == [b"a"] and not out_k.any()
        disk._fd = real_fd
    finally:
        os.close(write_only)
        disk.close()


def test_queued_writes_are_bounded(tmp_path, monkeypatch):
    """With the writer stuck, ``store`` waits once ``MAX_QUEUED_WRITES`` copies are queued."""
    import threading

    from epd.engine import disk_kv_tier

    monkeypatch.setattr(disk_kv_tier, "MAX_QUEUED_WRITES", 2)
    k, v = _caches(torch.float32)
    disk = _disk(tmp_path, torch.float32, 4)
    gate = threading.Event()
    disk._queued.append(disk._writer.submit(gate.wait))  # the disk is slow
    try:
        disk.store(b"a", k[:, 0], v[:, 0])
        third = threading.Thread(target=disk.store, args=(b"b", k[:, 1], v[:, 1]))
        third.start()
        third.join(0.5)
        assert third.is_alive() and b"b" not in disk  # waiting for room
        gate.set()
        third.join(10)
        assert not third.is_alive() and b"b" in disk and len(disk._queued) <= 2
    finally:
        gate.set()
        disk.close()
