"""Rendering deploy/k8s and reading what the rendered objects say (shared by the deploy tests).

``kubectl kustomize`` renders an overlay (the Makefile installs kubectl); the helpers below give the
pieces the tests look at: objects by kind and name, each pod template's containers, and the
environment a container would see, with ``$(VAR)`` references expanded as the kubelet does.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-dev", "gpu")
KEDA_SCHEMA = K8S_DIR / "schemas" / "keda-scaledobject-v1alpha1.json"
# What the downward API gives status.podIP in these tests.
SAMPLE_POD_IP = "10.1.2.3"


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not installed: `make install` installs it (apt-get install kubectl, from a "
                    "Kubernetes apt source such as pkgs.k8s.io)")
    return path


@functools.cache
def _render_text(target: str) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(K8S_DIR / target)],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {target} failed:\n{result.stderr}")
    return result.stdout


def render(target: str) -> list[dict]:
    """The objects ``kubectl kustomize deploy/k8s/<target>`` prints (a fresh copy each call)."""
    return [doc for doc in yaml.safe_load_all(_render_text(target)) if doc]


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objects: list[dict]) -> Iterator[dict]:
    """Every object that runs pods (Deployments and StatefulSets)."""
    return (o for o in objects if o["kind"] in ("Deployment", "StatefulSet"))


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """The environment ``container`` starts with: its ConfigMaps (envFrom), then ``env`` with
    ``$(VAR)`` expanded against what is defined so far; status.podIP is :data:`SAMPLE_POD_IP`."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = SAMPLE_POD_IP
    return env


def named_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name!r}: {sorted(ports)}"
    return ports[name]
