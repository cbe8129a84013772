"""Security-test fixtures: certificates made at test time (trustme), and one stack whose internal
links are mutual TLS (worker <- scheduler) and whose gateway speaks TLS and wants API keys.

The tiny model, its tokenizer and redis-server are the suite's shared fixtures
(``tests/helpers/stack.py``, given to every folder by the root conftest). The
stack uses its own key prefix, so it never shares requests with another stack on that Redis.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import pytest_asyncio

from servicekit.tls import TlsFiles

from helpers.stack import MAX_NUM_SEQS, NUM_BLOCKS

PREFIX = "sec:"
KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-9876543210", "carol": "key-carol-revocable"}
MAX_REQUESTS_PER_KEY = 6
MAX_BUFFERED_OUTPUTS = 32


@dataclasses.dataclass
class Pki:
    """PEM files of one CA and the certificates it issued, plus an unrelated CA's client pair."""

    folder: Path
    ca: str
    worker: TlsFiles  # server side of the internal links (requires client certificates of ``ca``)
    scheduler: TlsFiles  # client side: presents its certificate, verifies workers against ``ca``
    gateway: TlsFiles  # public side: server TLS, no client certificates
    client: TlsFiles  # an SDK client: verifies the gateway against ``ca``
    stranger: TlsFiles  # a client certificate from another CA


def _write(folder: Path, name: str, blob) -> str:
    path = folder / name
    blob.write_to_path(str(path))
    return str(path)


def _pair(folder: Path, ca, name: str, *identities: str) -> tuple[str, str]:
    cert = ca.issue_cert(*identities)
    chain = folder / f"{name}.pem"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return str(chain), _write(folder, f"{name}.key", cert.private_key_pem)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    trustme = pytest.importorskip("trustme")
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca_file = _write(folder, "ca.pem", ca.cert_pem)
    names = ("127.0.0.1", "localhost")
    worker_cert, worker_key = _pair(folder, ca, "worker", *names)
    scheduler_cert, scheduler_key = _pair(folder, ca, "scheduler", "scheduler.internal")
    gateway_cert, gateway_key = _pair(folder, ca, "gateway", *names)
    stranger_cert, stranger_key = _pair(folder, other, "stranger", "scheduler.internal")
    return Pki(folder=folder, ca=ca_file,
               worker=TlsFiles(worker_cert, worker_key, ca_file),
               scheduler=TlsFiles(scheduler_cert, scheduler_key, ca_file),
               gateway=TlsFiles(gateway_cert, gateway_key),
               client=TlsFiles(ca_file=ca_file),
               stranger=TlsFiles(stranger_cert, stranger_key, ca_file))


@dataclasses.dataclass
class SecureStack:
    worker: object
    scheduler: object
    gateway: object
    keys_file: Path
    model: str

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def secure_stack(tiny_model_dir, hf_model, hf_tokenizer, redis_server, pki):
    """Worker (mTLS server), scheduler (mTLS client; its admin server TLS too) and gateway (TLS,
    API keys from a file) in this process, on free ports."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from scheduler_service.service import SchedulerApp
    from scheduler_service.config import SchedulerConfig
    from worker_service.config import ModelRunnerConfig
    from worker_service.config import WorkerConfig
    from worker_service.main import WorkerApp
    from worker_service.model_runner import ModelRunner

    keys_file = pki.folder / "api-keys.txt"
    keys_file.write_text("# test keys\n" + "\n".join(KEYS.values()) + "\n")
    runner = ModelRunner(ModelRunnerConfig(model=tiny_model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS),
                         hf_model=hf_model)
    w = pki.worker
    worker = WorkerApp(WorkerConfig(runner=runner.config, port=0, redis_url=redis_server.url, key_prefix=PREFIX,
                                      drain_grace_s=2, tls_cert_file=w.cert_file, tls_key_file=w.key_file,
                                      tls_ca_file=w.ca_file), runner=runner)
    await worker.start()
    s = pki.scheduler
    scheduler = SchedulerApp(SchedulerConfig(
        redis_url=redis_server.url, key_prefix=PREFIX, workers=(worker.address,), port=0, poll_block_ms=200,
        drain_grace_s=2, tls_cert_file=s.cert_file, tls_key_file=s.key_file, tls_ca_file=s.ca_file))
    await scheduler.start()
    await scheduler.wait_for_workers(1, timeout_s=30)
    g = pki.gateway
    gateway = GatewayApp(GatewayConfig(
        model=tiny_model_dir, port=0, redis_url=redis_server.url, key_prefix=PREFIX, read_block_ms=200,
        drain_grace_s=2, api_keys_file=str(keys_file), tls_cert_file=g.cert_file, tls_key_file=g.key_file, http_port=0,
        max_requests_per_key=MAX_REQUESTS_PER_KEY, max_buffered_outputs=MAX_BUFFERED_OUTPUTS),
        hf_tokenizer=hf_tokenizer)
    await gateway.start()
    yield SecureStack(worker, scheduler, gateway, keys_file, tiny_model_dir)
    await gateway.drain(1)
    await scheduler.drain(1)
    await worker.drain(1)
