"""Our own rules for deploy/k8s, checked on every rendered overlay: what a schema cannot know.

- every container has startup, readiness and liveness probes; ours are native gRPC probes on the
  port the service listens on;
- a pod's grace period covers its preStop plus the SIGTERM drain, and liveness never kills a pod
  that is draining;
- each Deployment's arguments and environment are accepted by the real ``pagedserve <role>`` flags,
  and every PAGEDSERVE_* variable it is given names one of them;
- no host ports or host network, workers above all; non-root, read-only root, no privilege gain;
- every image tag pinned; resource requests and limits; one disruption budget per role;
- KEDA watches the stream and consumer group the services use, at the Redis they use, with an
  in-flight target equal to the worker's batch;
- committed Secrets are placeholders.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from types import ModuleType
from urllib.parse import urlsplit

import pytest

import gateway_service.main
import scheduler_service.main
import worker_service.main
from servicekit.redis_layout import SCHEDULER_GROUP, RedisKeys

from .manifests import OVERLAYS, container_env, find, named_port, one, pod_spec, render, workloads

ROLES: dict[str, ModuleType] = {
    "gateway": gateway_service.main, "scheduler": scheduler_service.main, "worker": worker_service.main}
# Variables read outside the flags: the C kernel's cache (paged_kernels/native.py).
NON_FLAG_VARIABLES: set[str] = set()  # PAGEDSERVE_KERNEL_CACHE is the worker's --kernel-cache now
# Flags named in settings.env ahead of the code that reads them (none now: http_port and
# metrics_port are settings of the gateway and of the scheduler and worker).
PENDING_FLAG_VARIABLES: set[str] = set()
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@pytest.fixture(params=OVERLAYS)
def objects(request) -> list[dict]:
    return render(f"overlays/{request.param}")


def _service(objects: list[dict], role: str) -> tuple[dict, dict]:
    """(Deployment, its one container) of ``role``."""
    deployment = one(objects, "Deployment", role)
    containers = pod_spec(deployment)["containers"]
    assert len(containers) == 1, f"{role}: one container per pod"
    return deployment, containers[0]


def _parsed(objects: list[dict], role: str) -> tuple[argparse.Namespace, object, dict[str, str]]:
    """The role's flags as ``pagedserve <role>`` parses its args + environment, and its settings."""
    _deployment, container = _service(objects, role)
    assert container["args"][0] == role
    env = container_env(objects, container)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = ROLES[role].build_parser(env).parse_args(container["args"][1:])
    except SystemExit:
        pytest.fail(f"pagedserve {role} rejects its manifest: {stderr.getvalue()}")
    return args, ROLES[role].settings_from_args(args), env


@pytest.mark.parametrize("role", ROLES)
def test_services_accept_their_arguments_and_listen_where_probed(objects, role):
    _args, settings, _env = _parsed(objects, role)
    _deployment, container = _service(objects, role)

    assert settings.host == "0.0.0.0"
    assert settings.port == named_port(container, "grpc")
    for probe in PROBES:
        assert container[probe]["grpc"]["port"] == settings.port, f"{role}.{probe}"


def test_every_pagedserve_variable_names_a_flag_of_its_role(objects):
    flags = {role: set(vars(module.build_parser({}).parse_args([]))) for role, module in ROLES.items()}
    (settings_map,) = find(objects, "ConfigMap")
    shared = set(settings_map["data"])

    for name in shared - NON_FLAG_VARIABLES - PENDING_FLAG_VARIABLES:
        if name.startswith("PAGEDSERVE_"):
            dest = name.removeprefix("PAGEDSERVE_").lower()
            assert any(dest in role_flags for role_flags in flags.values()), f"settings.env: {name} is no flag"
    for role in ROLES:
        for var in _service(objects, role)[1].get("env", []):
            if var["name"].startswith("PAGEDSERVE_"):
                assert var["name"].removeprefix("PAGEDSERVE_").lower() in flags[role], f"{role}: {var['name']}"


def test_workers_advertise_their_pod_ip(objects):
    _args, settings, env = _parsed(objects, "worker")
    pod_ip = next(v for v in _service(objects, "worker")[1]["env"] if v["name"] == "POD_IP")

    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert settings.address_for(settings.port) == f"{env['POD_IP']}:{settings.port}"


def test_gateway_and_workers_serve_the_same_model(objects):
    assert _parsed(objects, "gateway")[1].model == _parsed(objects, "worker")[1].runner.model


def test_every_container_has_three_probes(objects):
    for workload in workloads(objects):
        for container in pod_spec(workload)["containers"]:
            missing = [p for p in PROBES if p not in container]
            assert not missing, f"{workload['metadata']['name']}/{container['name']} lacks {missing}"


@pytest.mark.parametrize("role", ROLES)
def test_grace_period_covers_prestop_and_drain(objects, role):
    _args, settings, _env = _parsed(objects, role)
    deployment, container = _service(objects, role)
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    liveness = container["livenessProbe"]

    assert grace >= pre_stop_s + settings.drain_grace_s + 5, "room to exit after the drain"
    # Health is NOT_SERVING for the whole drain: liveness must not restart the pod meanwhile.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > settings.drain_grace_s


def test_gateways_leave_the_service_before_they_drain(objects):
    _deployment, container = _service(objects, "gateway")

    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_no_host_ports_or_host_network(objects):
    for workload in workloads(objects):
        spec = pod_spec(workload)
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        for container in spec["containers"]:
            assert all("hostPort" not in p for p in container.get("ports", [])), workload["metadata"]["name"]


def test_workers_have_no_service(objects):
    worker_labels = one(objects, "Deployment", "worker")["spec"]["template"]["metadata"]["labels"]
    for service in find(objects, "Service"):
        selector = service["spec"].get("selector", {})
        assert not selector.items() <= worker_labels.items(), f"Service {service['metadata']['name']} selects workers"


def test_every_image_tag_is_pinned(objects):
    for workload in workloads(objects):
        for container in pod_spec(workload)["containers"]:
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert "@sha256:" in image or (name and "/" not in tag and tag not in ("", "latest")), image


def test_pods_run_as_non_root_with_a_read_only_root(objects):
    for workload in workloads(objects):
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec.get("automountServiceAccountToken") is False
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]


def test_caches_are_on_writable_volumes(objects):
    for role in ROLES:
        deployment, container = _service(objects, role)
        env = container_env(objects, container)
        mounts = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        empty_dirs = {v["name"] for v in pod_spec(deployment)["volumes"] if "emptyDir" in v}
        assert {m["name"] for m in container["volumeMounts"] if m["mountPath"] in mounts} <= empty_dirs
        for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "PAGEDSERVE_KERNEL_CACHE"):
            assert any(env[var] == m or env[var].startswith(m + "/") for m in mounts), f"{role}: {var}"
        assert "/tmp" in mounts


def test_every_container_has_requests_and_limits(objects):
    for workload in workloads(objects):
        for container in pod_spec(workload)["containers"]:
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= container["resources"][bound].keys(), (workload["metadata"]["name"], bound)


def test_one_disruption_budget_per_role(objects):
    budgets = find(objects, "PodDisruptionBudget")
    for role in ROLES:
        labels = one(objects, "Deployment", role)["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, role


def test_prometheus_scrapes_a_declared_port(objects):
    for role in ROLES:
        deployment, container = _service(objects, role)
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) in {p["containerPort"] for p in container["ports"]}


@pytest.mark.parametrize("role", ROLES)
def test_services_serve_metrics_where_prometheus_scrapes(objects, role):
    deployment, _container = _service(objects, role)
    _args, settings, _env = _parsed(objects, role)
    scraped = int(deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    served = settings.http_port if role == "gateway" else settings.metrics_port  # the gateway: on its HTTP API
    assert served == scraped
    if role == "gateway":
        assert settings.http_host == "" and settings.host == "0.0.0.0"  # HTTP on --host: reachable in the pod


def test_gateway_service_exposes_grpc_and_http(objects):
    _deployment, container = _service(objects, "gateway")
    service = one(objects, "Service", "gateway")

    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    for port in service["spec"]["ports"]:
        named_port(container, port["targetPort"])


def test_services_and_keda_use_the_same_redis_stream(objects):
    _args, gateway, _env = _parsed(objects, "gateway")
    _args, scheduler, _env = _parsed(objects, "scheduler")
    _args, worker, _env = _parsed(objects, "worker")
    assert gateway.redis_url == scheduler.redis_url == worker.redis_url
    assert gateway.key_prefix == scheduler.key_prefix == worker.key_prefix
    redis_url = urlsplit(gateway.redis_url)
    redis_service = one(objects, "Service", redis_url.hostname)
    assert redis_url.port in {p["port"] for p in redis_service["spec"]["ports"]}
    scaled = one(objects, "ScaledObject", "worker")

    assert scaled["spec"]["scaleTargetRef"]["name"] == "worker"
    assert {t["type"] for t in scaled["spec"]["triggers"]} == {"redis-streams"}
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert meta["stream"] == RedisKeys(gateway.key_prefix).requests
        assert meta["consumerGroup"] == SCHEDULER_GROUP
        # KEDA's operator runs in its own namespace: it needs the namespaced name.
        namespace = redis_service["metadata"]["namespace"]
        assert meta["address"] == f"{redis_url.hostname}.{namespace}.svc:{redis_url.port}"
        assert int(meta.get("databaseIndex", "0")) == int(redis_url.path.lstrip("/") or 0)


def test_keda_in_flight_target_is_one_worker_batch(objects):
    _args, worker, _env = _parsed(objects, "worker")
    triggers = {t["name"]: t["metadata"] for t in one(objects, "ScaledObject", "worker")["spec"]["triggers"]}

    assert int(triggers["in-flight"]["pendingEntriesCount"]) == worker.runner.max_num_seqs
    # KEDA uses lag when lagCount is set, pending entries otherwise (one signal per trigger).
    assert "lagCount" not in triggers["in-flight"] and int(triggers["queue-lag"]["lagCount"]) > 0


def test_gpu_workers_request_one_gpu_and_cpu_workers_none():
    for overlay, gpus in [("gpu", "1"), ("cpu-dev", None)]:
        objects = render(f"overlays/{overlay}")
        resources = _service(objects, "worker")[1]["resources"]
        assert resources["requests"].get("nvidia.com/gpu") == gpus == resources["limits"].get("nvidia.com/gpu")
        for role in ("gateway", "scheduler"):
            assert "nvidia.com/gpu" not in _service(objects, role)[1]["resources"]["limits"]


def test_committed_secrets_are_placeholders(objects):
    for secret in find(objects, "Secret"):
        assert "data" not in secret, "only readable stringData placeholders are committed"
        for key, value in secret["stringData"].items():
            assert value.startswith("PLACEHOLDER"), f"Secret {secret['metadata']['name']}/{key}"
