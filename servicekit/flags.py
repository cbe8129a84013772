"""Settings → flags: each service's frozen settings dataclass is the one source of every knob.

A field declared with :func:`servicekit.contract.settings.setting` carries its help text and
range; :func:`add_setting_flags` turns
each such field into ``--field-name`` (type, default and choices from the field) that falls back to
the ``PAGEDSERVE_FIELD_NAME`` environment variable, and :func:`settings_kwargs` reads the parsed
values back into the dataclass's keyword arguments. Precedence: command-line flag > environment
variable (or the file ``PAGEDSERVE_FIELD_NAME_FILE`` names: secrets mounted as files) > the field's
default. ``--help`` shows each flag's variable and effective default.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from servicekit.contract.settings import setting_fields

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


def add_setting_flags(parser: argparse.ArgumentParser, env: Mapping[str, str], cls: type) -> None:
    """One flag per :func:`setting` field of ``cls``, in declaration order (a field an earlier class
    of the same parser already added is not added twice)."""
    for f in setting_fields(cls):
        if f"--{f.name.replace('_', '-')}" in parser._option_string_actions:
            continue
        generated = f.default is dataclasses.MISSING
        add_flag(parser, env, f.name.replace("_", "-"), type=_flag_type(f),
                 default="" if generated else f.default,
                 help=f.metadata["help"] + (f.metadata["host_note"]() if f.metadata.get("host_note") else "")
                 + (" (empty: generated)" if generated else ""),
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


def settings_argv(settings: Any, cls: type | None = None) -> list[str]:
    """The flags that give ``settings`` (its :func:`setting` fields of ``cls``, default: all) where
    they differ from their defaults: how a launcher hands its settings on to the services it starts."""
    argv: list[str] = []
    for f in setting_fields(cls or type(settings)):
        value = getattr(settings, f.name)
        if f.default is dataclasses.MISSING or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            continue
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return argv


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
