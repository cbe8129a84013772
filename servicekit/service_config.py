"""The settings every service's server shares: where it listens, its metrics port, how it drains.

Each service's settings class inherits the concerns it has (this one, ``RedisConfig``,
``TlsConfig``, ...), so a knob shared by several services is declared once, here. A service's own
listen port is its own field: each has its own default (``servicekit.ports``).
"""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.contract.settings import setting

PORT_RANGE = dict(minimum=0, maximum=65535)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = setting("127.0.0.1", help="interface to listen on (0.0.0.0 in containers)")
    drain_grace_s: float = setting(30.0, minimum=0, help="on SIGTERM, seconds in-flight work may take to finish "
                                                         "before the server stops")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    # Off by default: several services of a kind share one host in local runs and tests, and each
    # would claim the same port; Kubernetes sets 9090 (deploy/k8s settings.env).
    metrics_port: int = setting(-1, minimum=-1, maximum=65535,
                                help="port of Prometheus /metrics on --host (0 = any free port, -1 = none)")
