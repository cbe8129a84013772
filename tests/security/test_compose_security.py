"""compose.secure.yaml (layered over compose.yaml) turns security on: secrets as compose secrets
read through PAGEDSERVE_*_FILE, TLS material mounted read-only, Redis without anonymous access.
And what deploy/compose/make-secrets.sh makes really works: its Redis ACL file, role users, internal
token, API key and certificates run a worker, a scheduler and a gateway (in this process, a
simulated model runner) that serve a request end to end over TLS — no docker engine needed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.stack import start_redis_server, stop_redis_server
from deploy.test_compose import check_against_compose_spec

REPO = Path(__file__).resolve().parents[2]
SECURE = REPO / "compose.secure.yaml"
SECRET_SETTINGS = ("PAGEDSERVE_REDIS_URL", "PAGEDSERVE_INTERNAL_TOKEN", "PAGEDSERVE_API_KEYS")


@pytest.fixture(scope="module")
def secure() -> dict:
    return yaml.safe_load(SECURE.read_text())


def test_the_overlay_validates_against_the_compose_spec():
    check_against_compose_spec(SECURE)


def test_secrets_are_compose_secrets_and_never_environment_values(secure):
    services = secure["services"]
    declared = set(secure["secrets"])
    for name in ("worker", "scheduler", "gateway"):
        env = services[name]["environment"]
        assert not set(SECRET_SETTINGS) & set(env), f"{name} has a secret in its environment"
        files = {value for key, value in env.items() if key.endswith("_FILE") and value.startswith("/run/secrets/")}
        assert files, name
        assert {f.rsplit("/", 1)[1] for f in files} <= set(services[name]["secrets"]) <= declared
    assert services["redis"]["secrets"] == ["redis_acl"] and "--aclfile" in services["redis"]["command"]


def test_tls_material_is_mounted_read_only(secure):
    for name in ("worker", "scheduler", "gateway"):
        (volume,) = secure["services"][name]["volumes"]
        assert volume["read_only"] is True and volume["target"] == "/run/tls"
        env = secure["services"][name]["environment"]
        assert env["PAGEDSERVE_TLS_CERT_FILE"].startswith("/run/tls/")
    assert "PAGEDSERVE_TLS_CA_FILE" in secure["services"]["worker"]["environment"]  # mutual TLS on workers


@pytest.fixture(scope="module")
def made_secrets(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    folder = tmp_path_factory.mktemp("compose")
    script = folder / "make-secrets.sh"
    shutil.copy(REPO / "deploy/compose/make-secrets.sh", script)
    result = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert subprocess.run(["sh", str(script)], capture_output=True).returncode != 0  # never overwrites
    return folder


@pytest.fixture(scope="module")
def acl_redis(made_secrets):
    server = start_redis_server(made_secrets, "--aclfile", str(made_secrets / "secrets/redis.acl"))
    yield server.port
    stop_redis_server(server)


def _role_url(made_secrets: Path, role: str, port: int) -> str:
    return (made_secrets / f"secrets/redis_url_{role}").read_text().replace("@redis:6379", f"@127.0.0.1:{port}")


async def test_the_made_secrets_run_the_stack_end_to_end(made_secrets, acl_redis, tiny_model_dir, hf_tokenizer):
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from pagedserve.aio_client import AsyncClient
    from pagedserve.errors import UnauthenticatedError
    from scheduler_service.service import SchedulerApp
    from scheduler_service.config import SchedulerConfig
    from servicekit.tls import TlsFiles
    from worker_service.config import ModelRunnerConfig
    from worker_service.config import WorkerConfig
    from worker_service.main import WorkerApp

    tls = made_secrets / "tls"
    token = (made_secrets / "secrets/internal_token").read_text().strip()
    worker = WorkerApp(WorkerConfig(
        runner=ModelRunnerConfig(model=tiny_model_dir, num_blocks=64), port=0, simulate_step_latency=(0.0, 0.0),
        redis_url=_role_url(made_secrets, "worker", acl_redis), internal_token=token, drain_grace_s=1,
        tls_cert_file=str(tls / "worker.pem"), tls_key_file=str(tls / "worker.key"), tls_ca_file=str(tls / "ca.pem")))
    await worker.start()
    scheduler = SchedulerApp(SchedulerConfig(
        redis_url=_role_url(made_secrets, "scheduler", acl_redis), port=0, poll_block_ms=200, drain_grace_s=1,
        internal_token=token, tls_cert_file=str(tls / "scheduler.pem"), tls_key_file=str(tls / "scheduler.key"),
        tls_ca_file=str(tls / "ca.pem"), tls_server_name="worker"))  # workers found in the registry
    gateway = GatewayApp(GatewayConfig(
        model=tiny_model_dir, port=0, redis_url=_role_url(made_secrets, "gateway", acl_redis), read_block_ms=200,
        drain_grace_s=1, api_keys_file=str(made_secrets / "secrets/api_keys"), tls_cert_file=str(tls / "gateway.pem"),
        tls_key_file=str(tls / "gateway.key"), reflection=False), hf_tokenizer=hf_tokenizer)
    try:
        await scheduler.start()
        await scheduler.wait_for_workers(1, timeout_s=30)
        await gateway.start()
        key = (made_secrets / "secrets/api_keys").read_text().splitlines()[-1]
        client_tls = TlsFiles(ca_file=str(tls / "ca.pem"), server_name="gateway")
        address = f"127.0.0.1:{gateway.port}"
        async with AsyncClient(address, api_key=key, tls=client_tls, timeout=60) as sdk:
            completion = await sdk.generate("Hello", max_tokens=5, ignore_eos=True)
        assert len(completion.token_ids) == 5
        async with AsyncClient(address, api_key="not-the-key", tls=client_tls, timeout=60) as sdk:
            with pytest.raises(UnauthenticatedError):
                await sdk.generate("Hello", max_tokens=5)
    finally:
        await gateway.drain(1)
        await scheduler.drain(1)
        await worker.drain(1)
