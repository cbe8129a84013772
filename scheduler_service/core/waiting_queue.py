"""Waiting queues: first-come-first-served and priority (seed §2.3), fair shares between tenants
(the virtual token counter of Sheng et al., "Fairness in Serving Large Language Models", OSDI
2024), and orders by what a request costs to admit: the longest cached prefix first (SGLang's "lpm"
policy) or the fewest prompt tokens left to compute (shortest prompt first, "spf")."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from scheduler_service.core.request import Request, RequestStatus


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


PROMPT_TOKEN_WEIGHT = 1.0  # VTC's service weights: a prompt token computed ...
OUTPUT_TOKEN_WEIGHT = 2.0  # ... and an output token (a decode step costs more per token than a prefill)
MAX_IDLE_TENANTS = 1024  # counters kept for tenants with nothing queued (the most served ones)


class FairWaitingQueue:
    """Weighted fair shares of service between tenants (``Request.tenant``): the virtual token
    counter (VTC). Each tenant's counter grows by the service its requests got — prompt tokens
    computed × :data:`PROMPT_TOKEN_WEIGHT` + output tokens × :data:`OUTPUT_TOKEN_WEIGHT`, divided
    by its weight (:meth:`charge`, called by the scheduler as steps complete) — and the next
    request is the head of the tenant with the smallest counter, within the best priority class:
    the key of a tenant's head is (priority, counter, arrival time). A tenant that had nothing
    queued starts at least at the smallest counter of those queued, so idling banks no credit;
    on equal counters the tenant that became active last goes first (it was lifted to the
    floor, which the others reached by being served).
    Within a tenant: (priority, arrival) order, as :class:`PriorityWaitingQueue`. With one tenant
    the order is :class:`PriorityWaitingQueue`'s.

    A tenant's weight is the one its latest queued request carries (``Request.tenant_weight``,
    from the gateway's keys file), else ``weights``' entry, else 1. State is bounded: a tenant
    with nothing queued keeps its counter only while it is above the floor (below, it would be
    lifted to the floor on its return anyway), and at most :data:`MAX_IDLE_TENANTS` of those (the
    most served) are kept."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self._heaps: dict[str, list[tuple[int, float, int, Request]]] = {}  # tenants with requests queued
        self._activated: dict[str, int] = {}  # tenant -> when its heap was created (a tie-breaker)
        self.counters: dict[str, float] = {}  # service per tenant over its weight
        self._defaults = dict(weights or {})  # weights not carried by requests
        self._weights: dict[str, float] = {}  # weights carried by the tenants' latest requests
        self._counter = itertools.count()
        self._len = 0

    def weight(self, tenant: str) -> float:
        """The tenant's weight in the shares (1 unless given)."""
        return self._weights.get(tenant) or self._defaults.get(tenant, 1.0)

    def tenants(self) -> Iterable[str]:
        """The tenants with requests queued."""
        return self._heaps.keys()

    def charge(self, tenant: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Count service ``tenant`` received (tokens computed for its requests)."""
        service = num_prompt_tokens * PROMPT_TOKEN_WEIGHT + num_output_tokens * OUTPUT_TOKEN_WEIGHT
        self.counters[tenant] = self.counters.get(tenant, 0.0) + service / self.weight(tenant)

    def _floor(self, without: str | None = None) -> float:
        """The smallest counter of the tenants with requests queued (``without`` left out); 0 if none."""
        queued = [self.counters.get(t, 0.0) for t in self._heaps if t != without]
        return min(queued) if queued else 0.0

    def _push(self, request: Request) -> None:
        tenant = request.tenant
        if request.tenant_weight > 0:
            self._weights[tenant] = request.tenant_weight
        heap = self._heaps.get(tenant)
        if heap is None:  # (re)activated: no credit for the time it had nothing queued
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self._floor())
            heap = self._heaps[tenant] = []
            self._activated[tenant] = next(self._counter)
        heapq.heappush(heap, (request.priority, request.arrival_time, next(self._counter), request))
        self._len += 1

    def _deactivated(self, tenant: str) -> None:
        """``tenant``'s last queued request left: forget what it needs no more."""
        del self._heaps[tenant], self._activated[tenant]
        if len(self.counters) > len(self._heaps) + 2 * MAX_IDLE_TENANTS:
            self._forget_idle()

    def _forget_idle(self) -> None:
        """Drop the counters and weights of tenants with nothing queued that are at or below the
        floor, then all but the :data:`MAX_IDLE_TENANTS` largest. A tenant with requests running
        is charged again as its steps complete; it comes back at the floor or above."""
        floor = self._floor()
        idle = sorted(((c, t) for t, c in self.counters.items() if t not in self._heaps and c > floor),
                      reverse=True)[:MAX_IDLE_TENANTS]
        kept = {t for _, t in idle} | self._heaps.keys()
        self.counters = {t: c for t, c in self.counters.items() if t in kept}
        self._weights = {t: w for t, w in self._weights.items() if t in kept}

    def _head_tenant(self) -> str:
        best, best_key = None, None
        for tenant, heap in self._heaps.items():
            head = heap[0]
            key = (head[0], self.counters.get(tenant, 0.0), -self._activated[tenant], head[1], head[2])
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        if best is None:
            raise IndexError("the waiting queue is empty")
        return best

    def add(self, request: Request) -> None:
        self._push(request)

    def pop(self) -> Request:
        """The head of the tenant with the smallest counter (best priority first). Raises IndexError when empty."""
        tenant = self._head_tenant()
        heap = self._heaps[tenant]
        request = heapq.heappop(heap)[3]
        self._len -= 1
        if not heap:
            self._deactivated(tenant)
        return request

    def peek(self) -> Request:
        return self._heaps[self._head_tenant()][0][3]

    def prepend(self, request: Request) -> None:
        """Same as ``add``: a preempted request keeps its key within its tenant."""
        self._push(request)

    def remove(self, request: Request) -> None:
        n = self._len
        self.remove_many((request,))
        if self._len == n:
            raise ValueError(f"{request.request_id} is not queued")

    def remove_many(self, requests: Iterable[Request]) -> None:
        doomed = {id(r) for r in requests}
        if not doomed:
            return
        emptied = []
        for tenant, heap in self._heaps.items():
            kept = [e for e in heap if id(e[3]) not in doomed]
            if len(kept) != len(heap):
                self._len -= len(heap) - len(kept)
                heapq.heapify(kept)
                self._heaps[tenant] = kept
                if not kept:
                    emptied.append(tenant)
        for tenant in emptied:
            self._deactivated(tenant)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """In the order pops would give with the counters as they are now (inspection only)."""
        entries = [(e[0], self.counters.get(t, 0.0), -self._activated[t], e[1], e[2], e[3])
                   for t, h in self._heaps.items() for e in h]
        return (e[5] for e in sorted(entries, key=lambda e: e[:5]))


ORDER_WINDOW = 128  # requests at the front that the lpm and spf policies order; those behind wait in arrival order
ORDERED_POLICIES = ("lpm", "spf")  # the policies that reorder the queue's front before admissions
MAX_PASSED_OVER = 4  # steps a request may see later arrivals admitted before it goes first


class OrderedWaitingQueue(FCFSWaitingQueue):
    """Admission by cost, for the policies that order by what a request costs to admit: lpm (the
    longest cached prefix first, SGLang's policy: a request whose prompt the prefix cache mostly
    holds is cheap to admit, and in a burst of prompts sharing a prefix the ones that find it cached
    get their first tokens while the rest still prefill) and spf (the fewest prompt tokens left to
    compute first: in a burst of prompts of mixed lengths, more requests get their first tokens from
    each step, so the median time to first token falls while the last one's stays). Before each
    step's admissions the scheduler calls :meth:`reorder` with the policy's cost: the first
    :data:`ORDER_WINDOW` requests go by cost (smallest first), then arrival. Before them, in arrival
    order: a request that saw later arrivals admitted before it in :data:`MAX_PASSED_OVER` steps
    (:meth:`passed_over`), so none starves, and one that has produced tokens already (preempted, or
    resumed after a fault), so a stream once started is not held up by newcomers and a preempted
    request gets its blocks back before new prompts take them. With equal costs the order is
    arrival order."""

    def __init__(self) -> None:
        super().__init__()
        self._passed: dict[int, int] = {}  # id(request) -> steps it was passed over (while queued)

    def reorder(self, cost: Callable[[Request], int]) -> None:
        """Order the front of the queue by ``cost(request)`` (smallest first), then arrival."""
        queue, passed = self._queue, self._passed
        window = [queue.popleft() for _ in range(min(len(queue), ORDER_WINDOW))]
        window.sort(key=lambda r: (1, cost(r), r.arrival_time) if passed.get(id(r), 0) < MAX_PASSED_OVER
                    and not r.num_output_tokens and r.status != RequestStatus.PREEMPTED else (0, 0, r.arrival_time))
        queue.extendleft(reversed(window))

    def passed_over(self, admitted: Iterable[Request]) -> None:
        """After a step's admissions: each request still queued in the window that arrived before
        one of ``admitted`` was passed over once more."""
        latest = max((r.arrival_time for r in admitted), default=None)
        if latest is None:
            return
        for k, request in enumerate(self._queue):
            if k >= ORDER_WINDOW:
                break
            if request.arrival_time < latest:
                self._passed[id(request)] = self._passed.get(id(request), 0) + 1

    def pop(self) -> Request:
        request = super().pop()
        self._passed.pop(id(request), None)
        return request

    def remove(self, request: Request) -> None:
        super().remove(request)
        self._passed.pop(id(request), None)

    def remove_many(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        super().remove_many(requests)
        for request in requests:
            self._passed.pop(id(request), None)


def create_waiting_queue(policy: str, weights: dict[str, float] | None = None):
    """The queue for a scheduling policy ("fcfs", "priority", "fair", with tenants' ``weights``,
    "lpm" or "spf")."""
    if policy == "fcfs":
        return FCFSWaitingQueue()
    if policy in ORDERED_POLICIES:
        return OrderedWaitingQueue()
    if policy == "priority":
        return PriorityWaitingQueue()
    if policy == "fair":
        return FairWaitingQueue(weights)
    raise ValueError(f"unknown policy {policy!r}")
