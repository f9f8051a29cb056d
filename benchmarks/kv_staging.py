"""Cost of heterogeneous-TP staging on the CPU: pack + unpack vs the block gather alone.

SmolLM2-135M-Instruct geometry (30 layers, 3 KV heads, head_dim 64, fp32, 16-token
blocks). For each prompt length, the request's blocks (random ids) go

* ``pack``: from the prefill side's ``src_tp`` rank caches into the staging region
  (``epd.kernels.kv_staging.pack_kv``, torch path, every rank's part, all layers);
* ``unpack``: from that region into the decode side's ``dst_tp`` rank caches (all
  layers, every rank);
* ``gather``: the same blocks with all heads, ``index_select`` into a contiguous buffer
  (what a same-TP block-to-block copy must read and write at least once).

One torch thread, best of 10 after a warm-up (the machine may be shared). Bytes = K and V of every block of every
layer. NIXL requests per request are the number of layers whatever the length (one
contiguous staging region per layer), against one descriptor per block and K/V per
layer for the direct path with scattered blocks.

    python benchmarks/kv_staging.py                 # 128 .. 4096 tokens, 3 -> 1 and 1 -> 3
    python benchmarks/kv_staging.py --lengths 1024  # one length

Writes benchmarks/results/kv_staging.json and kv_staging.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from epd.kernels.kv_staging import pack_kv, staging_shape, unpack_kv

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def _best(fn, repeats: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(length: int, src_tp: int, dst_tp: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = -(-length // BLOCK)
    num_blocks = 2 * n + 8
    hs, hd = KV_HEADS // src_tp, KV_HEADS // dst_tp
    src = [(torch.randn(LAYERS, num_blocks, BLOCK, hs, HEAD_DIM, generator=g),
            torch.randn(LAYERS, num_blocks, BLOCK, hs, HEAD_DIM, generator=g)) for _ in range(src_tp)]
    dst = [(torch.zeros(LAYERS, num_blocks, BLOCK, hd, HEAD_DIM), torch.zeros(LAYERS, num_blocks, BLOCK, hd, HEAD_DIM))
           for _ in range(dst_tp)]
    src_ids = torch.randperm(num_blocks, generator=g)[:n]
    dst_ids = torch.randperm(num_blocks, generator=g)[:n]
    shape = staging_shape(src_tp, n, BLOCK, KV_HEADS, HEAD_DIM)
    staging = torch.empty(LAYERS, *shape)

    def pack() -> None:
        for layer in range(LAYERS):
            for r, (k, v) in enumerate(src):
                pack_kv(k[layer], v[layer], src_ids, staging[layer, r])

    def unpack() -> None:
        for layer in range(LAYERS):
            for q, (k, v) in enumerate(dst):
                unpack_kv(staging[layer], k[layer], v[layer], dst_ids, q * hd)

    full = torch.randn(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    out = torch.empty(LAYERS, n, BLOCK, KV_HEADS, HEAD_DIM)

    def gather() -> None:
        for layer in range(LAYERS):
            torch.index_select(full[layer], 0, src_ids, out=out[layer])
            torch.index_select(full[layer], 0, src_ids, out=out[layer])  # K and V

    nbytes = 2 * LAYERS * n * BLOCK * KV_HEADS * HEAD_DIM * 4
    pack_s, unpack_s, gather_s = _best(pack), _best(unpack), _best(gather)
    pack()
    unpack()
    for q, (k, _v) in enumerate(dst):  # the round trip is exact
        want = torch.cat([sk for sk, _ in src], dim=3)[:, src_ids, :, q * hd:(q + 1) * hd]
        assert torch.equal(k[:, dst_ids], want)
    return {"length": length, "src_tp": src_tp, "dst_tp": dst_tp, "blocks": n, "kv_bytes": nbytes,
            "pack_s": pack_s, "unpack_s": unpack_s, "gather_s": gather_s,
            "pack_gbps": nbytes / pack_s / 1e9, "unpack_gbps": nbytes / unpack_s / 1e9,
            "gather_gbps": nbytes / gather_s / 1e9, "nixl_requests_staged": LAYERS,
            "nixl_descs_direct": LAYERS * 2 * n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 4096])
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(n, s, d) for n in args.lengths for s, d in ((3, 1), (1, 3))]
    print(f"{'tokens':>7} {'TP':>5} {'KV MB':>7} {'pack ms':>8} {'unpack ms':>9} {'gather ms':>9} "
          f"{'pack GB/s':>9} {'unpack GB/s':>11} {'NIXL req':>8} {'direct descs':>12}")
    for r in rows:
        print(f"{r['length']:>7} {r['src_tp']}->{r['dst_tp']:<2} {r['kv_bytes'] / 2**20:>7.1f} "
              f"{r['pack_s'] * 1e3:>8.2f} {r['unpack_s'] * 1e3:>9.2f} {r['gather_s'] * 1e3:>9.2f} "
              f"{r['pack_gbps']:>9.2f} {r['unpack_gbps']:>11.2f} {r['nixl_requests_staged']:>8} "
              f"{r['nixl_descs_direct']:>12}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kv_staging.json").write_text(json.dumps({"rows": rows, "threads": 1}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (s, d), style in (((3, 1), "-o"), ((1, 3), "-s")):
        sel = [r for r in rows if (r["src_tp"], r["dst_tp"]) == (s, d)]
        ax.plot([r["length"] for r in sel], [r["pack_s"] * 1e3 for r in sel], style, label=f"pack {s}->{d}")
        ax.plot([r["length"] for r in sel], [r["unpack_s"] * 1e3 for r in sel], style, label=f"unpack {s}->{d}")
    sel = [r for r in rows if r["src_tp"] == 3]
    ax.plot([r["length"] for r in sel], [r["gather_s"] * 1e3 for r in sel], "k--", label="gather (same TP)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms per request (30 layers, 1 thread)")
    ax.set_title("KV staging cost, SmolLM2 geometry, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out_dir / "kv_staging.png", dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
