"""Waiting queues: FCFS and priority."""

from __future__ import annotations

import pytest

from scheduler_service.core import FCFSWaitingQueue, OrderedWaitingQueue, PriorityWaitingQueue, create_waiting_queue
from scheduler_service.core.waiting_queue import MAX_PASSED_OVER

from .helpers import make_request


def test_fcfs_order_prepend_and_removal():
    q = FCFSWaitingQueue()
    a, b, c, d = (make_request(2) for _ in range(4))
    for r in (a, b, c):
        q.add(r)
    q.prepend(d)
    assert list(q) == [d, a, b, c] and q.peek() is d and len(q) == 4
    q.remove(a)
    q.remove_many([c, make_request(2)])
    assert list(q) == [d, b]
    assert q.pop() is d and q.pop() is b and not q
    with pytest.raises(IndexError):
        q.pop()


def test_priority_order_is_priority_then_arrival_then_insertion():
    q = PriorityWaitingQueue()
    late_urgent = make_request(2, priority=0, arrival_time=9.0)
    early_lazy = make_request(2, priority=3, arrival_time=0.0)
    tie_first = make_request(2, priority=1, arrival_time=1.0)
    tie_second = make_request(2, priority=1, arrival_time=1.0)
    for r in (early_lazy, tie_first, late_urgent, tie_second):
        q.add(r)
    assert list(q) == [late_urgent, tie_first, tie_second, early_lazy]
    assert q.peek() is late_urgent
    q.remove(tie_first)
    q.remove_many([early_lazy])
    with pytest.raises(ValueError):
        q.remove(early_lazy)
    q.prepend(early_lazy)  # a preempted request goes back by its key
    assert [q.pop() for _ in range(len(q))] == [late_urgent, tie_second, early_lazy]


def test_ordered_queue_goes_by_cost_then_arrival_and_lets_none_starve():
    q = OrderedWaitingQueue()
    first, second, third, fourth = (make_request(2, arrival_time=float(t)) for t in range(4))
    for r in (first, second, third, fourth):
        q.add(r)
    cost = {id(first): 0, id(second): -5, id(third): 0, id(fourth): -5}
    q.reorder(lambda r: cost[id(r)])
    assert list(q) == [second, fourth, first, third]  # the smallest cost first, then arrival
    assert q.pop() is second and q.pop() is fourth
    for _ in range(MAX_PASSED_OVER):  # later arrivals admitted before first and third ...
        q.passed_over([make_request(2, arrival_time=9.0)])
        q.reorder(lambda r: {id(first): 0, id(third): 0}.get(id(r), -7))
    late = make_request(2, arrival_time=10.0)
    q.add(late)
    cost[id(late)] = -9
    q.reorder(lambda r: cost[id(r)])
    assert list(q) == [first, third, late]  # ... so they go before any cached prefix now
    q.remove(first)
    q.passed_over([third])  # nobody queued arrived before the admitted one: nobody passed over
    assert q.pop() is third and q.pop() is late and not q


@pytest.mark.parametrize("policy", ["lpm", "spf"])
def test_ordered_policies_with_equal_costs_keep_arrival_order(policy):
    q = create_waiting_queue(policy)
    requests = [make_request(2, arrival_time=float(t)) for t in (3, 1, 2)]
    for r in requests:
        q.add(r)
    q.reorder(lambda r: 0)
    assert list(q) == sorted(requests, key=lambda r: r.arrival_time)


def test_unknown_policy():
    assert isinstance(create_waiting_queue("fcfs"), FCFSWaitingQueue)
    with pytest.raises(ValueError):
        create_waiting_queue("lifo")
