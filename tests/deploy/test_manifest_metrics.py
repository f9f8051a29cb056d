"""deploy/: the metric names the autoscalers (HPAs through prometheus-adapter, KEDA) and the
Grafana dashboard use are epd's: all in METRIC_NAMES, declared by epd/metrics.py with the
right type, and served after real traffic, by `epd launch`'s /metrics (failures included)
and by the scrape targets of the Kubernetes topology (`epd serve` + one `epd worker
--http-port` per pool: each pool's autoscaling signal on its own workers' endpoint); and
the opt-in tts pod's own command line joins a real router, speaks and serves its series."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tests.deploy.manifests import (
    COUNTERS,
    DEPLOY,
    GAUGES,
    HISTOGRAMS,
    METRIC_NAMES,
    OVERLAYS,
    base_metric,
    by_kind,
    container_env,
    expand,
    metric_tokens,
    one,
    pod_template,
    render,
)

DASHBOARD = DEPLOY / "grafana" / "epd-dashboard.json"


def adapter_rules() -> list[dict]:
    cm = one(render("cpu"), "ConfigMap", "epd-prometheus-adapter-rules")
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def _strip_templates(q: str) -> str:
    return re.sub(r"<<[^>]*>>", "", q)


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if v["type"] == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def used_series() -> dict[str, set[str]]:
    """Where -> the epd series (families) it names."""
    used: dict[str, set[str]] = {}
    for r in adapter_rules():
        used.setdefault("prometheus-adapter rules", set()).update(
            metric_tokens(_strip_templates(r["seriesQuery"] + " " + r["metricsQuery"])))
    for overlay in OVERLAYS:
        for so in by_kind(render(overlay), "ScaledObject").values():
            for t in so["spec"]["triggers"]:
                used.setdefault("KEDA triggers", set()).update(metric_tokens(t["metadata"]["query"]))
    used["Grafana dashboard"] = set().union(*(metric_tokens(e) for e in dashboard_exprs()))
    return {k: {base_metric(n) for n in v} for k, v in used.items()}


def all_used() -> set[str]:
    return set().union(*used_series().values())


def test_every_metric_named_is_in_the_list():
    """Adapter rules, KEDA queries and dashboard name only series from METRIC_NAMES."""
    unknown = {where: sorted(n - set(METRIC_NAMES)) for where, n in used_series().items() if n - set(METRIC_NAMES)}
    assert not unknown, f"metric names not in tests/deploy/manifests.py METRIC_NAMES: {unknown}"
    assert {"prometheus-adapter rules", "KEDA triggers", "Grafana dashboard"} <= set(used_series())


def test_hpa_metrics_are_served_by_adapter_rules():
    """Every HPA metric is a name an adapter rule exposes (`name.as`), as a per-pod metric:
    the rule maps Prometheus' namespace and pod labels to those resources, selects only
    series that have them, and filters and groups by what the HPA asks
    (<<.LabelMatchers>>, <<.GroupBy>>); its `name.matches` matches its series."""
    rules = adapter_rules()
    exposed = {}
    for r in rules:
        series = re.match(r"^\s*([a-z_:][a-z0-9_:]*)", r["seriesQuery"]).group(1)
        assert re.search(r["name"]["matches"], series), r
        assert 'namespace!=""' in r["seriesQuery"] and 'pod!=""' in r["seriesQuery"], r["seriesQuery"]
        assert r["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.LabelMatchers>>" in r["metricsQuery"] and "<<.GroupBy>>" in r["metricsQuery"], r
        exposed[r["name"].get("as", series)] = r
    for overlay in ("cpu", "gpu"):
        for name, hpa in by_kind(render(overlay), "HorizontalPodAutoscaler").items():
            for m in hpa["spec"]["metrics"]:
                assert m["pods"]["metric"]["name"] in exposed, f"{overlay} HPA {name}: no adapter rule for {m}"


def _declared_metrics() -> dict[str, str]:
    """Family name -> type, as epd/metrics.py declares them (a fresh single-process registry)."""
    code = "import epd.metrics as m; m.get_metrics(); print(m.render_latest()[0].decode())"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         check=True).stdout
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", out, re.M))


def test_the_list_is_declared_by_epd_metrics():
    """METRIC_NAMES are families epd/metrics.py declares, of the type the list says."""
    declared = _declared_metrics()
    want = {**{h: "histogram" for h in HISTOGRAMS}, **{g: "gauge" for g in GAUGES},
            **{c: "counter" for c in COUNTERS}}
    wrong = {n: declared.get(n, "missing") for n, t in want.items() if declared.get(n) != t}
    assert not wrong, f"not declared (or of another type) in epd/metrics.py: {wrong}"


def test_dashboard_is_well_formed_and_covers_the_pools():
    """The dashboard JSON: unique panel ids, panels inside the 24-column grid without
    overlapping, every panel on the ${datasource} variable and filtered by $namespace, and
    panels for queue, execution and transfer times, TTFT/ITL, KV usage and instances. The
    rendered ConfigMap holds exactly this file."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace"} <= names
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            for sel in re.findall(r"\bepd_[a-z0-9_]+\{([^}]*)\}", t["expr"]):
                assert 'namespace=~"$namespace"' in sel, (p["title"], t["expr"])
            assert re.search(r"\bepd_[a-z0-9_]+\{", t["expr"]), t["expr"]
    used = used_series()["Grafana dashboard"]
    must = {"epd_encode_queue_seconds", "epd_prefill_queue_seconds", "epd_decode_queue_seconds",
            "epd_encode_seconds", "epd_prefill_seconds", "epd_decode_step_seconds", "epd_kv_transfer_seconds",
            "epd_embedding_transfer_seconds", "epd_time_to_first_token_seconds", "epd_inter_token_latency_seconds",
            "epd_kv_cache_usage_ratio", "epd_pool_instances", "epd_queue_depth"}
    assert must <= used, sorted(must - used)
    for overlay in OVERLAYS:
        cm = one(render(overlay), "ConfigMap", "epd-grafana-dashboard")
        assert json.loads(cm["data"]["epd-dashboard.json"]) == dash
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


# --------------------------------------------------------------------------------------
# A real server: every name the manifests and the dashboard use shows up in /metrics.

#: series that must exist for a pool, for its autoscaler to have a signal at all
POOL_SIGNALS = {
    ("epd_queue_depth", "encode"), ("epd_queued_prompt_tokens", "prefill"),
    ("epd_prefill_queue_seconds_count", "prefill"),
    ("epd_kv_cache_usage_ratio", "decode"), ("epd_running_requests", "decode"),
}
LONG = 320  # tokens per stream: long enough to kill a decode worker mid-stream


def _families(text: str) -> dict[str, list[str]]:
    """Family (histograms' base, counters with _total) -> its sample lines."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ", line)
        if m:
            out.setdefault(base_metric(m.group(1)), []).append(line)
    return out


def _missing(text: str, names: set[str]) -> list[str]:
    fam = _families(text)
    missing = sorted(n for n in names if n not in fam)
    for name, pool in sorted(POOL_SIGNALS):
        if not any(line.startswith(name) and f'pool="{pool}"' in line for line in fam.get(base_metric(name), [])):
            missing.append(f'{name}{{pool="{pool}"}}')
    return missing


@pytest.mark.slow
def test_a_real_server_serves_every_metric_name(tmp_path_factory):
    """`epd launch` (tiny LLaVA, e:1,p:1,d:2): an image request whose first KV transfer fails
    (injected: a retry), then streams whose decode worker is SIGKILLed mid-stream
    (migrations, a worker failure). Then /metrics has every series the adapter rules, KEDA
    triggers and the dashboard name, and each pool's autoscaling signal for that pool."""
    import httpx

    from epd.models.tiny import create_tiny_model
    from tests.serving.conftest import launch
    from tests.serving.media import data_url, png

    model = str(create_tiny_model("llava", tmp_path_factory.mktemp("deploy") / "llava"))
    names = all_used()
    with launch(model, "e:1,p:1,d:2", "--block-size", "8", "--max-num-seqs", "8",
                env={"EPD_INJECT_KV_FAILURES": "1"}) as server:
        client = server.client()
        r = client.chat.completions.create(model=server.model, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(1))}},
                                         {"type": "text", "text": "What is this?"}]}])
        assert r.choices[0].message.content is not None

        streamed = [0] * 4
        started = threading.Event()

        def stream(i: int) -> str:
            parts = []
            for chunk in client.completions.create(model=server.model, prompt=[100 + 7 * i + k for k in range(12)],
                                                   max_tokens=LONG, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    parts.append(chunk.choices[0].text)
                    streamed[i] = len(parts)
                    if min(streamed) >= 5:
                        started.set()
            return "".join(parts)

        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(stream, i) for i in range(4)]
            assert started.wait(180), f"streams did not start: {streamed}"
            stats = server.workers()
            victim = max(("decode-0", "decode-1"), key=lambda d: stats[d].get("num_running", 0))
            server.worker_process(victim).send_signal(signal.SIGKILL)
            assert all(f.result(timeout=300) for f in futs)

        deadline, missing = time.monotonic() + 90, ["(not read)"]
        while time.monotonic() < deadline:  # gauges come with the workers' heartbeats
            missing = _missing(httpx.get(server.url + "/metrics", timeout=30).text, names)
            if not missing:
                break
            time.sleep(1)
    assert not missing, f"not in a real server's /metrics after real traffic: {missing}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_each_scrape_target_serves_its_pools_signals(tmp_path_factory):
    """The topology the PodMonitors scrape: `epd serve` plus one `epd worker --http-port`
    per pool (on loopback, no keys needed there). After one image request, each pool's
    autoscaling signal is on that pool's worker endpoint (what its PodMonitor scrapes and
    prometheus-adapter maps to the worker's pod), and everything the manifests name is
    on one of the endpoints (API or workers)."""
    import httpx

    from epd.models.tiny import create_tiny_model
    from tests.serving.media import data_url, png

    model = str(create_tiny_model("llava", tmp_path_factory.mktemp("deploy") / "llava"))
    logs = tmp_path_factory.mktemp("deploy-logs")
    http, router = _free_port(), _free_port()
    ports = {role: _free_port() for role in ("encode", "prefill", "decode")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "PROMETHEUS_MULTIPROC_DIR"))}
    env["PYTHONUNBUFFERED"] = "1"
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, *args: str) -> None:
        out = open(logs / f"{name}.log", "w")
        procs[name] = subprocess.Popen([sys.executable, "-m", "epd.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)

    def logs_tail() -> str:
        return "\n".join(f"--- {n}\n{(logs / f'{n}.log').read_text(errors='replace')[-1500:]}" for n in procs)

    try:
        spawn("serve", "serve", "--model", model, "--port", str(http), "--router-port", str(router),
              "--pools", "e:1,p:1,d:1")
        for role, port in ports.items():
            spawn(role, "worker", "--role", role, "--instance-id", f"{role}-0", "--router",
                  f"tcp://127.0.0.1:{router}", "--model", model, "--http-port", str(port), "--threads", "1",
                  "--block-size", "8", "--num-kv-blocks", "64", "--drain-timeout", "5")
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 400
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            dead = [n for n, p in procs.items() if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"not healthy (exited: {dead})\n{logs_tail()}"
            time.sleep(0.5)
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": [
                                               {"type": "image_url", "image_url": {"url": data_url(png(2))}},
                                               {"type": "text", "text": "What is this?"}]}])
        assert r.choices[0].message.content is not None

        names = all_used() - {"epd_migrated_requests_total", "epd_worker_failures_total",
                              "epd_request_retries_total"}  # failures: test_a_real_server_serves_every_metric_name
        deadline, problems = time.monotonic() + 90, ["(not read)"]
        while time.monotonic() < deadline:  # gauges come with the workers' heartbeats
            texts = {"api": httpx.get(url + "/metrics", timeout=30).text}
            texts |= {role: httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
                      for role, port in ports.items()}
            everywhere = set().union(*(_families(t) for t in texts.values()))
            problems = sorted(names - everywhere)
            for name, pool in sorted(POOL_SIGNALS):
                lines = _families(texts[pool]).get(base_metric(name), [])
                if not any(line.startswith(name) and f'pool="{pool}"' in line for line in lines):
                    problems.append(f'{name}{{pool="{pool}"}} on the {pool} worker\'s /metrics')
            if not problems:
                break
            time.sleep(1)
        assert not problems, f"missing from the scrape targets: {problems}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
def test_the_tts_pods_command_line_joins_a_router_speaks_and_drains(tmp_path):
    """components/tts's container as rendered (cpu+tts), its arguments and environment as
    the kubelet would give them; only `epd` is this Python's `-m epd.cli`, the pod IP is
    loopback, the keys directory is one `epd keys generate` wrote, the router is a real one
    in this process and --http-port a free port. It joins the router over CURVE without
    any model, is ready (/health 200), speaks a phrase through the router (PCM16, 24 kHz),
    serves what its PodMonitor scrapes (pool="tts" series on /metrics) and, on SIGTERM,
    drains and exits 0."""
    import asyncio

    import httpx

    from epd.cluster_auth import ROUTER, generate_keys, load_keys
    from epd.router.pipeline import TTS_SAMPLE_RATE
    from epd.router.router import Router

    (c,) = pod_template(one(render("cpu+tts"), "Deployment", "epd-tts"))["spec"]["containers"]
    assert c["command"] == ["epd"]
    generate_keys(tmp_path / "keys")
    http = _free_port()
    log = tmp_path / "tts.log"

    async def main() -> tuple[int, bytes, str, int]:
        router = Router(host="127.0.0.1", port=_free_port(), keys=load_keys(tmp_path / "keys", ROUTER))
        await router.start()
        pod_env = container_env(c, {"status.podIP": "127.0.0.1", "metadata.name": "epd-tts-5d8f7-x2x9q"})
        assert pod_env["EPD_ROUTER"] == "tcp://epd-router:5557"
        pod_env |= {"EPD_ROUTER": router.endpoint, "EPD_CLUSTER_KEYS": str(tmp_path / "keys")}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "PROMETHEUS_MULTIPROC_DIR"))}
        env |= pod_env | {"PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "epd.cli", *(expand(a, pod_env) for a in c["args"]), f"--http-port={http}"]
        proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while router.pools_alive().get("tts", 0) < 1:
                assert proc.poll() is None and time.monotonic() < deadline, f"did not join:\n{log.read_text()}"
                await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http}", timeout=30) as client:
                while (health := await client.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline, health.text
                    await asyncio.sleep(0.2)
                pcm = b"".join([b async for b in router.synthesize("deploy-tts-1", "Hello from the tts pod.",
                                                                   "alloy")])
                metrics = ""
                while 'epd_tts_phrases_total{instance="epd-tts-5d8f7-x2x9q",pool="tts"}' not in metrics:
                    assert time.monotonic() < deadline, metrics
                    await asyncio.sleep(0.5)
                    metrics = (await client.get("/metrics")).text
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 60)
            return code, pcm, metrics, TTS_SAMPLE_RATE
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            await router.stop(shutdown_workers=False)

    code, pcm, metrics, rate = asyncio.run(main())
    assert code == 0, log.read_text()
    assert len(pcm) % 2 == 0 and len(pcm) / 2 / rate > 0.5, f"{len(pcm)} bytes of speech"
    fam = _families(metrics)
    for name in ("epd_queue_depth", "epd_running_requests"):
        assert any('pool="tts"' in line for line in fam.get(name, [])), f"{name} not on the tts pod's /metrics"
    assert "drained" in log.read_text()
