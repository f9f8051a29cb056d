"""The one prepared device check (issue 20): run it on a CUDA machine, read one JSON of figures.

    tests/gpu/run.sh [--dry-run] [--out FILE]      (or: make gpu-check)

Checks, each timed and recorded on its own (a failing one does not stop the others):

1. ``kernels``: every Triton kernel (store_kv, paged decode attention, KV staging
   pack/unpack) against its torch reference on random inputs, compiled for real on CUDA
   (fp32 and bf16); max abs error per kernel.
2. ``parity``: the offline engine (``epd.LLM``) greedy on a tiny random Llama vs
   transformers ``generate`` on the same device and dtype (bf16 on CUDA): tokens equal,
   and the chosen tokens' logprobs close (max abs difference reported).
3. ``serve_p1d1``: ``epd launch --pools p:1,d:1`` on that model answers like the offline engine.
4. ``staged_2to1``: a TP 2 -> 1 staged transfer between two processes: two prefill rank
   agents (this process) pack their heads (``pack_kv``) and write them, planned by
   ``epd.transfer.rank_agent.plan_send``, into a decode agent's staging buffer (a second
   process), which unpacks them (``unpack_kv``) and must hold the reference cache
   exactly. On CUDA the buffers are VRAM; if UCX cannot register VRAM there, the check
   falls back to host staging and says so (``memory``).
5. ``decode_roofline``: decode step time of a random ~0.5 B-parameter Llama at batch 1
   vs the HBM roofline (weight bytes / device copy bandwidth measured here).
6. ``cuda_graphs``: the same decode with CUDA graphs vs ``enforce_eager``: same tokens,
   step-time ratio.
7. ``layer_overlap``: per-layer NIXL writes posted behind the forward through
   ``LayerGate`` (CUDA events, polled): the share of transfer time hidden by compute.

``--dry-run``: the same code on the CPU with tiny sizes (Triton under TRITON_INTERPRET=1,
set by run.sh) so the suite runs it and it cannot rot; CUDA-only figures are "skipped".
Needs only torch, triton, transformers and epd's own dependencies (no internet).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _record(results: dict, name: str, fn, *args) -> None:
    t0 = time.monotonic()
    try:
        out = fn(*args)
        results[name] = {"status": out.pop("status", "ok"), **out}
    except Exception as e:  # every check reports, the run goes on
        results[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
    results[name]["seconds"] = round(time.monotonic() - t0, 2)
    print(f"[gpu-check] {name}: {results[name]['status']} ({results[name]['seconds']} s)", flush=True)


# ---------------------------------------------------------------- 1. kernels
def check_kernels(dev: str) -> dict:
    from epd.kernels import kv_staging, paged_attention, store_kv

    g = torch.Generator(device=dev).manual_seed(0)
    errs: dict = {}
    dtypes = [torch.float32, torch.bfloat16] if dev == "cuda" else [torch.float32]
    nb, bs, h, hq, d = 6, 4, 2, 4, 16
    for dt in dtypes:
        tag = str(dt).removeprefix("torch.")
        tol = 1e-5 if dt == torch.float32 else 2e-2

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=dev).to(dt)

        kc, vc = rnd(nb, bs, h, d), rnd(nb, bs, h, d)
        key, val = rnd(5, h, d), rnd(5, h, d)
        slots = torch.tensor([0, 3, 9, -1, 17], device=dev)
        ref_k, ref_v, tk, tv = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        store_kv.store_kvcache_ref(key, val, ref_k, ref_v, slots)
        store_kv.store_kvcache_triton(key, val, tk, tv, slots)
        errs[f"store_kv_{tag}"] = float(max((ref_k - tk).abs().max(), (ref_v - tv).abs().max()))
        q = rnd(2, hq, d)
        tables = torch.tensor([[0, 2, 4], [1, 3, 5]], device=dev, dtype=torch.int32)
        lens = torch.tensor([9, 12], device=dev, dtype=torch.int32)
        a = paged_attention.paged_decode_attention_ref(q, kc, vc, tables, lens, d ** -0.5)
        b = paged_attention.paged_decode_attention_triton(q, kc, vc, tables, lens, d ** -0.5)
        errs[f"paged_decode_attention_{tag}"] = float((a.float() - b.float()).abs().max())
        ids = torch.tensor([4, 1, 3], device=dev)
        out_r, out_t = (torch.empty(2, 3, bs, h, d, device=dev, dtype=dt) for _ in range(2))
        kv_staging.pack_kv_ref(kc, vc, ids, out_r)
        kv_staging.pack_kv_triton(kc, vc, ids, out_t)
        errs[f"pack_kv_{tag}"] = float((out_r.float() - out_t.float()).abs().max())
        staging = out_r.view(2, 2, 3, bs, 1, d)  # as if packed by 2 ranks of one head each: [src_tp, 2, n, bs, 1, d]
        k2r, v2r, k2t, v2t = (torch.zeros(nb, bs, 1, d, device=dev, dtype=dt) for _ in range(4))
        kv_staging.unpack_kv_ref(staging, k2r, v2r, ids, 1)
        kv_staging.unpack_kv_triton(staging, k2t, v2t, ids, 1)
        errs[f"unpack_kv_{tag}"] = float(max((k2r - k2t).abs().max(), (v2r - v2t).abs().max()))
        bad = {k: v for k, v in errs.items() if k.endswith(tag) and not v <= tol}
        if bad:
            raise AssertionError(f"kernels off their references: {bad}")
    # a quantized cache (uint8 rows of codes then scales, epd.kernels.kv_quant): the decode
    # kernel reads it in place; the reference attends to the dequantized cache
    from epd.kernels.kv_quant import dequantize_kv, quantize_kv, store_quantized_ref, store_quantized_triton

    for kind in ("int8", "fp8_e4m3"):
        # the fused quantize-and-store kernel writes the reference's bytes (count of bytes that differ)
        key = torch.randn(5, h, d, generator=g, device=dev) * torch.logspace(-3, 3, 5, device=dev).view(5, 1, 1)
        val = torch.randn(5, h, d, generator=g, device=dev)
        slots = torch.tensor([0, 3, 9, -1, 17], device=dev)
        rk, rv, tk, tv = (torch.zeros(nb, bs, h, quantize_kv(key[:1], kind).shape[-1], dtype=torch.uint8, device=dev)
                          for _ in range(4))
        store_quantized_ref(key, val, rk, rv, slots, kind)
        store_quantized_triton(key, val, tk, tv, slots, kind)
        errs[f"store_quantized_{kind}"] = float(int((rk != tk).sum()) + int((rv != tv).sum()))
        kc, vc = (quantize_kv(torch.randn(nb * bs, h, d, generator=g, device=dev), kind).view(nb, bs, h, -1)
                  for _ in range(2))
        q = torch.randn(2, hq, d, generator=g, device=dev)
        a = paged_attention.paged_decode_attention_ref(q, dequantize_kv(kc, kind, torch.float32),
                                                       dequantize_kv(vc, kind, torch.float32), tables, lens, d ** -0.5)
        b = paged_attention.paged_decode_attention_triton(q, kc, vc, tables, lens, d ** -0.5, kv_quant=kind)
        errs[f"paged_decode_attention_{kind}"] = float((a - b).abs().max())
        if not errs[f"paged_decode_attention_{kind}"] <= 1e-5 or errs[f"store_quantized_{kind}"]:
            raise AssertionError(f"quantized store or decode kernel off its reference: {errs}")
    # int8's per-channel K blocks and decode residual (KIVI layout; 16-token blocks): one
    # sequence with an open last block partly in the residual, one whose block just filled
    from epd.kernels.kv_quant import KResidual, dequantize_blocks, overlay_residual, quantize_channels

    cb = 16
    kf = torch.randn(4, cb, h, d, generator=g, device=dev) + 20.0 * (torch.arange(d, device=dev) == 3)
    kc = quantize_kv(kf.reshape(-1, h, d), "int8").view(4, cb, h, -1)
    vc = quantize_kv(torch.randn(4 * cb, h, d, generator=g, device=dev), "int8").view(4, cb, h, -1)
    kc[[0, 2, 3]] = quantize_channels(kf[[0, 2, 3]])
    ctab = torch.tensor([[0, 1], [2, 3]], device=dev, dtype=torch.int32)
    clens = torch.tensor([cb + 5, 2 * cb], device=dev, dtype=torch.int32)
    resid = KResidual(torch.randn(2, cb, h, d, generator=g, device=dev), torch.tensor([1, 0], device=dev),
                      torch.tensor([2, 0], device=dev))
    q = torch.randn(2, hq, d, generator=g, device=dev)
    kd, vd, rt = dequantize_blocks(kc, vc, ctab, "int8", torch.float32, clens)
    overlay_residual(kd, rt, clens, resid)
    a = paged_attention.paged_decode_attention_ref(q, kd, vd, rt, clens, d ** -0.5)
    b = paged_attention.paged_decode_attention_triton(q, kc, vc, ctab, clens, d ** -0.5, kv_quant="int8",
                                                      channel_k=True, resid=resid)
    errs["paged_decode_attention_int8_channel_k"] = float((a - b).abs().max())
    if not errs["paged_decode_attention_int8_channel_k"] <= 1e-5:
        raise AssertionError(f"per-channel int8 decode kernel off its reference: {errs}")
    return {"max_abs_err": errs, "compiled": dev == "cuda"}


# ---------------------------------------------------------------- 2. parity
def _tiny(work: Path) -> str:
    from epd.models.tiny import create_tiny_model

    path = work / "tiny-llama"
    if not path.exists():
        create_tiny_model("llama", path)
    return str(path)


def check_parity(dev: str, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from epd import LLM, SamplingParams

    model = _tiny(work)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    prompts = [[5, 6, 7, 8, 9], list(range(20, 61)), list(range(100, 133))]
    n = 12
    llm = LLM(model, dtype=str(dtype).removeprefix("torch."), device=dev, kv_cache_memory_gb=0.05,
              enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(dev).eval()
    agree, lp_diff = 0, 0.0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device=dev)
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0)
        want = gen.sequences[0, len(p):].tolist()
        got = o.outputs[0].token_ids
        agree += int(got == want)
        # compare the logprobs of the prefix where both agree
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                break
            ref = torch.log_softmax(gen.scores[i][0].float(), -1)[b].item()
            lp = o.outputs[0].logprobs[i]
            mine = lp[a].logprob if isinstance(lp, dict) else lp.logprob
            lp_diff = max(lp_diff, abs(mine - ref))
    tol = 0.1 if dev == "cuda" else 1e-2
    if agree < len(prompts) - (1 if dev == "cuda" else 0) or lp_diff > tol:  # bf16 may flip one near-tie
        raise AssertionError(f"{agree}/{len(prompts)} greedy sequences equal, logprob diff {lp_diff:.4g}")
    return {"dtype": str(dtype), "sequences_equal": agree, "of": len(prompts), "max_logprob_abs_diff": lp_diff}


# ---------------------------------------------------------------- 3. p:1,d:1
def check_serve(dev: str, work: Path) -> dict:
    import socket

    from epd import LLM, SamplingParams

    model = _tiny(work)
    dtype = "bfloat16" if dev == "cuda" else "float32"
    prompt = list(range(20, 61))
    llm = LLM(model, dtype=dtype, device=dev, kv_cache_memory_gb=0.05, enforce_eager=True)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    llm.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "epd.cli", "launch", "--model", model, "--pools", "p:1,d:1", "--port", str(port),
           "--dtype", dtype, "--kv-cache-memory-gb", "0.05"]
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        t0 = time.monotonic()
        while "serving" not in (work / "serve.log").read_text():
            if proc.poll() is not None or time.monotonic() - t0 > 240:
                raise RuntimeError("epd launch did not start: " + (work / "serve.log").read_text()[-1500:])
            time.sleep(0.5)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        t1 = time.monotonic()
        got = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]
        latency = time.monotonic() - t1
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if got != want:
        raise AssertionError(f"p:1,d:1 answered {got!r}, the offline engine {want!r}")
    return {"request_s": round(latency, 4), "startup_s": round(t1 - t0, 1)}


# ---------------------------------------------------------------- 4. staged TP 2 -> 1
LAYERS, NB, BS, H, D, N = 2, 8, 4, 4, 16, 3  # KV heads H, request of N blocks


def _decode_side(conn, dev: str, mem: str) -> None:
    from epd.kernels.kv_staging import staging_shape, unpack_kv
    from epd.transfer.nixl_transport import NixlTransport

    sys.path.insert(0, str(ROOT))
    t = NixlTransport("gpucheck-decode", progress_thread_us=1000)  # VRAM or DRAM: the tensors' device
    sdev = "cuda" if mem == "cuda" else "cpu"
    staging = torch.zeros(LAYERS, 2 * NB * BS * H * D, device=sdev)
    k = torch.zeros(LAYERS, NB, BS, H, D, device=dev)
    v = torch.zeros_like(k)
    regions = t.register([staging])  # register first: the metadata lists only what is registered
    conn.send((t.metadata(), regions))
    conn.recv()  # the prefill side's writes are done
    ids = torch.tensor([5, 0, 2], device=dev)
    for layer in range(LAYERS):
        part = staging[layer, :2 * N * BS * H * D].view(staging_shape(2, N, BS, H, D)).to(dev)
        unpack_kv(part, k[layer], v[layer], ids, 0)
    conn.send((k.cpu(), v.cpu()))
    conn.recv()
    t.close()


def check_staged(dev: str) -> dict:
    from epd.kernels.kv_staging import pack_kv
    from epd.messages import KVLayout, RankKV
    from epd.transfer.nixl_transport import NixlTransport, TransferError
    from epd.transfer.rank_agent import plan_send
    from epd.transfer.regions import tensor_region

    g = torch.Generator(device=dev).manual_seed(1)
    full_k = torch.randn(LAYERS, NB, BS, H, D, generator=g, device=dev)
    full_v = torch.randn(LAYERS, NB, BS, H, D, generator=g, device=dev)
    src_ids, dst_ids = [1, 6, 3], [5, 0, 2]
    mems = ["cuda", "cpu"] if dev == "cuda" else ["cpu"]
    notes = []
    for mem in mems:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_decode_side, args=(b, dev, mem), daemon=True)
        proc.start()
        try:
            if not a.poll(120):
                raise RuntimeError("decode process did not start")
            md, regions = a.recv()
            sdev = "cuda" if mem == "cuda" else "cpu"
            block = 2 * BS * H * D * 4  # one staging block, all heads, fp32 bytes
            layout = KVLayout(LAYERS, NB, BS, H, D, "float32", [], [], tp=1, staging_block_bytes=block,
                              kv_agents="per-rank",
                              ranks=[RankKV("gpucheck-decode", b"", [], [],
                                            [(regions[0][0] + layer * regions[0][1] // LAYERS,
                                              regions[0][1] // LAYERS, regions[0][2]) for layer in range(LAYERS)])])
            send = plan_send("r", 0, N, block, 2, layout, 0)
            agents, writes = [], 0
            t0 = time.monotonic()
            for r in range(2):  # two prefill ranks, each its own agent, heads [2r, 2r + 2)
                t = NixlTransport(f"gpucheck-prefill.tp{r}")
                agents.append(t)
                mine = torch.zeros(LAYERS, N * 2 * BS * (H // 2) * D, device=sdev)
                t.register([mine])
                t.add_peer(md, regions)
                for layer in range(LAYERS):
                    out = mine[layer].view(2, N, BS, H // 2, D)
                    k = full_k[layer, :, :, 2 * r:2 * r + 2].contiguous()
                    vv = full_v[layer, :, :, 2 * r:2 * r + 2].contiguous()
                    if out.device != k.device:
                        tmp = torch.empty(out.shape, device=k.device)
                        pack_kv(k, vv, torch.tensor(src_ids, device=dev), tmp)
                        out.copy_(tmp)
                    else:
                        pack_kv(k, vv, torch.tensor(src_ids, device=dev), out)
                    for tg in send.targets:
                        if tg.rank == r:
                            local = (mine[layer].data_ptr(), send.part_bytes, tensor_region(mine)[2])
                            remote = (tg.remote[layer], send.part_bytes, tg.device)
                            t.write("gpucheck-decode", [local], [remote]).wait(30)
                            writes += 1
            elapsed = time.monotonic() - t0
            a.send("done")
            k, v = a.recv()
            a.send("bye")
            want_k = torch.zeros_like(k)
            want_v = torch.zeros_like(v)
            want_k[:, dst_ids] = full_k[:, src_ids].cpu()
            want_v[:, dst_ids] = full_v[:, src_ids].cpu()
            if not (torch.equal(k, want_k) and torch.equal(v, want_v)):
                raise AssertionError(f"staged KV ({mem} memory) differs from the reference")
            for t in agents:
                t.close()
            proc.join(30)
            return {"memory": "VRAM" if mem == "cuda" else "DRAM", "writes": writes,
                    "expected_writes": LAYERS * 2, "seconds_incl_setup": round(elapsed, 4), "notes": notes}
        except (TransferError, ValueError) as e:
            notes.append(f"{mem} staging failed ({type(e).__name__}: {e}); falling back")
            proc.kill()
            if mem == mems[-1]:
                raise
        finally:
            if proc.is_alive():
                proc.kill()
    raise RuntimeError("unreachable")


# ---------------------------------------------------------------- 7. per-layer overlap
OV_LAYERS, OV_MB = 16, 8  # synthetic layers, MiB written per layer


def _sink_side(conn, nbytes: int, on_cuda: bool) -> None:
    from epd.transfer.nixl_transport import NixlTransport

    sys.path.insert(0, str(ROOT))
    t = NixlTransport("gpucheck-sink", progress_thread_us=1000)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda" if on_cuda else "cpu")
    regions = t.register([buf])
    conn.send((t.metadata(), regions))
    conn.recv()
    conn.send(int(buf[::4096].to(torch.int64).sum()))
    conn.recv()
    t.close()


def check_overlap(dev: str) -> dict:
    """Per-layer KV writes behind the forward: ``OV_LAYERS`` synthetic layers (matmuls on
    the device stream), each followed by a fill of that layer's ``OV_MB`` MiB "KV" and its
    NIXL write to a second process, posted through ``epd.engine.layer_gate.LayerGate`` (a
    CUDA event per layer, polled, never waited on until the end). Hidden share =
    (compute alone + transfers alone - both) / transfers alone."""
    from epd.engine.layer_gate import LayerGate
    from epd.transfer.nixl_transport import NixlTransport
    from epd.transfer.regions import tensor_region

    on_cuda = dev == "cuda"
    mb = OV_MB if on_cuda else 1
    per = mb << 20
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_sink_side, args=(b, per * OV_LAYERS, on_cuda), daemon=True)
    proc.start()
    t = None
    try:
        if not a.poll(120):
            raise RuntimeError("sink process did not start")
        md, regions = a.recv()
        t = NixlTransport("gpucheck-source")
        kv = torch.zeros(OV_LAYERS, per, dtype=torch.uint8, device=dev)
        t.register([kv])
        t.add_peer(md, regions)
        n = 2048 if on_cuda else 128
        x = torch.randn(n, n, device=dev)
        w = torch.randn(n, n, device=dev) / n ** 0.5

        def sync() -> None:
            if on_cuda:
                torch.cuda.synchronize()

        def run(compute: bool, send: bool) -> tuple[float, LayerGate]:
            gate = LayerGate(dev)
            xfers = []

            def post(layer: int) -> None:
                local = tensor_region(kv[layer])
                xfers.append(t.write("gpucheck-sink", [local], [(regions[0][0] + layer * per, per, regions[0][2])]))

            sync()
            t0 = time.perf_counter()
            y = x
            for layer in range(OV_LAYERS):
                if compute:
                    for _ in range(4):
                        y = torch.tanh(y @ w)
                kv[layer].fill_(layer + 1)  # this layer's "KV store"
                if send:
                    gate.push(layer, post)
            gate.flush()
            for xf in xfers:
                xf.wait(60)
            sync()
            return time.perf_counter() - t0, gate

        run(True, True)  # warm-up: kernels, UCX connection
        both, gate = min((run(True, True) for _ in range(3)), key=lambda r: r[0])
        compute = min(run(True, False)[0] for _ in range(3))
        transfer = min(run(False, True)[0] for _ in range(3))
        a.send("done")
        checksum = a.recv()
        a.send("bye")
        want = sum(layer + 1 for layer in range(OV_LAYERS)) * (per // 4096)
        if checksum != want:
            raise AssertionError(f"the sink holds other bytes than were written ({checksum} != {want})")
        hidden = max(0.0, compute + transfer - both) / transfer if transfer > 0 else 0.0
        out = {"layers": OV_LAYERS, "mib_per_layer": mb, "compute_ms": round(compute * 1e3, 3),
               "transfer_ms": round(transfer * 1e3, 3), "both_ms": round(both * 1e3, 3),
               "hidden_share": round(hidden, 3), "posted_during_forward": gate.posted_early,
               "posted_at_end": gate.posted_at_flush, "memory": "VRAM" if on_cuda else "DRAM"}
        if not on_cuda:
            out["status"] = "ok (dry run: CPU writes are synchronous, nothing to hide)"
        return out
    finally:
        if t is not None:
            t.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# ---------------------------------------------------------------- 5./6. decode speed
def _decode_model(dev: str, work: Path) -> tuple[str, int]:
    """A random Llama (on CUDA ~0.5 B parameters bf16; dry run: the tiny one) and its parameter count."""
    if dev != "cuda":
        path = _tiny(work)
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path)
        return path, c.num_hidden_layers * 12 * c.hidden_size ** 2 + c.vocab_size * c.hidden_size
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = work / "llama-0.5b"
    tiny = Path(_tiny(work))
    cfg = LlamaConfig.from_pretrained(tiny)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 1536, 4096, 16
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 12, 4, 128
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, path / f.name)
    return str(path), sum(p.numel() for p in model.parameters())


def _decode_ms(llm, n: int = 64) -> tuple[float, list[int]]:
    from epd import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    o = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    o = llm.generate([[5, 6, 7, 8]], p)
    total = time.perf_counter() - t0
    return (total - prefill) / (n - 1) * 1e3, o[0].outputs[0].token_ids


def check_decode(dev: str, work: Path, shared: dict) -> dict:
    from epd import LLM

    path, params = _decode_model(dev, work)
    dtype = "bfloat16" if dev == "cuda" else "float32"
    llm = LLM(path, dtype=dtype, device=dev, kv_cache_memory_gb=0.5 if dev == "cuda" else 0.05, enforce_eager=True)
    step_ms, tokens = _decode_ms(llm)
    llm.shutdown()
    shared.update(path=path, eager_ms=step_ms, tokens=tokens)
    out = {"params": params, "decode_step_ms": round(step_ms, 3)}
    if dev == "cuda":
        x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
        y = torch.empty_like(x)
        y.copy_(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        torch.cuda.synchronize()
        bw = 2 * x.nbytes * 10 / (time.perf_counter() - t0)  # read + write
        roof = params * 2 / bw * 1e3
        out.update(hbm_gbps=round(bw / 1e9, 1), roofline_ms=round(roof, 3), roofline_share=round(roof / step_ms, 3),
                   device_name=torch.cuda.get_device_name())
    else:
        out["status"] = "ok (dry run: no HBM roofline on CPU)"
    return out


def check_graphs(dev: str, shared: dict) -> dict:
    if dev != "cuda":
        return {"status": "skipped (CUDA graphs need CUDA)"}
    from epd import LLM

    llm = LLM(shared["path"], dtype="bfloat16", device=dev, kv_cache_memory_gb=0.5, enforce_eager=False)
    step_ms, tokens = _decode_ms(llm)
    llm.shutdown()
    if tokens != shared["tokens"]:
        raise AssertionError("CUDA-graph decode gave other tokens than eager decode")
    return {"graph_step_ms": round(step_ms, 3), "eager_step_ms": round(shared["eager_ms"], 3),
            "speedup": round(shared["eager_ms"] / step_ms, 3)}


CHECK_NAMES = ("kernels", "parity", "serve_p1d1", "staged_2to1", "decode_roofline", "cuda_graphs", "layer_overlap")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreted")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    p.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = p.parse_args(argv)
    unknown = [n for n in (args.only or ()) if n not in CHECK_NAMES]
    if unknown or args.only == []:
        what = f"unknown check(s) {', '.join(unknown)}" if unknown else "--only names no check"
        print(f"gpu-check: {what}; valid: {', '.join(CHECK_NAMES)}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dev = "cpu" if args.dry_run else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="epd-gpu-check-"))
    results: dict = {}
    shared: dict = {}
    checks = {"kernels": (check_kernels, dev), "parity": (check_parity, dev, work),
              "serve_p1d1": (check_serve, dev, work), "staged_2to1": (check_staged, dev),
              "decode_roofline": (check_decode, dev, work, shared), "cuda_graphs": (check_graphs, dev, shared),
              "layer_overlap": (check_overlap, dev)}
    assert tuple(checks) == CHECK_NAMES
    t0 = time.monotonic()
    for name, (fn, *fargs) in checks.items():
        if args.only is None or name in args.only:
            _record(results, name, fn, *fargs)
    doc = {"dry_run": args.dry_run, "host": platform.node(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "seconds": round(time.monotonic() - t0, 1), "checks": results}
    try:
        import triton

        doc["triton"] = triton.__version__
    except ImportError:
        doc["triton"] = None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"[gpu-check] wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not r["status"].startswith("failed") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
