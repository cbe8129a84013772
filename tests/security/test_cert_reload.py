"""Certificates reload without a restart: a server re-reads its certificate, key and CA when their
files change, at the next handshake. Replacing a server's certificate by one from another CA makes
new connections present it (clients trusting only the old CA now fail); replacing the client CA
makes the server accept only clients of the new one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.serving import ServerLifecycle
from servicekit.tls import TlsFiles, aio_channel

trustme = pytest.importorskip("trustme")


def _install(folder: Path, name: str, ca, *identities: str) -> tuple[str, str]:
    """Write a certificate ``ca`` issued (and its key) to ``name``.pem/.key, with a newer mtime."""
    cert = ca.issue_cert(*identities)
    paths = folder / f"{name}.pem", folder / f"{name}.key"
    paths[0].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    paths[1].write_bytes(cert.private_key_pem.bytes())
    _touch(*paths)
    return str(paths[0]), str(paths[1])


def _touch(*paths: Path) -> None:
    for path in paths:  # a later mtime even on a coarse-grained file system
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def _ca_file(folder: Path, name: str, ca) -> str:
    path = folder / f"{name}.pem"
    ca.cert_pem.write_to_path(str(path))
    _touch(path)
    return str(path)


async def _serving(address: str, tls: TlsFiles) -> bool:
    async with aio_channel(address, tls, []) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest_asyncio.fixture
async def server_files(tmp_path):
    old, new = trustme.CA(), trustme.CA()
    cert, key = _install(tmp_path, "server", old, "127.0.0.1")
    client_ca = _ca_file(tmp_path, "client-ca", old)
    lifecycle = ServerLifecycle(["test.Service"])
    port = lifecycle.bind("127.0.0.1:0", TlsFiles(cert, key, client_ca))
    await lifecycle.start()
    yield tmp_path, f"127.0.0.1:{port}", old, new
    await lifecycle.drain(0)


async def test_a_replaced_server_certificate_and_client_ca_apply_to_new_connections(server_files):
    folder, address, old, new = server_files
    old_client = TlsFiles(*_install(folder, "old-client", old, "client"), _ca_file(folder, "old-ca", old))
    new_client = TlsFiles(*_install(folder, "new-client", new, "client"), _ca_file(folder, "new-ca", new))
    assert await _serving(address, old_client)
    assert not await _serving(address, new_client)

    _install(folder, "server", new, "127.0.0.1")  # rotate everything to the new CA, in place
    _ca_file(folder, "client-ca", new)
    for _ in range(50):
        if await _serving(address, new_client):
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the server still presents its old certificate")
    assert not await _serving(address, old_client)
