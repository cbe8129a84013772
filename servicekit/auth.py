"""API keys and shared tokens: who may call a service (free of gRPC and HTTP, so both front
doors use the same :class:`KeyStore`).

A key is checked as the value of an ``Authorization`` header (``Bearer <key>``; gRPC metadata
``authorization``). Keys are held only as SHA-256 digests: the plain key never stays in memory
past the check and is never logged, and a key file may list digests (``sha256:<hex>``) so the
plain keys need not sit on the server's disk at all. Every check compares the presented key's
digest with every configured digest through :func:`hmac.compare_digest` (no early exit), so the
time a check takes says nothing about how close a guess was.

Key file format: one key per line; blank lines and lines starting with ``#`` are skipped; a line
``sha256:<64 hex digits>`` is a key's digest. After the key, separated by whitespace, a line may
name the key's tenant and its weight in fair shares: ``KEY tenant=team-a weight=2`` (the
scheduler's ``--policy fair``; without a name the tenant is the key's digest, without a weight 1).
A key itself therefore holds no whitespace. A key file is re-read when its modification time
changes (checked at most once a second), so keys are revoked or added without a restart.

Invariants: ``KeyStore.enabled`` is False only when no key is configured at all (the service is
then open); a store built from a file that cannot be read or holds no key raises ``ValueError``
at start-up rather than silently opening the service.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from servicekit.contract.errors import ResourceExhaustedError, UnauthenticatedError

log = logging.getLogger(__name__)

DIGEST_PREFIX = "sha256:"
RELOAD_CHECK_S = 1.0
BEARER = "bearer "


def key_digest(key: str) -> str:
    """The hex SHA-256 digest a key is stored and compared as."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One configured key: its digest, and the tenant it serves (``""``: the digest) with its weight."""

    digest: str
    tenant: str = ""
    weight: float = 1.0


# A weight is a relative share: 1,000,000 to 1 between two tenants is already all or nothing, and a
# weight near zero would blow a tenant's virtual-token counter (service / weight) up to infinity.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3


def _parse_entry(line: str) -> KeyEntry | None:
    """A key file line (or an env var item); None for blanks and comments. Raises ValueError
    naming what is wrong (never the key)."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    key, *options = text.split()
    if key.lower().startswith(DIGEST_PREFIX):
        hexdigest = key[len(DIGEST_PREFIX):].lower()
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise ValueError("a 'sha256:' key entry must be followed by 64 hex digits")
    else:
        hexdigest = key_digest(key)
    fields = {"tenant": "", "weight": "1"}
    given: set[str] = set()
    for k, option in enumerate(options, 2):
        name, sep, value = option.partition("=")
        if not sep or name not in fields or not value:  # the text is not shown: it may be part of a key
            raise ValueError(f"field {k} is not tenant=NAME or weight=NUMBER (a key holds no whitespace)")
        if name in given:
            raise ValueError(f"field {k} gives {name} a second time")
        given.add(name)
        fields[name] = value
    try:
        weight = float(fields["weight"])
    except ValueError:
        weight = math.nan
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NaN fails too
        raise ValueError(f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}, got {fields['weight']!r}")
    return KeyEntry(hexdigest, fields["tenant"], weight)


def entries_of(lines: Iterable[str]) -> dict[str, KeyEntry]:
    """Configured keys by digest (a later line for the same key wins). Raises ValueError naming
    the line at fault."""
    entries: dict[str, KeyEntry] = {}
    for number, line in enumerate(lines, 1):
        try:
            entry = _parse_entry(line)
        except ValueError as exc:
            raise ValueError(f"entry {number}: {exc}") from None
        if entry is not None:
            entries[entry.digest] = entry
    return entries


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (case-insensitive scheme)."""
    if not authorization:
        return None
    text = authorization.strip()
    if text[:len(BEARER)].lower() != BEARER:
        return None
    token = text[len(BEARER):].strip()
    return token or None


AUTHORIZATION = "authorization"  # the gRPC metadata key (and HTTP header) that carries a key


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``key`` (none without a key): what a client sends."""
    return ((AUTHORIZATION, f"Bearer {key}"),) if key else ()


class KeyStore:
    """The keys a service accepts: ``keys`` given directly (an env var's list) plus those of
    ``keys_file``. Thread-safe; :meth:`check` is cheap (one SHA-256, one compare per key)."""

    def __init__(self, keys: Iterable[str] = (), keys_file: str = "", *, what: str = "API key") -> None:
        self._what = what
        self._fixed_entries = entries_of(keys)
        self._fixed = frozenset(self._fixed_entries)
        self._file = keys_file
        self._file_mtime: float | None = None
        self._file_entries: dict[str, KeyEntry] = {}
        self._file_digests: frozenset[str] = frozenset()
        self._next_check = 0.0
        self._lock = threading.Lock()
        if keys_file:
            self._load_file()  # raises at start-up: an unreadable key file must not open the service
            if not self._file_digests and not self._fixed:
                raise ValueError(f"{keys_file}: holds no key")

    @classmethod
    def for_secret(cls, secret: str, what: str = "internal token") -> KeyStore:
        """A store admitting exactly ``secret`` (taken literally, even if it looks like a digest);
        empty: an open store."""
        store = cls(what=what)
        store._fixed_entries = {key_digest(secret): KeyEntry(key_digest(secret))} if secret else {}
        store._fixed = frozenset(store._fixed_entries)
        return store

    @property
    def enabled(self) -> bool:
        return bool(self._fixed or self._file)

    def __len__(self) -> int:
        return len(self._digests())

    def _load_file(self) -> None:
        mtime = os.stat(self._file).st_mtime_ns
        with open(self._file, encoding="utf-8") as f:
            entries = entries_of(f)
        self._file_entries, self._file_digests, self._file_mtime = entries, frozenset(entries), mtime

    def _digests(self) -> frozenset[str]:
        if self._file:
            now = time.monotonic()
            if now >= self._next_check:
                with self._lock:
                    self._next_check = now + RELOAD_CHECK_S
                    self._maybe_reload()
        return self._fixed | self._file_digests

    def _maybe_reload(self) -> None:
        try:
            if os.stat(self._file).st_mtime_ns == self._file_mtime:
                return
            self._load_file()
        except (OSError, ValueError) as exc:  # keep the keys we have: a half-written file is no reason to open up
            log.warning("%s file %s not reloaded: %s", self._what, self._file, exc)
            return
        log.info("%s file %s reloaded: %d keys", self._what, self._file, len(self._file_digests))

    def tenant(self, digest: str) -> tuple[str, float]:
        """The tenant a key serves and its weight: the key's ``tenant=`` name (else its digest)
        and ``weight=`` (else 1); ``("", 1.0)`` for ``""`` (no keys configured)."""
        if not digest:
            return "", 1.0
        self._digests()  # the file as it is now
        entry = self._file_entries.get(digest) or self._fixed_entries.get(digest) or KeyEntry(digest)
        return entry.tenant or entry.digest, entry.weight

    def check(self, authorization: str | None) -> str:
        """The digest of the key in ``authorization`` (an ``Authorization`` header value), or
        UnauthenticatedError when it is missing or not one of ours. With no keys configured every
        call passes and the digest is ``""``."""
        if not self.enabled:
            return ""
        token = bearer_token(authorization)
        if token is None:
            raise UnauthenticatedError(f"missing {self._what}: send 'authorization: Bearer <key>'")
        presented = key_digest(token)
        found = False
        for digest in self._digests():  # every one compared: no early exit
            found |= hmac.compare_digest(presented, digest)
        if not found:
            raise UnauthenticatedError(f"invalid {self._what}")
        return presented


class ConcurrencyLimits:
    """At most ``limit`` requests in flight per key digest (0: no limit), in this process: a
    gateway replica enforces its own share, not a cluster-wide count."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: dict[str, int] = {}

    def acquire(self, digest: str) -> None:
        if not self.limit:
            return
        n = self._in_flight.get(digest, 0)
        if n >= self.limit:
            raise ResourceExhaustedError(f"this API key has {n} requests in flight (limit {self.limit}); "
                                         "retry when one finishes")
        self._in_flight[digest] = n + 1

    def release(self, digest: str) -> None:
        if not self.limit:
            return
        n = self._in_flight.get(digest, 0) - 1
        if n > 0:
            self._in_flight[digest] = n
        else:
            self._in_flight.pop(digest, None)


class TokenRateLimits:
    """At most ``per_minute`` tokens (prompt plus generated) per key digest in any 60 s window, in
    this process (0: no limit). A request is refused at admission once its key's window is full;
    one admitted below the limit runs to its end (its tokens count against the next requests), so
    a key may overshoot by at most one request's tokens per gateway."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._spent: dict[str, deque[tuple[float, int]]] = {}
        self._totals: dict[str, int] = {}

    def _expire(self, digest: str, now: float) -> int:
        spent = self._spent.get(digest)
        if not spent:
            return 0
        total = self._totals[digest]
        while spent and spent[0][0] <= now - self.WINDOW_S:
            total -= spent.popleft()[1]
        if not spent:
            del self._spent[digest], self._totals[digest]
            return 0
        self._totals[digest] = total
        return total

    def check(self, digest: str) -> None:
        if not self.per_minute:
            return
        used = self._expire(digest, self._clock())
        if used >= self.per_minute:
            raise ResourceExhaustedError(f"this API key used {used} tokens in the last minute (limit "
                                         f"{self.per_minute}); retry later")

    def charge(self, digest: str, tokens: int) -> None:
        if not self.per_minute or tokens <= 0:
            return
        now = self._clock()
        self._expire(digest, now)
        self._spent.setdefault(digest, deque()).append((now, tokens))
        self._totals[digest] = self._totals.get(digest, 0) + tokens
