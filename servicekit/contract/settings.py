"""Settings fields: each knob is declared once, as a dataclass field made by :func:`setting`.

A field carries its help text and its range (``minimum``, ``maximum``, ``above``, ``choices``);
:func:`check_settings` enforces the ranges in ``__post_init__`` and raises
:class:`~servicekit.contract.errors.InvalidArgumentError` naming the field, the one error type for a
bad setting. The plumbing derives the rest from the same declaration: flags, ``PAGEDSERVE_*``
environment variables and ``--help`` (``servicekit.flags``), and ``docs/configuration.md``
(``pagedserve.config_doc``).

Settings dataclasses are built from per-concern dataclasses (scheduling, the model runner, Redis,
TLS, the server): a service's settings class inherits the concerns it has, so a knob shared by two
services is one field of one class. Pure standard library: the scheduler core builds on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

from servicekit.contract.errors import InvalidArgumentError


def setting(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
            choices: Any = None, type: Callable[[str], Any] | None = None, secret: bool = False,
            minimum: float | None = None, maximum: float | None = None, above: float | None = None,
            host_note: Callable[[], str] | None = None) -> Any:
    """A settings field. ``help`` documents it (``--help`` and docs/configuration.md); ``minimum`` /
    ``maximum`` bound it inclusively, ``above`` exclusively, ``choices`` lists its values (checked by
    :func:`check_settings`; ``None`` is always allowed for a field whose default is ``None``).
    ``type`` parses its flag's text (default: from the default's type); a field with a
    ``default_factory`` (a generated id) takes the factory's value when its flag is left empty. A
    ``secret`` (keys, tokens) never shows its value. ``host_note()`` is appended to ``--help`` on the
    machine it runs on (what a default picks there), not to the generated docs."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "type": type,
                "secret": secret, "minimum": minimum, "maximum": maximum, "above": above, "host_note": host_note}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def setting_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings dataclass declared with :func:`setting`, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def declared_in(cls: type) -> Iterator[dataclasses.Field]:
    """The :func:`setting` fields ``cls`` itself declares (not those it inherits)."""
    own = cls.__dict__.get("__annotations__", {})
    return (f for f in setting_fields(cls) if f.name in own)


def check_settings(obj: Any) -> None:
    """Check every :func:`setting` field of ``obj`` against its declaration: type, choices, range.
    Raises :class:`InvalidArgumentError` naming the first bad field."""
    for f in setting_fields(type(obj)):
        value = getattr(obj, f.name)
        if value is None and f.default is None:
            continue
        kind = _kind(f)
        if kind is bool and not isinstance(value, bool):
            raise InvalidArgumentError(f.name, f"must be true or false, got {value!r}")
        if kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    kind is int and not isinstance(value, int)):
                raise InvalidArgumentError(f.name, f"must be {'an integer' if kind is int else 'a number'}, "
                                                   f"got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgumentError(f.name, f"must be finite, got {value!r}")
            meta = f.metadata
            if meta["minimum"] is not None and value < meta["minimum"]:
                raise InvalidArgumentError(f.name, f"must be >= {meta['minimum']}, got {value!r}")
            if meta["maximum"] is not None and value > meta["maximum"]:
                raise InvalidArgumentError(f.name, f"must be <= {meta['maximum']}, got {value!r}")
            if meta["above"] is not None and value <= meta["above"]:
                raise InvalidArgumentError(f.name, f"must be > {meta['above']}, got {value!r}")
        choices = f.metadata["choices"]
        if choices is not None and value not in choices:
            raise InvalidArgumentError(f.name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")


def _kind(f: dataclasses.Field) -> type | None:
    """The checked type of a field: from its default's type (bool, int, float), or for an optional
    field (default ``None``) from its flag's ``type``; anything else is unchecked."""
    default = f.default
    if default is None and f.metadata["type"] in (int, float):
        return f.metadata["type"]
    if isinstance(default, bool):
        return bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    return None


def project(settings: Any, cls: type) -> Any:
    """The ``cls`` part of a settings object that inherits ``cls`` (a service's settings -> its
    scheduling settings), as a plain ``cls``."""
    return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls) if f.init})
