"""deploy/: the rendered documents are valid objects. Built-in kinds: kubernetes-validate
--strict (unknown fields are errors) for K8S_VERSION; CRD kinds (PodMonitor, ScaledObject,
LeaderWorkerSet): the strict JSON schemas vendored in deploy/schemas/."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from tests.deploy.manifests import (
    CRD_SCHEMAS,
    K8S_VERSION,
    RENDERED,
    SCHEMAS,
    by_kind,
    crd_validator,
    one,
    overlay_and_components,
    render,
)


def _validate_builtin(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", RENDERED)
def test_builtin_kinds_validate_strictly(overlay):
    """Every non-CRD document passes kubernetes-validate --strict for K8S_VERSION, and every
    document is either that or a CRD with a vendored schema (nothing goes unchecked)."""
    import kubernetes_validate

    errors = []
    for doc in render(overlay):
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_SCHEMAS:
            continue
        try:
            _validate_builtin(doc)
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{key}: no schema, neither in kubernetes-validate nor in deploy/schemas")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {e.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", RENDERED)
def test_crd_objects_validate_against_vendored_schemas(overlay):
    """PodMonitors, ScaledObjects and LeaderWorkerSets match their strict vendored schemas
    (the LWS pod template as Kubernetes' own strict PodTemplateSpec)."""
    errors, seen = [], set()
    for doc in render(overlay):
        key = (doc["apiVersion"], doc["kind"])
        if key not in CRD_SCHEMAS:
            continue
        seen.add(key)
        for e in crd_validator(*key).iter_errors(doc):
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, "\n".join(errors)
    expected = {("monitoring.coreos.com/v1", "PodMonitor")}
    base = overlay_and_components(overlay)[0]
    if base == "keda":
        expected.add(("keda.sh/v1alpha1", "ScaledObject"))
    if base == "gpu":
        expected.add(("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"))
    assert expected <= seen


def test_vendored_schemas_are_valid_and_document_their_provenance():
    for name in CRD_SCHEMAS.values():
        schema = json.loads((SCHEMAS / name).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert "description" in schema and ("Generated" in schema["description"] or "by hand" in schema["description"])


def _errors(doc: dict) -> list[str]:
    return [e.message for e in crd_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)]


def test_vendored_schemas_reject_mistakes():
    """The CRD schemas are strict: a misspelt field, a wrong type or a bad enum value in
    otherwise valid rendered objects is an error (so the validation above can fail)."""
    keda = one(render("keda"), "ScaledObject", "epd-decode")
    gpu = render("gpu")
    lws = one(gpu, "LeaderWorkerSet", "epd-prefill")
    pm = one(gpu, "PodMonitor", "epd-decode")
    assert not _errors(keda) and not _errors(lws) and not _errors(pm)

    bad = copy.deepcopy(pm)
    bad["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True  # misspelt
    assert _errors(bad)
    bad = copy.deepcopy(pm)
    bad["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"  # not a Prometheus duration
    assert _errors(bad)

    bad = copy.deepcopy(keda)
    bad["spec"]["maxReplicas"] = 3  # HPA's name, not KEDA's
    assert _errors(bad)
    bad = copy.deepcopy(keda)
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 48  # trigger metadata are strings
    assert _errors(bad)

    bad = copy.deepcopy(lws)
    bad["spec"]["startupPolicy"] = "LeaderFirst"
    assert _errors(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    assert _errors(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["resource"] = {}  # misspelt
    assert _errors(bad)
    bad = copy.deepcopy(lws)
    del bad["metadata"]["name"]
    bad["metadata"]["nmae"] = "x"
    assert _errors(bad)


def test_kubernetes_validate_rejects_mistakes():
    """kubernetes-validate --strict catches a misspelt field in a rendered Deployment and
    an HPA metric of an unknown type."""
    import kubernetes_validate

    docs = render("cpu")
    dep = copy.deepcopy(one(docs, "Deployment", "epd-decode"))
    dep["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_builtin(dep)
    hpa = copy.deepcopy(by_kind(docs, "HorizontalPodAutoscaler")["epd-decode"])
    hpa["spec"]["metrics"][0]["type"] = "Pod"
    hpa["spec"]["metrics"][0]["pod"] = hpa["spec"]["metrics"][0].pop("pods")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_builtin(hpa)
