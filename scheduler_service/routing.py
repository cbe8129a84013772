"""KV-aware placement of a request on one of a scheduler's workers (docs/architecture.md, decision 4).

Each worker has its own block pool, so a prefix cached on one worker is a hit only there. A new
(or resumed) request goes to the worker whose prefix cache holds the longest prefix of it, ties
broken by the lightest load. To keep a hot prefix from piling every request onto one worker
while others idle, only workers with a free batch seat (load below ``max_num_seqs``) compete on
the hit; when every worker's batch is full, all of them do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler


class Placeable(Protocol):
    """What routing needs of a WorkerEngine."""

    core: Scheduler

    @property
    def load(self) -> int: ...

    def fits(self, request: Request) -> bool: ...


def choose_engine(request: Request, engines: Sequence[Placeable]) -> tuple[Placeable, int]:
    """The engine to place ``request`` on and its prefix-cache hit there (tokens). ``engines``
    must be non-empty. May start block hashing on ``request`` (when all candidates share one block
    size), which the chosen core would do anyway."""
    fitting = [e for e in engines if e.fits(request)] or list(engines)
    seated = [e for e in fitting if e.load < e.core.config.max_num_seqs] or fitting
    caching = [e for e in seated if e.core.config.enable_prefix_caching]
    if not caching:
        return min(seated, key=lambda e: e.load), 0
    block_sizes = {e.core.block_size for e in caching}
    if len(block_sizes) == 1 and not request.hashing_block_size:
        request.enable_block_hashing(block_sizes.pop())  # hash once, not once per worker
    best, best_key = seated[0], None
    for engine in seated:
        hit = engine.core.count_prefix_hit_tokens(request)
        key = (hit, -engine.load)
        if best_key is None or key > best_key:
            best, best_key = engine, key
    return best, best_key[0]
