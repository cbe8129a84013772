"""deploy/k8s renders and validates offline: ``kubectl kustomize`` builds the base and every
overlay, every Kubernetes object passes kubernetes-validate's strict schema (unknown fields are
errors) for the oldest and newest Kubernetes we support, and KEDA's ScaledObject passes the schema
vendored from KEDA's CRD."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest

from .manifests import KEDA_SCHEMA, OVERLAYS, find, one, render

# 1.28: native gRPC probes (GA 1.27) and every API used here are stable; 1.37: the newest schema
# kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")
KEDA_API = "keda.sh/v1alpha1"
TARGETS = ("base", *(f"overlays/{o}" for o in OVERLAYS))


@pytest.fixture(scope="module")
def keda_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_builds_the_whole_stack(target):
    objects = render(target)

    for kind, name in [("Namespace", "pagedserve"), ("Deployment", "gateway"), ("Deployment", "scheduler"),
                       ("Deployment", "worker"), ("Service", "gateway"), ("StatefulSet", "redis"),
                       ("Service", "redis"), ("ScaledObject", "worker"), ("HorizontalPodAutoscaler", "gateway"),
                       ("Secret", "pagedserve-api-keys"), ("Secret", "pagedserve-tls")]:
        one(objects, kind, name)
    assert {p["metadata"]["name"] for p in find(objects, "PodDisruptionBudget")} == {"gateway", "scheduler", "worker"}
    assert len(find(objects, "ConfigMap")) == 1
    assert {o["metadata"].get("namespace", "pagedserve") for o in objects} == {"pagedserve"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_kubernetes_objects_pass_the_strict_schema(target, version):
    kubernetes_objects = [o for o in render(target) if o["apiVersion"] != KEDA_API]

    for obj in kubernetes_objects:
        # Raises ValidationError on a wrong or unknown field, SchemaNotFoundError on an unknown kind.
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_strict_schema_rejects_a_misspelt_field():
    deployment = one(render("base"), "Deployment", "worker")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}

    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_scaled_objects_pass_the_keda_crd_schema(target, keda_validator):
    scaled_objects = [o for o in render(target) if o["apiVersion"] == KEDA_API]
    assert [o["kind"] for o in scaled_objects] == ["ScaledObject"]

    for obj in scaled_objects:
        keda_validator.validate(obj)
        # The CRD's one CEL rule, which JSON Schema cannot express.
        spec = obj["spec"]
        assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)


@pytest.mark.parametrize("mistake", ["unknown trigger field", "missing stream metadata type", "negative min"])
def test_the_keda_schema_rejects_a_broken_scaled_object(keda_validator, mistake):
    scaled_object = one(render("base"), "ScaledObject", "worker")
    spec = scaled_object["spec"]
    if mistake == "unknown trigger field":
        spec["triggers"][0]["metdata"] = spec["triggers"][0]["metadata"]
    elif mistake == "missing stream metadata type":
        del spec["triggers"][0]["type"]
    else:
        spec["minReplicaCount"] = -1

    with pytest.raises(jsonschema.ValidationError):
        keda_validator.validate(scaled_object)
