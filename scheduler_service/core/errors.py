"""Typed errors of the scheduler core. Each names the field it is about, so the gateway can map it
to INVALID_ARGUMENT with that field's name (DESIGN.md decision 8)."""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A user-supplied value is out of range or of the wrong kind.

    ``field`` is the public name of the offending field (``temperature``, ``max_tokens``, ...).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
