"""TLS material for gRPC servers and channels, read from PEM files.

- A server with a certificate and key speaks TLS; with a CA file as well it requires every client
  to present a certificate that CA signed (mutual TLS): a client with no certificate, or one from
  another CA, fails the handshake before any RPC (health checks included) reaches the service.
- A server's files are re-read when their modification times change, on the next handshake
  (``grpc.dynamic_ssl_server_credentials``), so a renewed certificate applies to new connections
  without a restart; connections already open keep the certificate they were made with.
- A channel reads its files when it is made: the scheduler makes a new channel for every (re)connect
  to a worker, so renewed client certificates apply from the next connection.

Invariant: a :class:`TlsFiles` either is off (no file named) or names a readable certificate and key
(a CA alone is enough for a client that only verifies its server); :meth:`TlsFiles.check` says
which file is wrong at start-up instead of at the first handshake.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import grpc

from servicekit.contract.settings import setting

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class TlsFiles:
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    server_name: str = ""  # a client's expected name in the server's certificate ("" = the host dialed)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.key_file or self.ca_file)

    def check(self, *, server: bool) -> None:
        """ValueError naming the setting that is wrong (a server needs cert and key)."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls_cert_file and tls_key_file: give both or neither")
        if server and self.ca_file and not self.cert_file:
            raise ValueError("tls_ca_file: a TLS server also needs tls_cert_file and tls_key_file")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"tls_{name}: cannot read {path!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """A service's TLS files (its settings inherit them); :attr:`tls` is them as :class:`TlsFiles`.
    Whether a service serves or dials with them, and whether client certificates are required,
    is the service's: see its ``--help`` and docs/operations.md."""

    tls_cert_file: str = setting("", help="PEM certificate presented: a server's own, or a client's to a server that "
                                          "requires one (with --tls-key-file; empty: none)")
    tls_key_file: str = setting("", help="PEM private key of --tls-cert-file (mount it read-only)")
    tls_ca_file: str = setting("", help="PEM CA certificate: a server requires client certificates it signed "
                                        "(mutual TLS); a client (the scheduler dialing workers, the client commands) "
                                        "verifies its servers with it, and setting it turns TLS to them on")

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TlsClientConfig(TlsConfig):
    """TLS files of a service or command that dials servers (the scheduler to its workers, the
    client commands): the files above plus the name to expect in the server's certificate."""

    tls_server_name: str = setting("", help="name the server's certificate carries, when it is not the address "
                                            "dialed (workers register their IPs)")

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_server_name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InternalLinkConfig(TlsConfig):
    """The link between schedulers and workers: TLS and/or a shared token."""

    internal_token: str = setting("", secret=True, help="shared secret every internal RPC carries (authorization: "
                                                        "Bearer ...), checked by workers and schedulers; prefer the "
                                                        "env var or a compose secret to the flag (empty: none)")


def describe(files: TlsFiles | None, *, token: bool = False) -> str:
    """How a link is protected, for start-up log lines: "mutual TLS" (a certificate and a CA: a
    server that requires client certificates, or a client that presents one), "TLS" or
    "plaintext"; "+ internal token" when calls carry the shared token as well."""
    if files is None or not files.enabled:
        kind = "plaintext"
    else:
        kind = "mutual TLS" if files.cert_file and files.ca_file else "TLS"
    return f"{kind} + internal token" if token else kind


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _mtimes(files: TlsFiles) -> tuple[int, ...]:
    return tuple(os.stat(p).st_mtime_ns if p else 0 for p in (files.cert_file, files.key_file, files.ca_file))


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """TLS server credentials re-read from ``files`` whenever they change; client certificates
    required (and verified against ``ca_file``) when a CA is given."""
    files.check(server=True)
    state = {"mtimes": _mtimes(files)}

    def configuration():
        return grpc.ssl_server_certificate_configuration(
            [(_read(files.key_file), _read(files.cert_file))], root_certificates=_read(files.ca_file))

    def fetch():  # called by gRPC before each handshake: None keeps the current configuration
        try:
            mtimes = _mtimes(files)
            if mtimes == state["mtimes"]:
                return None
            config = configuration()
        except (OSError, ValueError, RuntimeError) as exc:  # half-written files: keep the old ones
            log.warning("TLS files not reloaded: %s", exc)
            return None
        state["mtimes"] = mtimes
        log.info("TLS certificate %s reloaded", files.cert_file)
        return config

    return grpc.dynamic_ssl_server_credentials(configuration(), fetch,
                                               require_client_authentication=bool(files.ca_file))


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: the server is verified against ``ca_file`` (the system's roots when
    empty); with a certificate and key, they are presented to a server that asks (mutual TLS)."""
    files.check(server=False)
    return grpc.ssl_channel_credentials(root_certificates=_read(files.ca_file), private_key=_read(files.key_file),
                                        certificate_chain=_read(files.cert_file))


def channel_options(files: TlsFiles) -> list[tuple[str, str]]:
    """Extra channel options: the name a server's certificate is checked against, when the address
    dialed is not in it (workers register their container IPs)."""
    return [("grpc.ssl_target_name_override", files.server_name)] if files.enabled and files.server_name else []


def aio_channel(address: str, files: TlsFiles | None, options: list) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: TLS when ``files`` is enabled, plaintext otherwise."""
    if files is None or not files.enabled:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, channel_credentials(files), options=options + channel_options(files))


def sync_channel(address: str, files: TlsFiles | None, options: list | None = None) -> grpc.Channel:
    """A blocking channel to ``address`` (as :func:`aio_channel`)."""
    options = list(options or [])
    if files is None or not files.enabled:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(files), options=options + channel_options(files))


def files_from_env(env) -> TlsFiles:
    """The TLS files a command-line client (``pagedserve health``/``stats``) uses: the same
    ``PAGEDSERVE_TLS_*`` variables a service's container has, so its healthcheck needs no flags."""
    return TlsFiles(cert_file=env.get("PAGEDSERVE_TLS_CERT_FILE", ""), key_file=env.get("PAGEDSERVE_TLS_KEY_FILE", ""),
                    ca_file=env.get("PAGEDSERVE_TLS_CA_FILE", ""),
                    server_name=env.get("PAGEDSERVE_TLS_SERVER_NAME", ""))
