"""compose.yaml is valid against the Compose spec and keeps the conventions that make
`docker compose up --scale worker=N` work (no docker engine needed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.stack import REPO

COMPOSE = REPO / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def check_against_compose_spec(path: Path) -> None:
    """``path`` validates against the Compose spec (skips without check-jsonschema)."""
    tool = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    if not Path(tool).exists():
        pytest.skip("check-jsonschema is not installed")
    result = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_validates_against_the_compose_spec():
    check_against_compose_spec(COMPOSE)


def test_stack_has_redis_gateway_scheduler_worker_and_prometheus_all_with_healthchecks(compose):
    services = compose["services"]
    assert {name for name, s in services.items() if "profiles" not in s} == {"redis", "gateway", "scheduler", "worker",
                                                                            "prometheus"}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_sentinel_profile_adds_a_replica_and_a_quorum_of_sentinels_the_services_can_be_pointed_at(compose):
    services = compose["services"]
    optional = {name for name, s in services.items() if "profiles" in s}
    assert optional == {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}
    assert all(services[name]["profiles"] == ["sentinel"] for name in optional)
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == ["redis", "6379"]
    assert replica[replica.index("--appendonly") + 1] == "yes"
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        script = " ".join(services[name]["command"])
        assert "--sentinel" in script and "sentinel monitor pagedserve redis 6379 2" in script
    for name in ("gateway", "scheduler", "worker"):
        env = services[name]["environment"]
        assert "PAGEDSERVE_REDIS_SENTINELS" in env and env["PAGEDSERVE_REDIS_MASTER_NAME"] == "pagedserve"


def test_redis_keeps_an_append_only_file(compose):
    command = compose["services"]["redis"]["command"]
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"


def test_worker_scales_and_reserves_a_gpu(compose):
    worker = compose["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)


def test_services_start_after_what_they_need_is_healthy(compose):
    services = compose["services"]
    for name, needs in {"worker": {"redis"}, "scheduler": {"redis", "worker"}, "gateway": {"redis", "scheduler"}}.items():
        depends = services[name]["depends_on"]
        assert set(depends) == needs
        assert all(d["condition"] == "service_healthy" for d in depends.values())


def test_prometheus_scrapes_every_service_where_it_serves_metrics(compose):
    services = compose["services"]
    volumes = services["prometheus"]["volumes"]
    config_file = next(v.split(":")[0] for v in volumes if v.endswith("prometheus.yml:ro"))
    config = yaml.safe_load((REPO / config_file).read_text())
    scraped = {job["job_name"]: (sd["names"], sd["port"]) for job in config["scrape_configs"]
               for sd in job["dns_sd_configs"]}
    env = services["gateway"]["environment"]
    http_port, metrics_port = int(env["PAGEDSERVE_HTTP_PORT"]), int(env["PAGEDSERVE_METRICS_PORT"])
    assert scraped == {"gateway": (["gateway"], http_port), "scheduler": (["scheduler"], metrics_port),
                       "worker": (["worker"], metrics_port)}
    for name in ("scheduler", "worker"):  # the shared environment reaches each service
        assert services[name]["environment"]["PAGEDSERVE_METRICS_PORT"] == str(metrics_port)
    assert f"{http_port}:{http_port}" in services["gateway"]["ports"]


def test_dockerfile_generates_the_protobuf_code_with_the_one_command():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "python -m servicekit.proto.gen" in dockerfile
