"""Waiting queues: first-come-first-served and priority (seed §2.3)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from scheduler_service.core.request import Request


class WaitingQueue(Protocol):
    """What the scheduler needs from a waiting queue."""

    def add(self, request: Request) -> None: ...

    def pop(self) -> Request: ...

    def peek(self) -> Request: ...

    def prepend(self, request: Request) -> None: ...

    def remove(self, request: Request) -> None: ...

    def remove_many(self, requests: Iterable[Request]) -> None: ...

    def __len__(self) -> int: ...

    def __bool__(self) -> bool: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSWaitingQueue:
    """Arrival order; ``prepend`` puts a request back at the front (preemption)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()  # front = next scheduled

    def add(self, request: Request) -> None:
        """Append at the back."""
        self._queue.append(request)

    def pop(self) -> Request:
        """Remove and return the front. Raises IndexError when empty."""
        return self._queue.popleft()

    def peek(self) -> Request:
        """The front, not removed. Raises IndexError when empty."""
        return self._queue[0]

    def prepend(self, request: Request) -> None:
        """Put at the front: it is scheduled next (preempted requests keep their place in line)."""
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        """Remove one request (O(n); aborts only). Raises ValueError when absent."""
        self._queue.remove(request)

    def remove_many(self, requests: Iterable[Request]) -> None:
        """Remove every given request that is queued, in one O(n) pass; others are ignored."""
        doomed = {id(r) for r in requests}
        if doomed:
            self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order."""
        return iter(self._queue)


class PriorityWaitingQueue:
    """Min-heap on (priority, arrival_time, insertion order): lower priority values go first, then
    earlier arrivals; the insertion counter makes ties deterministic. ``prepend`` is ``add``: a
    preempted request's place is its key, which it keeps."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []  # heap-ordered entries
        self._counter = itertools.count()  # tie-breaker: earlier insertion first

    def add(self, request: Request) -> None:
        """Insert by key. O(log n)."""
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def pop(self) -> Request:
        """Remove and return the request with the smallest key. Raises IndexError when empty."""
        return heapq.heappop(self._heap)[3]

    def peek(self) -> Request:
        """The request with the smallest key, not removed. Raises IndexError when empty."""
        return self._heap[0][3]

    def prepend(self, request: Request) -> None:
        """Same as ``add``: order is by key, not by insertion."""
        self.add(request)

    def remove(self, request: Request) -> None:
        """Remove one request (O(n)). Raises ValueError when absent."""
        n = len(self._heap)
        self.remove_many((request,))
        if len(self._heap) == n:
            raise ValueError(f"{request.request_id} is not queued")

    def remove_many(self, requests: Iterable[Request]) -> None:
        """Remove every given request that is queued, in one O(n) pass; others are ignored."""
        doomed = {id(r) for r in requests}
        if doomed:
            self._heap = [e for e in self._heap if id(e[3]) not in doomed]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order (sorts a copy: O(n log n), for inspection only)."""
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_waiting_queue(policy: str) -> FCFSWaitingQueue | PriorityWaitingQueue:
    """The queue for a scheduling policy ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSWaitingQueue()
    if policy == "priority":
        return PriorityWaitingQueue()
    raise ValueError(f"unknown policy {policy!r}")
