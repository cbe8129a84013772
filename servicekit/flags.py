"""Flags that fall back to ``PAGEDSERVE_*`` environment variables (STYLE.md habit 4).

Each service's ``main()`` builds an ``argparse`` parser with :func:`add_flag`, parses
``argv`` against the environment it was handed, and turns the result into its frozen settings
dataclass. Precedence: command-line flag > environment variable > built-in default. ``--help``
shows each flag's variable and effective default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

ENV_PREFIX = "PAGEDSERVE_"


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


def add_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], flag: str, *,
             type: Callable[[str], Any] = str, default: Any = None, help: str,
             choices: list[str] | None = None) -> None:
    """Add ``--flag`` whose default comes from ``PAGEDSERVE_FLAG`` when that is set in ``env``."""
    var = env_var(flag)
    if var in env:
        raw = env[var]
        try:
            default = parse_bool(raw) if type is bool else type(raw)
        except ValueError as exc:
            parser.error(f"environment variable {var}={raw!r}: {exc}")
    text = f"{help} [env {var}; default: %(default)s]"
    if type is bool:
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=default, help=text)
    else:
        parser.add_argument(f"--{flag}", type=type, default=default, help=text, choices=choices)


def add_common_flags(parser: argparse.ArgumentParser, env: Mapping[str, str], *,
                     redis_required: bool = True) -> None:
    """Flags every service shares: logging, Redis and drain grace."""
    add_flag(parser, env, "log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
             help="log level (prompt text is only ever logged at DEBUG)")
    add_flag(parser, env, "redis-url", default="redis://127.0.0.1:6379/0" if redis_required else "",
             help="Redis URL" + ("" if redis_required else " (empty: do not register in Redis)"))
    add_flag(parser, env, "key-prefix", default="ps:",
             help="prefix of every Redis key, so two stacks can share one Redis")
    add_flag(parser, env, "drain-grace-s", type=float, default=30.0,
             help="on SIGTERM, seconds in-flight work may take to finish before the server stops")
