"""deploy/: the rendered objects fit together: selectors select the pods they mean, ports
and probes name real container ports, workers reach the router, the drain fits in the
grace period, and each pool is labelled, disrupted and autoscaled as its role needs."""

from __future__ import annotations

import copy
import re

import pytest

from tests.deploy.manifests import (
    LWS_GROUP_INDEX_FIELD,
    POOLS,
    RENDERED,
    VARIANTS,
    by_kind,
    container_env,
    containers,
    flag_value,
    metric_tokens,
    one,
    parse_pools,
    pod_labels,
    pod_template,
    pod_templates,
    pool_of,
    pools_of,
    render,
    selects,
    workloads,
)


def _pods(docs):
    """(workload, labels of its pods, its first container) per workload."""
    return [(w, pod_labels(w), pod_template(w)["spec"]["containers"][0]) for w in workloads(docs)]


def _args(c: dict) -> list[str]:
    return list(c.get("command", [])[1:]) + list(c.get("args", []))


def _api_args(docs) -> list[str]:
    return _args(one(docs, "Deployment", "epd-api")["spec"]["template"]["spec"]["containers"][0])


def _selected(docs, selector: dict):
    return [w for w, labels, _c in _pods(docs) if selects(selector, labels)]


@pytest.mark.parametrize("overlay", RENDERED)
def test_workload_selectors_match_their_own_pods_only(overlay):
    docs = render(overlay)
    for w in workloads(docs):
        if w["kind"] == "Deployment":
            sel = w["spec"]["selector"]
            assert selects(sel, w["spec"]["template"]["metadata"]["labels"]), w["metadata"]["name"]
            assert _selected(docs, sel) == [w], f"{w['metadata']['name']}'s selector also selects other pods"


@pytest.mark.parametrize("overlay", RENDERED)
def test_each_pool_is_labelled_with_its_role(overlay):
    """The pool workloads and their pods carry app.kubernetes.io/component and epd.io/pool
    equal to the --role their worker runs."""
    docs = render(overlay)
    roles = {}
    for w, labels, c in _pods(docs):
        args = _args(c)
        if args[0] != "worker":
            assert args[0] == "serve" and labels["app.kubernetes.io/component"] == "api"
            continue
        role = flag_value(args, "--role")
        assert labels["epd.io/pool"] == labels["app.kubernetes.io/component"] == role == pool_of(w), w["metadata"]
        roles[role] = w["metadata"]["name"]
    assert set(roles) == set(pools_of(overlay))


@pytest.mark.parametrize("overlay", RENDERED)
def test_services_pdbs_and_podmonitors_select_one_pool_each(overlay):
    """Every Service, PodDisruptionBudget and PodMonitor selects the pods of exactly one
    workload (its pool's, or the API's), and its ports name ports those pods have."""
    docs = render(overlay)
    for kind in ("Service", "PodDisruptionBudget", "PodMonitor"):
        for name, obj in by_kind(docs, kind).items():
            sel = obj["spec"]["selector"]
            sel = sel if kind != "Service" else {"matchLabels": sel}
            picked = _selected(docs, sel)
            assert len(picked) == 1, f"{kind} {name} selects {[w['metadata']['name'] for w in picked]}"
            w = picked[0]
            expected = "epd-api" if name == "epd-router" else name
            assert w["metadata"]["name"] == expected, f"{kind} {name} selects {w['metadata']['name']}"
            ports = {p["name"] for c in pod_template(w)["spec"]["containers"] for p in c.get("ports", [])}
            if kind == "Service":
                assert {p["targetPort"] for p in obj["spec"]["ports"]} <= ports, name
            if kind == "PodMonitor":
                eps = obj["spec"]["podMetricsEndpoints"]
                assert {e["port"] for e in eps} <= ports and all(e["path"] == "/metrics" for e in eps), name
                assert all(e.get("honorLabels") is True for e in eps), f"{name}: epd's instance label is lost"


@pytest.mark.parametrize("overlay", RENDERED)
def test_probes_mean_ready_and_alive(overlay):
    """Workers: ready = GET /health on their --http-port (the router has them), alive =
    GET /live, startup gated on /live; the API: ready = GET /health on --port (the
    minimum pools are live), alive = GET /metrics (its loop answers: never /health, whose
    503 means "workers missing" and which a restart would not fix)."""
    docs = render(overlay)
    for w, _t, c in containers(docs):
        args = _args(c)
        named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        port_of = lambda probe: named.get(probe["httpGet"]["port"], probe["httpGet"]["port"])  # noqa: E731
        probes = {k: c.get(k) for k in ("readinessProbe", "livenessProbe", "startupProbe")}
        assert all(probes.values()), f"{w['metadata']['name']}: missing probes {probes}"
        if args[0] == "worker":
            port = int(flag_value(args, "--http-port"))
            assert port == 9100
            assert [probes[k]["httpGet"]["path"] for k in ("readinessProbe", "livenessProbe", "startupProbe")] == \
                ["/health", "/live", "/live"], w["metadata"]["name"]
        else:
            port = int(flag_value(args, "--port"))
            assert probes["readinessProbe"]["httpGet"]["path"] == "/health"
            assert probes["livenessProbe"]["httpGet"]["path"] == "/metrics"
        assert {port_of(p) for p in probes.values()} == {port}, w["metadata"]["name"]
        live = probes["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 60, "liveness must tolerate a minute of silence"
        start = probes["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 300, "model loading may take minutes"


@pytest.mark.parametrize("overlay", RENDERED)
def test_grace_period_lets_the_drain_finish(overlay):
    """terminationGracePeriodSeconds > --drain-timeout (+ any preStop sleep) for every
    worker, so SIGTERM's drain ends before the SIGKILL."""
    for w, t, c in containers(render(overlay)):
        args = _args(c)
        grace = t["spec"]["terminationGracePeriodSeconds"]
        pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = int(pre[1]) if pre[:1] == ["sleep"] else 0
        if args[0] == "worker":
            drain = flag_value(args, "--drain-timeout")
            assert drain is not None, f"{w['metadata']['name']}: no --drain-timeout"
            assert grace >= float(drain) + sleep + 10, f"{w['metadata']['name']}: grace {grace} vs drain {drain}"
        else:
            assert grace > sleep


@pytest.mark.parametrize("overlay", RENDERED)
def test_workers_reach_the_router_before_it_is_ready(overlay):
    """Every worker's EPD_ROUTER is the epd-router Service at the API's --router-port; that
    Service publishes not-ready addresses (the router is ready only after workers joined),
    and the API binds its router (and HTTP) beyond loopback."""
    docs = render(overlay)
    api = _api_args(docs)
    assert flag_value(api, "--router-host") == "0.0.0.0" and flag_value(api, "--host") == "0.0.0.0"
    router_port = int(flag_value(api, "--router-port"))
    svc = one(docs, "Service", "epd-router")
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert [p["port"] for p in svc["spec"]["ports"]] == [router_port]
    api_ports = {p["name"]: p["containerPort"] for p in
                 one(docs, "Deployment", "epd-api")["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert api_ports[svc["spec"]["ports"][0]["targetPort"]] == router_port
    assert one(docs, "Deployment", "epd-api")["spec"]["replicas"] == 1  # one router
    assert one(docs, "Deployment", "epd-api")["spec"]["strategy"]["type"] == "Recreate"
    for w, _t, c in containers(docs):
        if _args(c)[0] == "worker":
            env = container_env(c)
            assert env["EPD_ROUTER"] == f"tcp://epd-router:{router_port}", w["metadata"]["name"]
            assert env["EPD_ADVERTISE_HOST"] == "10.0.0.7", "advertise the pod IP (status.podIP)"
            assert env.get("EPD_INSTANCE_ID"), w["metadata"]["name"]


@pytest.mark.parametrize("overlay", RENDERED)
def test_pool_minimums_fit_replicas_and_autoscaling(overlay):
    """The API's --pools minimum per pool is <= each pool's replicas and its autoscaler's
    minimum (else /health, hence the API's readiness, could never pass). The opt-in tts
    pool is not in it (components/tts leaves the API alone: speech out is offered once a
    tts worker joined), so /health never waits for it."""
    docs = render(overlay)
    minimum = parse_pools(flag_value(_api_args(docs), "--pools"))
    assert set(minimum) == set(POOLS)
    for w in workloads(docs):
        pool = pool_of(w)
        if pool:
            assert w["spec"]["replicas"] >= max(minimum.get(pool, 0), 1), w["metadata"]["name"]
    for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["minReplicas"] >= minimum[hpa["metadata"]["labels"]["epd.io/pool"]]
    for so in by_kind(docs, "ScaledObject").values():
        assert so["spec"]["minReplicaCount"] >= minimum[so["metadata"]["labels"]["epd.io/pool"]]


#: the autoscaling signal of each pool, as the issue asks for
SIGNALS = {
    "encode": {"epd_queue_depth"},
    "prefill": {"epd_queued_prompt_tokens", "epd_prefill_queue_seconds_mean"},
    "decode": {"epd_kv_cache_usage_ratio", "epd_running_requests"},
}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_hpas_scale_their_pool_on_its_own_signal(overlay):
    """One HPA per pool, targeting that pool's workload (a LeaderWorkerSet for gpu prefill),
    on per-pod metrics: its signals only; decode's batch target below --max-num-seqs."""
    docs = render(overlay)
    targets = {(w["apiVersion"], w["kind"], w["metadata"]["name"]): w for w in workloads(docs)}
    for name, hpa in by_kind(docs, "HorizontalPodAutoscaler").items():
        pool = hpa["metadata"]["labels"]["epd.io/pool"]
        ref = hpa["spec"]["scaleTargetRef"]
        target = targets.get((ref["apiVersion"], ref["kind"], ref["name"]))
        assert target is not None and pool_of(target) == pool, f"HPA {name} targets {ref}"
        metrics = hpa["spec"]["metrics"]
        assert {m["type"] for m in metrics} == {"Pods"}
        assert {m["pods"]["metric"]["name"] for m in metrics} == SIGNALS[pool], name
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
        if pool == "decode":
            running = next(m for m in metrics if m["pods"]["metric"]["name"] == "epd_running_requests")
            max_seqs = int(flag_value(_args(pod_template(target)["spec"]["containers"][0]), "--max-num-seqs"))
            assert 0 < float(running["pods"]["target"]["averageValue"]) < max_seqs
    if overlay == "gpu":
        ref = by_kind(docs, "HorizontalPodAutoscaler")["epd-prefill"]["spec"]["scaleTargetRef"]
        assert ref["kind"] == "LeaderWorkerSet"


def test_keda_triggers_query_their_pool_in_the_rendered_namespace():
    """KEDA: one ScaledObject per pool on its Deployment, Prometheus triggers on that pool's
    signals, filtered to the namespace the overlay renders into and to the pool."""
    docs = render("keda")
    namespace = one(docs, "Deployment", "epd-api")["metadata"]["namespace"]
    deployments = by_kind(docs, "Deployment")
    for name, so in by_kind(docs, "ScaledObject").items():
        pool = so["metadata"]["labels"]["epd.io/pool"]
        ref = so["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and pool_of(deployments[ref["name"]]) == pool
        used = set()
        for t in so["spec"]["triggers"]:
            assert t["type"] == "prometheus"
            md = t["metadata"]
            assert md["serverAddress"].startswith("http") and float(md["threshold"]) > 0
            selectors = re.findall(r"\{([^}]*)\}", md["query"])
            assert selectors, md["query"]
            for s in selectors:
                assert f'namespace="{namespace}"' in s and f'pool="{pool}"' in s, md["query"]
            names = metric_tokens(md["query"])
            used |= {"epd_prefill_queue_seconds_mean"} if "epd_prefill_queue_seconds_sum" in names else names
        assert used == SIGNALS[pool], name


def _gpus(c: dict) -> tuple[int | None, int | None]:
    """A container's nvidia.com/gpu (request, limit); an extended resource's request
    defaults to its limit."""
    res = c.get("resources", {})
    limit = res.get("limits", {}).get("nvidia.com/gpu")
    request = res.get("requests", {}).get("nvidia.com/gpu", limit)
    return (None if request is None else int(request)), (None if limit is None else int(limit))


def gpu_prefill_problems(docs) -> list[str]:
    """What is wrong with the gpu overlay's prefill LeaderWorkerSet for what epd's engine
    supports today (empty: nothing). A TP instance's ranks are processes of one pod (rank 0
    starts them; `epd worker --rank N>=1` is refused), so: each group is one pod (size 1),
    that pod runs `--tp=N` (N > 1, what the pool is for) and requests N GPUs, passes no
    --rank, and its instance id differs between groups (and is not the pod's rank)."""
    lws = one(docs, "LeaderWorkerSet", "epd-prefill")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    problems = []
    if lwt.get("size", 1) != 1:
        problems.append(f"size {lwt.get('size')}: TP ranks on other pods need multi-node TP, which epd lacks")
    for t in pod_templates(lws):
        (c,) = t["spec"]["containers"]
        args = _args(c)
        tp = int(flag_value(args, "--tp") or 1)
        if tp < 2:
            problems.append(f"--tp={tp}: the LWS prefill instance is tensor-parallel (TP > 1)")
        request, limit = _gpus(c)
        if request != tp or limit != tp:
            problems.append(f"nvidia.com/gpu request {request} / limit {limit}, not --tp={tp} (all ranks in the pod)")
        if any(a == "--rank" or a.startswith("--rank=") for a in args):
            problems.append("passes --rank: rank 0 starts the other ranks itself")
        ids = [container_env(c, {LWS_GROUP_INDEX_FIELD: str(g)}).get("EPD_INSTANCE_ID") for g in range(3)]
        if ids[0] != "epd-prefill-0" or len(set(ids)) != len(ids):
            problems.append(f"EPD_INSTANCE_ID of groups 0, 1, 2: {ids}, not <lws name>-<group index>")
    return problems


def test_gpu_overlay_requests_gpus_and_configures_ucx():
    """gpu: every worker asks for an nvidia.com/gpu and sets UCX_TLS / UCX_NET_DEVICES; the
    prefill LeaderWorkerSet is one pod per group running the whole TP instance (size 1,
    --tp=N with N GPUs, no --rank, an instance id per group); TP differs from decode's, so
    both sides stage KV (--kv-staging-mb > 0)."""
    docs = render("gpu")
    for w, _t, c in containers(docs):
        args = _args(c)
        if args[0] != "worker":
            assert flag_value(args, "--model"), "the API must tokenize with the served model"
            continue
        assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1, w["metadata"]["name"]
        env = container_env(c)
        assert env["UCX_TLS"] and env["UCX_NET_DEVICES"], w["metadata"]["name"]
        assert flag_value(args, "--model"), w["metadata"]["name"]
    assert not gpu_prefill_problems(docs), "\n".join(gpu_prefill_problems(docs))
    lws = one(docs, "LeaderWorkerSet", "epd-prefill")
    (c,) = pod_templates(lws)[0]["spec"]["containers"]
    args = _args(c)
    tp = int(flag_value(args, "--tp"))
    decode = one(docs, "Deployment", "epd-decode")["spec"]["template"]["spec"]["containers"][0]
    assert int(flag_value(_args(decode), "--tp") or 1) != tp
    assert int(flag_value(_args(decode), "--kv-staging-mb")) > 0 and int(flag_value(args, "--kv-staging-mb")) > 0
    pm = one(docs, "PodMonitor", "epd-prefill")
    assert pm["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_the_gpu_prefill_check_catches_mistakes():
    """gpu_prefill_problems fails on the one-rank-per-pod layout epd cannot run (size = --tp,
    one GPU per pod, --rank from the worker index), on a GPU request that is not --tp, and
    on an instance id shared by every group."""
    docs = render("gpu")
    assert gpu_prefill_problems(docs) == []

    def mutated(change):
        d = copy.deepcopy(docs)
        lws = one(d, "LeaderWorkerSet", "epd-prefill")
        change(lws["spec"]["leaderWorkerTemplate"], lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
               ["spec"]["containers"][0])
        return d

    def per_pod_ranks(lwt, c):
        lwt["size"] = 2
        c["args"].append("--rank=$(TP_RANK)")
        for kind in ("requests", "limits"):
            c["resources"][kind]["nvidia.com/gpu"] = 1

    def one_gpu(lwt, c):
        c["resources"]["requests"]["nvidia.com/gpu"] = 1
        c["resources"]["limits"]["nvidia.com/gpu"] = 1

    def shared_id(lwt, c):
        (e,) = [e for e in c["env"] if e["name"] == "EPD_INSTANCE_ID"]
        e["value"] = "$(LWS_SET_NAME)"

    bad = {
        "size > 1": lambda lwt, c: lwt.update(size=2),
        "one rank per pod": per_pod_ranks,
        "--rank=0": lambda lwt, c: c["args"].append("--rank=0"),
        "1 GPU for --tp=2": one_gpu,
        "--tp=4 on 2 GPUs": lambda lwt, c: c["args"].append("--tp=4"),
        "TP 1": lambda lwt, c: (c["args"].append("--tp=1"), one_gpu(lwt, c)),
        "one instance id for every group": shared_id,
    }
    for what, change in bad.items():
        assert gpu_prefill_problems(mutated(change)), f"{what} went unnoticed"


@pytest.mark.parametrize("overlay", RENDERED)
def test_workers_have_shared_memory(overlay):
    """NIXL/UCX and the KV staging pool use /dev/shm, which is 64 MiB in a pod by default."""
    for w, t, c in containers(render(overlay)):
        if _args(c)[0] != "worker":
            continue
        mount = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert mount, w["metadata"]["name"]
        vol = {v["name"]: v for v in t["spec"]["volumes"]}[mount[0]["name"]]
        assert vol["emptyDir"]["medium"] == "Memory"


def test_tts_pool_is_cpu_only_loads_no_model_and_is_scraped():
    """components/tts on every overlay: one Deployment epd-tts running `epd worker
    --role=tts` as `epd launch` runs its t pool (TP 1, no --rank), with no --model (a tts
    worker loads none: its synthesizer is in the image), no GPU, toleration or model
    volume (so on gpu too it lands on CPU nodes), no UCX settings (it moves no KV), and
    the same pod on every overlay. Every workload, tts included, is scraped by exactly one
    PodMonitor; nothing autoscales the tts pool (its replicas are the user's)."""
    pods = {}
    for variant in VARIANTS:
        docs = render(variant)
        w = one(docs, "Deployment", "epd-tts")
        t = pod_template(w)
        (c,) = t["spec"]["containers"]
        args = _args(c)
        where = f"{variant}: epd-tts"
        assert args[0] == "worker" and flag_value(args, "--role") == "tts", where
        for flag in ("--model", "--tp", "--rank", "--kv-cache-memory-gb", "--kv-staging-mb"):
            assert flag_value(args, flag) is None and flag not in args, f"{where}: {flag}"
        res = c["resources"]
        assert not any("gpu" in k for part in res.values() for k in part), f"{where}: {res}"
        assert res["limits"]["memory"] == res["requests"]["memory"], where
        for key in ("tolerations", "nodeSelector", "affinity", "initContainers"):
            assert key not in t["spec"], f"{where}: {key}"
        assert {v["name"] for v in t["spec"]["volumes"]} == {"cluster-keys", "dshm"}, where
        assert not [e for e in c["env"] if e["name"].startswith("UCX_")], where
        pods[variant] = t
        for wl in workloads(docs):
            monitors = [name for name, pm in by_kind(docs, "PodMonitor").items()
                        if selects(pm["spec"]["selector"], pod_labels(wl))]
            assert len(monitors) == 1, f"{variant}: {wl['metadata']['name']} is scraped by {monitors}"
        assert [n for n, pm in by_kind(docs, "PodMonitor").items()
                if selects(pm["spec"]["selector"], pod_labels(w))] == ["epd-tts"]
        targets = [o["spec"]["scaleTargetRef"]["name"] for kind in ("HorizontalPodAutoscaler", "ScaledObject")
                   for o in by_kind(docs, kind).values()]
        assert "epd-tts" not in targets, variant
    first = next(iter(pods.values()))
    assert all(t == first for t in pods.values()), "the tts pod differs between overlays"
