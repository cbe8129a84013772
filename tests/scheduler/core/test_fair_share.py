"""Fair shares between tenants (policy "fair", the virtual token counter), told as stories: a
tenant that floods the queue does not hold back another's one request; a tenant that was idle
banks no credit; weights divide the service; with one tenant the order is the priority queue's."""

from __future__ import annotations

import random

import pytest

from .helpers import make_request, make_scheduler, step
from scheduler_service.core.waiting_queue import (
    OUTPUT_TOKEN_WEIGHT,
    FairWaitingQueue,
    PriorityWaitingQueue,
    create_waiting_queue,
)


def request_of(tenant: str, n_tokens: int = 8, **kwargs):
    request = make_request(n_tokens, **kwargs)
    request.tenant = tenant
    return request


def first_token_step(policy: str) -> tuple[int, int]:
    """Tenant A sends 12 requests at once into 2 seats; a step later tenant B sends one. Returns
    (the step B's request first samples in, how many of A's had finished by then)."""
    s = make_scheduler(policy=policy, max_num_seqs=2)
    flood = [request_of("A", 8, max_tokens=6) for _ in range(12)]
    for request in flood:
        s.add_request(request)
    step(s)
    b = request_of("B", 8, max_tokens=6)
    s.add_request(b)
    for k in range(1, 200):
        _, outputs = step(s)
        if b.request_id in outputs:
            return k, sum(r.is_finished for r in flood)
    raise AssertionError("B never got a token")


def test_a_flood_does_not_hold_back_another_tenant_s_one_request():
    fcfs_step, fcfs_done = first_token_step("fcfs")
    fair_step, fair_done = first_token_step("fair")
    print(f"B's first token: fcfs step {fcfs_step} after {fcfs_done} of A's, fair step {fair_step} after {fair_done}")
    assert fcfs_done >= 10  # behind (nearly) the whole flood
    assert fair_done <= 2 and fair_step < fcfs_step / 3  # the next free seat


def test_service_is_shared_equally_between_two_backlogged_tenants():
    s = make_scheduler(policy="fair", max_num_seqs=2)
    requests = [request_of(t, 8, max_tokens=4) for _ in range(10) for t in ("A", "B")]
    requests.sort(key=lambda r: r.tenant)  # all of A's arrive (and queue) before B's
    for request in requests:
        s.add_request(request)
    admitted: list[str] = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        admitted += [s.requests[r.request_id].tenant for r in out.scheduled_new_reqs] if out.scheduled_new_reqs else []
    print("admission order:", "".join(admitted))
    first_ten = admitted[:10]
    assert abs(first_ten.count("A") - first_ten.count("B")) <= 2  # alternating, not A's ten first
    counters = s.waiting.counters
    assert counters["A"] == pytest.approx(counters["B"])  # the same work each, in all


def test_an_idle_tenant_banks_no_credit():
    q = FairWaitingQueue()
    q.charge("A", 0, 1000)  # A was served a lot while B sent nothing
    q.add(request_of("A"))
    b = request_of("B")
    q.add(b)  # B starts at A's counter, not at 0: it cannot then take 1,000 tokens' worth in a row
    assert q.counters["B"] == q.counters["A"] == 1000 * OUTPUT_TOKEN_WEIGHT
    assert q.pop() is not b  # a tie: the earlier arrival first


def test_weights_divide_the_service():
    q = FairWaitingQueue({"gold": 2.0})
    q.charge("gold", 100, 0)
    q.charge("plain", 100, 0)
    assert q.counters == {"gold": 50.0, "plain": 100.0}
    gold, plain = request_of("gold"), request_of("plain")
    q.add(plain)
    q.add(gold)
    assert q.pop() is gold


def test_priority_classes_come_before_shares():
    q = FairWaitingQueue()
    q.charge("A", 1000, 0)
    urgent = request_of("A", priority=-1)
    q.add(request_of("B"))
    q.add(urgent)
    assert q.peek() is urgent and q.pop() is urgent


def test_one_tenant_pops_in_the_priority_queue_s_order():
    rng = random.Random(7)
    fair, priority = create_waiting_queue("fair"), PriorityWaitingQueue()
    requests = [request_of("", priority=rng.randrange(3), arrival_time=rng.random()) for _ in range(50)]
    for request in requests:
        fair.add(request)
        priority.add(request)
    fair.remove_many(requests[:5])
    priority.remove_many(requests[:5])
    assert list(fair) == list(priority)
    assert [fair.pop() for _ in range(len(fair))] == [priority.pop() for _ in range(len(priority))]
    with pytest.raises(IndexError):
        fair.pop()
