"""Pools across hosts (network namespaces, UCX over tcp) against one host (UCX picks cma).

Measures, with `epd serve` + `epd worker` processes (p:1,d:2, CURVE keys):

- TTFT and TPOT of streamed greedy requests with ``--prompt-tokens``-token prompts, one
  at a time (so the KV transfer is on the critical path): every process in one network
  namespace (one host; UCX shared memory / cma) vs API, prefill and each decode worker
  in their own namespace (across hosts; ``UCX_TLS=tcp`` over veth pairs on a bridge);
- migration across hosts: a decode host SIGKILLed while ``--streams`` requests stream
  from it: the longest gap between two tokens of a migrated stream (client side);
- drain across hosts: a decode worker SIGTERMed while streams run on it: seconds until
  it exits 0 (streams migrate to the other decode host), and the longest token gap.

Run as root (``ip netns``):

    python benchmarks/multi_host.py                 # SmolLM2-135M, 512-token prompts
    python benchmarks/multi_host.py --quick         # tiny random llama, smoke run

Prints a table; writes ``benchmarks/results/multi_host.json``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import git_commit

from tests.cluster.netns import Cluster, netns_available

RESULTS = Path(__file__).parent / "results"
PORT, ROUTER_PORT = 8000, 5557


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy streamed completion: TTFT, token arrival times (monotonic s)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.monotonic()
    times, n = [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic())
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0] - t0 if times else None, "tpot_s": statistics.mean(gaps) if gaps else None,
            "max_gap_s": max(gaps) if gaps else None, "n": n}


class Setup:
    """`epd serve` on host ``api``, a prefill worker and two decode workers; ``one_host``
    puts all of them in host ``api`` (UCX default transports)."""

    def __init__(self, cluster: Cluster, model: str | None, keys: str, one_host: bool, worker_args: list[str]):
        self.c = cluster
        hosts = ["api"] if one_host else ["api", "pre", "dec-a", "dec-b"]
        for h in hosts:
            cluster.add_host(h)
        self.api = cluster.addr("api")
        self.url = f"http://{self.api}:{PORT}"
        env = {} if not one_host else {"UCX_TLS": None}  # one host: UCX picks its shared-memory transports
        model_args = ["--model", model] if model else []
        cluster.epd("api", "serve", "serve", *model_args, "--host", self.api, "--port", str(PORT), "--router-host",
                    self.api, "--router-port", str(ROUTER_PORT), "--pools", "p:1,d:2", "--cluster-keys", keys, env=env)
        self.procs = {}
        for i, (role, inst) in enumerate((("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1"))):
            host = "api" if one_host else hosts[min(i + 1, 3)]
            ucx = [] if one_host else ["--ucx-net-devices", "eth0"]
            self.procs[inst] = cluster.epd(
                host, inst, "worker", "--role", role, "--instance-id", inst, "--router",
                f"tcp://{self.api}:{ROUTER_PORT}", "--advertise-host", cluster.addr(host), "--cluster-keys", keys,
                *model_args, "--threads", "1", "--drain-timeout", "60", *ucx, *worker_args, env=env)
        deadline = time.monotonic() + 600
        while True:
            try:
                if self.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("not healthy: " + cluster.log("serve")[-2000:])
            time.sleep(0.5)
        self.model = self.get("/v1/models").json()["data"][0]["id"]

    def get(self, path: str) -> httpx.Response:
        return self.c.run_in("api", httpx.get, self.url + path, timeout=30)

    def stream(self, prompt: list[int], max_tokens: int) -> dict:
        return self.c.run_in("api", stream, self.url, self.model, prompt, max_tokens)


def latency(setup: Setup, prompt_tokens: int, out_tokens: int, reps: int, vocab: int) -> dict:
    prompts = [[100 + (97 * r + k) % (vocab - 100) for k in range(prompt_tokens)] for r in range(reps + 1)]
    setup.stream(prompts[-1], 4)  # warm-up
    runs = [setup.stream(p, out_tokens) for p in prompts[:reps]]
    return {"ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "tpot_s": statistics.median(r["tpot_s"] for r in runs), "runs": runs}


def disrupt(setup: Setup, action: str, streams: int, out_tokens: int, vocab: int) -> dict:
    """``streams`` concurrent streams; once all have tokens, SIGKILL decode host dec-b
    (``kill``) or SIGTERM decode-1 (``drain``). Returns gaps and the drain time."""
    prompts = [[100 + (13 * i + k) % (vocab - 100) for k in range(32)] for i in range(streams)]
    results: list = [None] * streams
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, setup.stream(prompts[i], out_tokens)))
               for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    t0 = time.monotonic()
    proc = setup.procs["decode-1"]
    if action == "kill":
        setup.c.kill_host("dec-b")
        drain_s = None
    else:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        drain_s = time.monotonic() - t0
        assert rc == 0, setup.c.log("decode-1")[-2000:]
    for t in threads:
        t.join(600)
    complete = sum(1 for r in results if r and r["n"] == out_tokens)
    return {"action": action, "streams": streams, "complete": complete, "drain_s": drain_s,
            "max_gap_s": max(r["max_gap_s"] for r in results if r and r["max_gap_s"] is not None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny random llama, few repetitions")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--out-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args()
    why = netns_available()
    if why:
        print(f"needs network namespaces: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="epd-mh-"))
    from epd.cluster_auth import generate_keys

    generate_keys(tmp / "keys")
    model, worker_args = None, ["--kv-cache-memory-gb", "0.3"]
    if args.quick:
        from epd.models.tiny import create_tiny_model

        model = str(create_tiny_model("llama", tmp / "llama"))
        worker_args = ["--num-kv-blocks", "256"]
        args.prompt_tokens, args.reps = min(args.prompt_tokens, 256), min(args.reps, 3)
    from transformers import AutoConfig

    from epd.models.checkpoints import resolve_model

    vocab = AutoConfig.from_pretrained(str(resolve_model(model))).get_text_config().vocab_size
    rows, out = [], {"args": vars(args), "model": model or "SmolLM2-135M-Instruct"}
    for layout in ("one host", "across hosts"):
        cluster = Cluster(tmp / layout.replace(" ", "-"))
        try:
            setup = Setup(cluster, model, str(tmp / "keys"), layout == "one host", worker_args)
            lat = latency(setup, args.prompt_tokens, args.out_tokens, args.reps, vocab)
            out[layout] = {"latency": lat}
            row = {"layout": layout, "ttft_ms": lat["ttft_s"] * 1e3, "tpot_ms": lat["tpot_s"] * 1e3}
            if layout == "across hosts":
                out[layout]["drain"] = disrupt(setup, "drain", args.streams, 96 if args.quick else 64, vocab)
                row["drain_s"] = out[layout]["drain"]["drain_s"]
                row["drain_max_gap_ms"] = out[layout]["drain"]["max_gap_s"] * 1e3
                # decode-1 is gone; start it again on dec-b for the kill run
                setup.procs["decode-1"] = cluster.epd(
                    "dec-b", "decode-1b", "worker", "--role", "decode", "--instance-id", "decode-1", "--router",
                    f"tcp://{setup.api}:{ROUTER_PORT}", "--advertise-host", cluster.addr("dec-b"), "--cluster-keys",
                    str(tmp / "keys"), *(["--model", model] if model else []), "--threads", "1",
                    "--ucx-net-devices", "eth0", *worker_args)
                deadline = time.monotonic() + 300
                while "decode-1" not in setup.get("/epd/workers").json():
                    assert time.monotonic() < deadline, "decode-1 did not re-join"
                    time.sleep(0.5)
                out[layout]["migration"] = disrupt(setup, "kill", args.streams, 96 if args.quick else 64, vocab)
                row["migration_max_gap_ms"] = out[layout]["migration"]["max_gap_s"] * 1e3
                row["complete"] = f"{out[layout]['drain']['complete']}+{out[layout]['migration']['complete']}" \
                                  f"/{2 * args.streams}"
            rows.append(row)
        finally:
            cluster.close()
    cols = ["layout", "ttft_ms", "tpot_ms", "drain_s", "drain_max_gap_ms", "migration_max_gap_ms", "complete"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))
    out["rows"] = rows
    out["commit"] = git_commit()
    RESULTS.mkdir(exist_ok=True)
    name = "multi_host_quick.json" if args.quick else "multi_host.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
