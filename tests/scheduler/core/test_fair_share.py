"""Fair shares between tenants (policy "fair", the virtual token counter), told as stories: a
tenant that floods the queue does not hold back another's one request, not even for a free seat;
a tenant that was idle banks no credit; weights divide the service and the seats; with one tenant
the order is the priority queue's and nothing is preempted for a seat; the queue forgets idle
tenants."""

from __future__ import annotations

import random

import pytest

from scheduler_service.core import ModelRunnerOutput, Request, Scheduler
from scheduler_service.core.waiting_queue import (
    MAX_IDLE_TENANTS,
    OUTPUT_TOKEN_WEIGHT,
    FairWaitingQueue,
    PriorityWaitingQueue,
    create_waiting_queue,
)

from .helpers import FakeWorker, make_request, make_scheduler, step


def request_of(tenant: str, n_tokens: int = 8, **kwargs):
    request = make_request(n_tokens, **kwargs)
    request.tenant = tenant
    return request


def first_token_step(policy: str) -> tuple[int, int]:
    """Tenant A sends 12 requests at once into 2 seats; a step later tenant B sends one. Returns
    (the step B's request first samples in, how many of A's had finished by then)."""
    s = make_scheduler(policy=policy, max_num_seqs=2)
    flood = [request_of("A", 8, max_tokens=6) for _ in range(12)]
    return step_of_first_token(s, flood, request_of("B", 8, max_tokens=6)), sum(r.is_finished for r in flood)


def step_of_first_token(s: Scheduler, flood: list[Request], late: Request, max_steps: int = 200) -> int:
    """Adds the flood, runs one step, adds the late request and steps until it samples its first
    token: returns how many steps that took."""
    for request in flood:
        s.add_request(request)
    step(s)
    s.add_request(late)
    for k in range(1, max_steps):
        _, outputs = step(s)
        if late.request_id in outputs:
            return k
    raise AssertionError(f"{late.request_id} never got a token")


def test_a_flood_does_not_hold_back_another_tenant_s_one_request():
    fcfs_step, fcfs_done = first_token_step("fcfs")
    fair_step, fair_done = first_token_step("fair")
    print(f"B's first token: fcfs step {fcfs_step} after {fcfs_done} of A's, fair step {fair_step} after {fair_done}")
    assert fcfs_done >= 10  # behind (nearly) the whole flood
    assert fair_done == 0 and fair_step == 1  # a seat taken from A at once: the very next step


def test_service_is_shared_equally_between_two_backlogged_tenants():
    s = make_scheduler(policy="fair", max_num_seqs=2)
    requests = [request_of(t, 8, max_tokens=4) for _ in range(10) for t in ("A", "B")]
    requests.sort(key=lambda r: r.tenant)  # all of A's arrive (and queue) before B's
    for request in requests:
        s.add_request(request)
    tenant_of = {r.request_id: r.tenant for r in requests}
    admitted: list[str] = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        admitted += [tenant_of[r.request_id] for r in out.scheduled_new_reqs]
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
    assert q.pop() is b  # a tie: A reached it by being served, B by being lifted, so B first


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


def token_fn(request_id: str, index: int) -> int:
    return 10 + (hash((request_id, index)) % 1000)


def seated(s) -> dict[str, int]:
    seats: dict[str, int] = {}
    for request in s.running:
        seats[request.tenant] = seats.get(request.tenant, 0) + 1
    return seats


def test_a_seat_is_taken_from_the_flooding_tenant_and_its_tokens_are_kept():
    """A holds all 4 seats; B's request arrives: the next step preempts A's newest request and
    admits B. A's preempted request resumes from prompt + outputs: every token it delivered stays
    delivered, in order, and the rest are the model's."""
    s = make_scheduler(policy="fair", max_num_seqs=4)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, token_fn)
    flood = [request_of("A", 8, max_tokens=10) for _ in range(6)]
    for request in flood:
        s.add_request(request)
    delivered: dict[str, list[int]] = {}

    def run_step():
        out = s.schedule()
        for o in s.update_from_output(out, worker.execute(out)):
            got = delivered.setdefault(o.request_id, [])
            assert o.first_index == len(got)
            got.extend(o.new_token_ids)
        return out

    for _ in range(3):
        run_step()
    assert seated(s) == {"A": 4}
    newest = s.running[-1]
    b = request_of("B", 8, max_tokens=4)
    s.add_request(b)
    out = run_step()
    assert out.preempted_req_ids == {newest.request_id}
    assert [r.request_id for r in out.scheduled_new_reqs] == [b.request_id]
    assert seated(s) == {"A": 3, "B": 1} and delivered[b.request_id]
    assert newest.num_preemptions == 1 and len(delivered[newest.request_id]) == 3  # kept, not taken back
    while s.has_unfinished_requests():
        run_step()
    for request in flood + [b]:
        rid = request.request_id
        assert delivered[rid] == [token_fn(rid, i) for i in range(request.max_tokens)]
    assert s.num_preemptions == 1  # one seat, once: B, within its share, is never preempted back


def test_one_tenant_is_never_preempted_for_a_seat():
    s = make_scheduler(policy="fair", max_num_seqs=3)
    for _ in range(10):
        s.add_request(request_of("A", 8, max_tokens=6))
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert not out.preempted_req_ids
    assert s.num_preemptions == 0


def test_weights_divide_the_seats():
    """gold (weight 3) and plain (weight 1), both backlogged in 4 seats: plain's newcomer takes
    a seat from gold only while gold holds more than its 3."""
    s = make_scheduler(policy="fair", max_num_seqs=4)
    for _ in range(8):
        request = request_of("gold", 8, max_tokens=20)
        request.tenant_weight = 3.0
        s.add_request(request)
    step(s)
    assert seated(s) == {"gold": 4}
    for _ in range(4):
        s.add_request(request_of("plain", 8, max_tokens=20))
    for _ in range(3):
        step(s)
        assert seated(s) == {"gold": 3, "plain": 1}
    assert s.num_preemptions == 1


def test_no_seat_is_taken_from_a_better_priority_class():
    s = make_scheduler(policy="fair", max_num_seqs=2)
    for _ in range(2):
        s.add_request(request_of("A", 8, max_tokens=20, priority=0))
    step(s)
    s.add_request(request_of("B", 8, max_tokens=4, priority=1))  # a worse class than A's running ones
    for _ in range(3):
        out, _ = step(s)
        assert not out.preempted_req_ids
    assert seated(s) == {"A": 2}


def test_no_continuation_is_planned_while_a_seat_is_due():
    """Asynchronous scheduling: the step after one in flight is not planned ahead while a waiting
    request of a tenant below its share could take a seat (schedule() gives it one)."""
    s = make_scheduler(policy="fair", max_num_seqs=2)
    for _ in range(2):
        s.add_request(request_of("A", 8, max_tokens=20))
    out, _ = step(s)
    out = s.schedule()
    assert s.schedule_continuation(out) is not None  # A alone: decodes are planned ahead
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={rid: [100] for rid in out.num_scheduled_tokens}))
    out = s.schedule()
    s.add_request(request_of("B", 8, max_tokens=4))
    assert s.schedule_continuation(out) is None


def test_the_queue_forgets_idle_tenants():
    """Every request from its own tenant (an HTTP ``user`` field is the client's to choose): the
    queue keeps heaps only for tenants with requests queued and a bounded number of counters."""
    q = FairWaitingQueue()
    for k in range(3 * MAX_IDLE_TENANTS):
        q.add(request_of(f"user-{k}"))
        q.charge(f"user-{k}", 10, k % 7)
        q.pop()
    assert len(q) == 0 and not list(q.tenants())
    assert len(q.counters) <= 2 * MAX_IDLE_TENANTS + 1


def test_tokens_per_tenant_are_counted_at_the_finish_for_metrics():
    s = make_scheduler(max_num_seqs=4)
    a, b, c = request_of("A", 8, max_tokens=3), request_of("B", 12, max_tokens=2), request_of("A", 5, max_tokens=9)
    for request in (a, b, c):
        s.add_request(request)
    while a.request_id in s.requests or b.request_id in s.requests:
        step(s)
    assert s.take_tenant_usage() == {"A": [8, 3], "B": [12, 2]}
    s.abort([c.request_id])
    assert s.take_tenant_usage() == {"A": [5, c.num_output_tokens]}
    assert s.take_tenant_usage() == {}


def first_token_behind_long_prompts(policy: str) -> int:
    """A sends four 200-token prompts into a 64-token budget (chunked: each takes steps); a step
    later B sends a short one, with seats free. Returns the step B first samples in."""
    s = make_scheduler(policy=policy, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=401,
                       long_prefill_token_threshold=0)
    return step_of_first_token(s, [request_of("A", 200, max_tokens=4) for _ in range(4)],
                               request_of("B", 8, max_tokens=4), max_steps=100)


def test_a_flood_s_prompts_do_not_take_the_budget_another_tenant_s_first_chunk_needs():
    fcfs, fair = first_token_behind_long_prompts("fcfs"), first_token_behind_long_prompts("fair")
    print(f"B's first token: fcfs step {fcfs}, fair step {fair}")
    assert fair == 1 < fcfs


@pytest.mark.parametrize("tenant", ["", "solo"])
def test_with_one_tenant_fair_plans_every_step_as_priority_does(tenant):
    """Same arrivals, same model: policy fair with one tenant makes the priority policy's plan at
    every step (no seat preemption, no budget kept back), preemptions for memory included."""
    plans = {}
    for policy in ("priority", "fair"):
        rng = random.Random(3)
        s = make_scheduler(policy=policy, max_num_seqs=6, max_num_batched_tokens=48, num_blocks=41)
        arrivals = {}
        for k in range(60):
            request = make_request(rng.randint(4, 60), request_id=f"r{k}", max_tokens=rng.randint(1, 20),
                                   priority=rng.randrange(2), arrival_time=float(k))
            request.tenant = tenant
            arrivals.setdefault(rng.randrange(40), []).append(request)
        trace = []
        for tick in range(2000):
            for request in arrivals.pop(tick, []):
                s.add_request(request)
            out, _ = step(s)
            trace.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids)))
            if not arrivals and not s.has_unfinished_requests():
                break
        plans[policy] = trace
        assert s.num_preemptions > 0 or policy == "fair"  # memory ran short: the comparison covers preemption
    assert plans["fair"] == plans["priority"]
