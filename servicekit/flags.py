"""Settings → flags: each service's frozen settings dataclass is the one source of every knob.

A field declared with :func:`setting` carries its help text; :func:`add_setting_flags` turns
each such field into ``--field-name`` (type, default and choices from the field) that falls back to
the ``PAGEDSERVE_FIELD_NAME`` environment variable, and :func:`settings_kwargs` reads the parsed
values back into the dataclass's keyword arguments. Precedence: command-line flag > environment
variable (or the file ``PAGEDSERVE_FIELD_NAME_FILE`` names: secrets mounted as files) > the field's
default. ``--help`` shows each flag's variable and effective default
(STYLE.md habits 4 and 15).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from servicekit.redis_keys import DEFAULT_PREFIX

ENV_PREFIX = "PAGEDSERVE_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
FILE_SUFFIX = "_FILE"  # PAGEDSERVE_X_FILE=/run/secrets/x: the value of PAGEDSERVE_X is that file's content


def env_var(flag: str) -> str:
    """``redis-url`` -> ``PAGEDSERVE_REDIS_URL``."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_list(text: str) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")`` (empty items dropped)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def setting(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
            choices: Any = None, type: Callable[[str], Any] | None = None, secret: bool = False) -> Any:
    """A settings field that is also a flag. ``type`` parses the flag's text (default: from the
    default's type; ``parse_list`` for tuples); a field with a ``default_factory`` (a generated id)
    takes the factory's value when its flag is left empty. A ``secret`` (keys, tokens) never shows
    its value in ``--help``."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "type": type,
                "secret": secret}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _flag_type(field: dataclasses.Field) -> Callable[[str], Any]:
    explicit = field.metadata.get("type")
    if explicit is not None:
        return explicit
    default = field.default
    if isinstance(default, bool):
        return bool
    if isinstance(default, tuple):
        return parse_list
    if isinstance(default, (int, float)):
        return type(default)
    return str


def add_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], flag: str, *,
             type: Callable[[str], Any] = str, default: Any = None, help: str,
             choices: Any = None, secret: bool = False) -> None:
    """Add ``--flag`` whose default comes from ``PAGEDSERVE_FLAG`` when that is set in ``env``, or
    from the file ``PAGEDSERVE_FLAG_FILE`` names (which wins; for secrets mounted as files). A
    ``secret`` one's value, and any value read from a file, is not shown in ``--help``."""
    var = env_var(flag)
    source = var
    if var + FILE_SUFFIX in env:  # a secret mounted as a file (compose/Kubernetes secrets) wins
        source = var + FILE_SUFFIX
        try:
            with open(env[source], encoding="utf-8") as f:
                env = {var: f.read().strip()}
        except OSError as exc:
            parser.error(f"environment variable {source}: {exc}")
        secret = True  # read from a secret file: never shown
    if var in env:
        raw = env[var]
        try:
            default = parse_bool(raw) if type is bool else type(raw)
        except ValueError as exc:
            parser.error(f"environment variable {source}: {exc}" if secret else
                         f"environment variable {var}={raw!r}: {exc}")
    shown = ",".join(default) if isinstance(default, tuple) else default
    if secret and shown:
        shown = "(set, not shown)"
    text = f"{help} [env {var}; default: {'' if shown is None else shown}]".replace("%", "%%")
    if type is bool:
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=default, help=text)
    else:
        parser.add_argument(f"--{flag}", type=type, default=default, help=text,
                            choices=list(choices) if choices is not None else None)


def setting_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings dataclass that are flags (declared with :func:`setting`)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_setting_flags(parser: argparse.ArgumentParser, env: Mapping[str, str], cls: type) -> None:
    """One flag per :func:`setting` field of ``cls``, in declaration order."""
    for f in setting_fields(cls):
        generated = f.default is dataclasses.MISSING
        add_flag(parser, env, f.name.replace("_", "-"), type=_flag_type(f),
                 default="" if generated else f.default,
                 help=f.metadata["help"] + (" (empty: generated)" if generated else ""),
                 choices=f.metadata["choices"], secret=f.metadata.get("secret", False))


def settings_kwargs(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``cls`` from parsed flags (generated fields left empty are omitted)."""
    kwargs = {}
    for f in setting_fields(cls):
        value = getattr(args, f.name)
        if f.default is dataclasses.MISSING and value in ("", None):
            continue
        if f.default is None and value == "":
            value = None  # an empty flag or env var means "not set" for an optional setting
        kwargs[f.name] = value
    return kwargs


# -- the settings every service shares ------------------------------------------------------------------


def redis_url_setting(default: str = "redis://127.0.0.1:6379/0") -> Any:
    return setting(default, help="Redis URL (user, password, database and rediss:// TLS apply with --redis-sentinels "
                                 "too)" + ("" if default else "; empty and no --redis-sentinels: do not register in Redis"))


def key_prefix_setting() -> Any:
    return setting(DEFAULT_PREFIX, help="prefix of every Redis key, so two stacks can share one Redis")


def metrics_port_setting() -> Any:
    """Off by default: several services of a kind share one host in local runs and tests, and
    each would claim the same port; Kubernetes sets 9090 (deploy/k8s settings.env)."""
    return setting(-1, help="port of Prometheus /metrics on --host (0 = any free port, -1 = none)")


def check_port(name: str, port: int, *, allow_off: bool = False) -> None:
    """A port setting in [0, 65536), or -1 (off) where ``allow_off``; raises ValueError naming it."""
    low = -1 if allow_off else 0
    if not low <= port < 65536:
        raise ValueError(f"{name}: must be in [{low}, 65536), got {port}")


def output_ttl_setting() -> Any:
    """One setting for gateways (which set it at admission) and schedulers (which keep it on write)."""
    return setting(600, help="output streams expire this many seconds after their last entry (resume window)")


def drain_grace_setting() -> Any:
    return setting(30.0, help="on SIGTERM, seconds in-flight work may take to finish before the server stops")


def service_parser(prog: str, description: str, env: Mapping[str, str], *settings: type) -> argparse.ArgumentParser:
    """A service's whole command line: the flags of each settings dataclass, then ``--log-level``
    and ``--log-format``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for cls in settings:
        add_setting_flags(parser, env, cls)
    add_flag(parser, env, "log-level", default="INFO", choices=LOG_LEVELS,
             help="log level (prompt text is only ever logged at DEBUG)")
    add_flag(parser, env, "log-format", default="text", choices=LOG_FORMATS,
             help="log lines as plain text or one JSON object per line")
    return parser


def tls_cert_setting(role: str) -> Any:
    return setting("", help=f"PEM certificate {role} presents (with --tls-key-file; empty: no TLS)")


def tls_key_setting() -> Any:
    return setting("", help="PEM private key of --tls-cert-file (mount it read-only)")


def tls_ca_setting(meaning: str) -> Any:
    return setting("", help=f"PEM CA certificate: {meaning}")


def internal_token_setting() -> Any:
    return setting("", secret=True, help="shared secret every internal RPC carries (authorization: Bearer ...), checked by workers "
                            "and schedulers; prefer the env var or a compose secret to the flag (empty: none)")
