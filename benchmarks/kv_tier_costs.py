"""The constants of the KV router's tier cost model, measured: what loading one KV block
back from the host tier, or from the disk tier, costs, as a share of prefilling it.

The KV-aware prefill policy (``epd.router.policies.KVAwarePrefill``) counts a block an
instance holds in its host or disk tier as that share of a block it must prefill
(``TIER_BLOCK_COST``). Here, with the embedded SmolLM2-135M-Instruct at its serving dtype
and block size 16:

- prefill: one 1,024-token prompt, no cache hit (``LLM.generate``, 1 output token), per
  block of 16 tokens; the median of ``REPEAT`` runs;
- host: ``HostKVTier.load`` (host slot -> KV cache block, every layer, K and V);
- disk: ``DiskKVTier.load`` (file -> host slot: ``preadv`` and the copy), warm (page
  cache) and cold (after ``posix_fadvise(DONTNEED)``, so read from the device);
  add ``host`` for disk -> device;
- remote: a remote prefix read (``epd.transfer.remote_prefix``): one NIXL READ of
  ``READ_BLOCKS`` blocks (every layer's K and V) from another agent's KV cache into
  this one's, per block; and the pin round trip (``PrefixPin`` out, ``PrefixPinned``
  back, as NIXL notifications), per read. Both agents live in this process (UCX picks
  its shared-memory transports, as between two workers on one host); a real holder
  answers between its engine steps, which adds up to one step to the round trip.

    python benchmarks/kv_tier_costs.py [--disk-dir /var/tmp]

Prints a table; writes ``benchmarks/results/kv_tier_costs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _common import ROOT, git_commit, load_avg

from epd import LLM, SamplingParams
from epd.engine.disk_kv_tier import DiskKVTier
from epd.engine.host_kv_tier import HostKVTier

PROMPT_TOKENS = 1024
BLOCK = 16
REPEAT = 5
BLOCKS = 256  # blocks copied per tier measurement
READ_BLOCKS = 16  # blocks per remote read (a 256-token prefix)


def _per_block(fn, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n


def remote_read(k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[float, float]:
    """(seconds per block of a READ of ``READ_BLOCKS`` blocks, seconds per pin round trip)
    between two NIXL agents, the holder's KV cache being ``k`` / ``v``."""
    import numpy as np

    from epd.messages import PrefixPin, PrefixPinned, encode
    from epd.transfer import NixlTransport
    from epd.transfer.kv_connector import kv_layout
    from epd.transfer.regions import block_regions

    holder, reader = NixlTransport("holder"), NixlTransport("reader")
    try:
        rk, rv = torch.empty_like(k), torch.empty_like(v)
        h_regions, r_regions = holder.register([k, v]), reader.register([rk, rv])
        holder.add_peer(reader.metadata(), r_regions, "reader")
        reader.add_peer(holder.metadata(), h_regions, "holder")
        hl, rl = kv_layout(k, v, BLOCK, 1, None), kv_layout(rk, rv, BLOCK, 1, None)
        bb = hl.block_bytes

        def regions(layout, ids):
            return np.concatenate([block_regions(r[layer], bb, ids) for layer in range(layout.num_layers)
                                   for r in (layout.k_regions, layout.v_regions)])

        reads = n // READ_BLOCKS
        t0 = time.perf_counter()
        for i in range(reads):
            ids = list(range(i * READ_BLOCKS, (i + 1) * READ_BLOCKS))
            t = reader.read("holder", regions(rl, ids), regions(hl, ids))
            while not t.poll():
                holder.progress()  # (a worker progresses its agent every loop turn)
        per_block = (time.perf_counter() - t0) / (reads * READ_BLOCKS)
        assert torch.equal(rk[:, :reads * READ_BLOCKS], k[:, :reads * READ_BLOCKS])
        hashes = [i.to_bytes(16, "big") for i in range(READ_BLOCKS)]
        trips = []
        for i in range(20):
            t0 = time.perf_counter()
            reader.send_notif("holder", encode(PrefixPin("r", i, hashes)))
            while not (got := holder.get_notifs()):
                holder.progress()
            holder.send_notif("reader", encode(PrefixPinned("r", i, list(range(READ_BLOCKS)))))
            while not reader.get_notifs():
                reader.progress()
            trips.append(time.perf_counter() - t0)
            assert got
        return per_block, statistics.median(trips[2:])
    finally:
        holder.close()
        reader.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--disk-dir", default="/var/tmp", help="a directory on the disk to measure")
    args = ap.parse_args()
    llm = LLM(None, block_size=BLOCK, kv_cache_memory_gb=0.25, enable_prefix_caching=False)
    try:
        eng = llm.engine
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        prompts = [[100 + (7 * r + k) % 5000 for k in range(PROMPT_TOKENS)] for r in range(REPEAT + 1)]
        llm.generate([prompts[0]], params)  # warm-up
        runs = []
        for p in prompts[1:]:
            t0 = time.perf_counter()
            llm.generate([p], params)
            runs.append(time.perf_counter() - t0)
        prefill = statistics.median(runs) / (PROMPT_TOKENS // BLOCK)
        k, v = eng.runner.k_cache, eng.runner.v_cache
        n = min(BLOCKS, k.shape[1])
        host = HostKVTier(k, v, n)
        for i in range(n):
            host.offload(bytes(16 - len(str(i))) + str(i).encode(), i)
        host_s = _per_block(lambda i: host.load(i, i), n)
        disk = DiskKVTier(args.disk_dir, (k.shape[0], *k.shape[2:]), k.dtype, n)
        try:
            keys = [i.to_bytes(16, "big") for i in range(n)]
            for i in range(n):
                disk.store(keys[i], host.host_k[:, i], host.host_v[:, i])
            out_k, out_v = host.host_k[:, 0].clone(), host.host_v[:, 0].clone()
            disk_warm = _per_block(lambda i: disk.load(keys[i], out_k, out_v), n)
            os.fsync(disk._fd)
            os.posix_fadvise(disk._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            disk_cold = _per_block(lambda i: disk.load(keys[i], out_k, out_v), n)
        finally:
            disk.close()
        remote_s, pin_trip_s = remote_read(k, v, n)
        block_bytes = 2 * k[:, 0].numel() * k.element_size()
        dtype = str(k.dtype).removeprefix("torch.")
    finally:
        llm.shutdown()
    rows = {"prefill": prefill, "host": host_s, "disk (warm)": disk_warm + host_s, "disk (cold)": disk_cold + host_s,
            "remote (read)": remote_s}
    print(f"SmolLM2-135M, {dtype} KV, block {BLOCK} tokens = {block_bytes / 2**10:.0f} KiB, {torch.get_num_threads()} "
          f"threads, disk dir {args.disk_dir}")
    print(f"{'per block':<14}{'ms':>10}{'share of prefill':>20}")
    for name, s in rows.items():
        print(f"{name:<14}{s * 1e3:>10.3f}{s / prefill:>20.4f}")
    print(f"{'pin round trip':<14}{pin_trip_s * 1e3:>10.3f}{pin_trip_s / prefill:>20.4f}  (per read, "
          f"in blocks of prefill)")
    out = ROOT / "benchmarks" / "results" / "kv_tier_costs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"commit": git_commit(), "load_avg": load_avg(), "block_tokens": BLOCK,
                               "block_bytes": block_bytes, "kv_dtype": dtype, "disk_dir": args.disk_dir,
                               "seconds_per_block": rows, "pin_round_trip_s": pin_trip_s,
                               "remote_read_blocks": READ_BLOCKS,
                               "share_of_prefill": {k: s / prefill for k, s in rows.items()}}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
