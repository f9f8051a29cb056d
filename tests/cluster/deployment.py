"""`epd serve` on host ``api`` of a namespaced cluster, workers joining it from other hosts."""

from __future__ import annotations

import subprocess
import time

import httpx

from tests.cluster.netns import Cluster
from tests.conftest import metric_sum, stream_text

ROUTER_PORT = 5557
HTTP_PORT = 8000
WORKER_ARGS = ("--num-kv-blocks", "128", "--max-num-seqs", "32", "--threads", "1", "--block-size", "16",
               "--ucx-net-devices", "eth0", "--dtype", "float32")


class Deployment:
    """A cluster running `epd serve` on host ``api`` and workers on other hosts."""

    def __init__(self, cluster: Cluster, model: str, keys: str, pools: str) -> None:
        self.c, self.model, self.keys, self.pools = cluster, model, keys, pools
        self.api = cluster.add_host("api")
        self.url = f"http://{self.api}:{HTTP_PORT}"
        self.router = f"tcp://{self.api}:{ROUTER_PORT}"
        self.workers: dict[str, tuple[str, subprocess.Popen]] = {}
        self.serve_proc: subprocess.Popen | None = None
        self.serves = 0

    def start_serve(self) -> None:
        self.serves += 1
        self.serve_proc = self.c.epd("api", f"serve{self.serves}", "serve", "--model", self.model, "--host", self.api,
                                     "--port", str(HTTP_PORT), "--router-host", self.api, "--router-port",
                                     str(ROUTER_PORT), "--pools", self.pools, "--cluster-keys", self.keys,
                                     "--max-retries", "3")

    def start_worker(self, host: str, role: str, inst: str, *extra: str, env: dict[str, str] | None = None) -> None:
        if host not in self.c.hosts:
            self.c.add_host(host)
        http_port = 9100 + sum(1 for h, _ in self.workers.values() if h == host)
        proc = self.c.epd(host, inst, "worker", "--role", role, "--instance-id", inst, "--router", self.router,
                          "--advertise-host", self.c.addr(host), "--cluster-keys", self.keys, "--model", self.model,
                          "--http-port", str(http_port), *WORKER_ARGS, *extra, env=env)
        self.workers[inst] = (host, proc)

    def get(self, path: str, timeout_s: float = 30.0) -> httpx.Response:
        return self.c.run_in("api", httpx.get, self.url + path, timeout=timeout_s)

    def wait(self, pred, what: str, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if pred():
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.c.log(n)[-2000:]}" for n in [f"serve{self.serves}", *self.workers])
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.3)

    def wait_healthy(self) -> None:
        self.wait(lambda: self.get("/health").status_code == 200, "/health 200")

    def registered(self) -> set[str]:
        return set(self.get("/epd/workers").json())

    def stats(self) -> dict:
        return self.get("/epd/workers").json()

    def complete(self, prompt: list[int], max_tokens: int, on_chunk=None) -> str:
        """Greedy streamed completion's text, from inside the api host."""
        return self.c.run_in("api", stream_text, self.url, self.model, prompt, max_tokens, on_chunk)

    def submit(self, prompt: list[int], max_tokens: int, on_chunk=None):
        return self.c.submit_in("api", stream_text, self.url, self.model, prompt, max_tokens, on_chunk)

    def metric(self, name: str, **labels) -> float:
        return metric_sum(self.get("/metrics").text, name, **labels)
