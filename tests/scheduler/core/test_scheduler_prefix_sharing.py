"""Requests admitted in one step share their prefix: blocks enter the prefix cache at allocation.

The FakeWorker writes the whole batch's KV before it checks any context, as a real forward pass
does per layer, so a hit on a block that another request of the same step fills is checked too.
"""

from __future__ import annotations

from scheduler_service.core.waiting_queue import MAX_PASSED_OVER

from .helpers import FakeWorker, make_prompt, make_request, make_scheduler


def play(scheduler, worker, max_steps=100):
    """Step with the fake worker until nothing is left; returns {request id: output tokens}."""
    delivered: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return delivered
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, worker.execute(out)):
            delivered.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")


def token_fn(request_id: str, index: int) -> int:
    return 1000 + index


def test_two_requests_with_one_prefix_admitted_in_one_step_share_it():
    s = make_scheduler(policy="fcfs")
    system = make_prompt(12, "system")  # 3 full blocks
    a = make_request(prompt_token_ids=system + [50, 51], max_tokens=3)
    b = make_request(prompt_token_ids=system + [60], max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, token_fn)

    out = s.schedule()
    new = {n.request_id: n for n in out.scheduled_new_reqs}
    assert new[a.request_id].num_computed_tokens == 0 and out.num_scheduled_tokens[a.request_id] == 14
    assert new[b.request_id].num_computed_tokens == 12  # a's blocks, filled in this very step
    assert out.num_scheduled_tokens[b.request_id] == 1
    assert new[b.request_id].block_ids[:3] == new[a.request_id].block_ids[:3]
    assert s.stats().prefix_cache_hits == 12
    results = {o.request_id: o for o in s.update_from_output(out, worker.execute(out))}
    assert results[b.request_id].num_cached_tokens == 12
    assert s.kv_cache_manager.get_num_free_blocks() == 64 - 5  # 4 for a, 1 of b's own

    delivered = play(s, worker)  # the worker checks every context it attends to
    assert delivered[a.request_id] == [1001, 1002] and delivered[b.request_id] == [1001, 1002]
    s.kv_cache_manager.block_pool.check_invariants()


def test_n_copies_of_one_prompt_compute_it_once_but_each_its_last_token():
    s = make_scheduler()
    prompt = make_prompt(12, "copies")  # exactly 3 blocks: a hit stops one block short
    copies = [make_request(prompt_token_ids=prompt, max_tokens=2) for _ in range(4)]
    for r in copies:
        s.add_request(r)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, token_fn)
    out = s.schedule()
    assert [out.num_scheduled_tokens[r.request_id] for r in copies] == [12, 4, 4, 4]
    assert out.total_num_scheduled_tokens == 24  # not 48
    s.update_from_output(out, worker.execute(out))
    assert all(tokens == [1001] for tokens in play(s, worker).values())  # 1000 came in step 1


def test_no_sharing_with_prefix_caching_off():
    s = make_scheduler(enable_prefix_caching=False)
    prompt = make_prompt(12, "off")
    for _ in range(2):
        s.add_request(make_request(prompt_token_ids=prompt, max_tokens=1))
    out = s.schedule()
    assert list(out.num_scheduled_tokens.values()) == [12, 12]
    assert s.kv_cache_manager.block_pool.cached_blocks == {}


def test_a_chunk_shares_only_the_blocks_its_step_fills():
    """A long prompt cut by the threshold: a request admitted beside its first chunk shares that chunk."""
    s = make_scheduler(long_prefill_token_threshold=8)
    prompt = make_prompt(20, "chunked")
    first, second = (make_request(prompt_token_ids=prompt, max_tokens=1) for _ in range(2))
    s.add_request(first)
    s.add_request(second)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, token_fn)
    out = s.schedule()
    new = {n.request_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert new == {first.request_id: 0, second.request_id: 8}
    assert out.num_scheduled_tokens == {first.request_id: 8, second.request_id: 8}
    s.update_from_output(out, worker.execute(out))
    assert play(s, worker) == {first.request_id: [1000], second.request_id: [1000]}


def test_a_request_preempted_after_filling_blocks_in_its_step_leaves_no_hit_on_them():
    """Priority policy: a victim already scheduled this step is taken back; the blocks its allocation
    cached will never be written, so they must not be hits (the block taken from it first is
    reused at once; the one before it would otherwise stay cached with no KV)."""
    s = make_scheduler(policy="priority", num_blocks=8, long_prefill_token_threshold=8)  # 7 usable
    prompt = make_prompt(24, "background")
    background = make_request(prompt_token_ids=prompt, priority=5, max_tokens=2)
    s.add_request(background)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, token_fn)
    s.update_from_output(out := s.schedule(), worker.execute(out))  # tokens 0-7: blocks 0, 1
    urgent = make_request(4, priority=0, max_tokens=4)
    s.add_request(urgent)
    s.update_from_output(out := s.schedule(), worker.execute(out))  # tokens 8-15 + urgent's prompt
    probe = make_request(prompt_token_ids=prompt + [1])
    assert s.count_prefix_hit_tokens(probe) == 16

    out = s.schedule()  # background takes blocks 4, 5 for tokens 16-23; urgent needs a block: it goes
    assert out.preempted_req_ids == {background.request_id}
    assert out.num_scheduled_tokens == {urgent.request_id: 1}
    assert s.count_prefix_hit_tokens(probe) == 16  # not 20: block 4 was never written
    s.update_from_output(out, worker.execute(out))
    delivered = play(s, worker)  # background resumes and recomputes; every context checks out
    assert delivered[background.request_id] == [1000, 1001]
    s.kv_cache_manager.block_pool.check_invariants()


def test_lpm_admits_requests_finding_their_prefix_cached_before_earlier_ones():
    """Policy lpm: with a shared prefix cached, the requests that find it go before an earlier
    request that finds nothing, in a step whose budget cannot take them all; FCFS keeps arrival
    order. The passed-over request goes first after MAX_PASSED_OVER such steps."""
    system = make_prompt(32, "system")  # 8 full blocks
    order = {}
    for policy in ("fcfs", "lpm"):
        s = make_scheduler(policy=policy, max_num_batched_tokens=40, shared_prefill_token_threshold=0)
        worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, token_fn)
        first = make_request(prompt_token_ids=system + [7, 8], max_tokens=2, request_id="first")
        s.add_request(first)
        out = s.schedule()  # first computes the prefix
        s.update_from_output(out, worker.execute(out))
        cold = make_request(36, max_tokens=2, request_id="cold")  # arrives first, nothing cached
        warm = [make_request(prompt_token_ids=system + [20 + i], max_tokens=2, request_id=f"warm{i}") for i in range(3)]
        for r in (cold, *warm):
            s.add_request(r)
        out = s.schedule()
        order[policy] = [n.request_id for n in out.scheduled_new_reqs]
        s.update_from_output(out, worker.execute(out))
        play(s, worker)
        s.kv_cache_manager.block_pool.check_invariants()
    assert order["fcfs"][0] == "cold"
    assert order["lpm"][:3] == ["warm0", "warm1", "warm2"]  # 1 token each, then cold's chunk


def test_lpm_lets_a_passed_over_request_go_first():
    """Policy lpm: a request that finds nothing cached, behind a stream of requests that find
    their prefix and fill every step's budget, is admitted after at most MAX_PASSED_OVER steps."""
    system = make_prompt(32, "system")
    s = make_scheduler(policy="lpm", max_num_batched_tokens=8, shared_prefill_token_threshold=0, max_num_seqs=64)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, token_fn)
    s.add_request(make_request(prompt_token_ids=system + [7], max_tokens=1, request_id="seed"))
    play(s, worker)
    s.add_request(make_request(24, max_tokens=1, request_id="cold"))
    admitted_before_cold = 0
    for step in range(20):
        for k in range(8):  # eight later arrivals a step, each 1 token past the cached prefix: a full budget
            s.add_request(make_request(prompt_token_ids=system + [100 + 8 * step + k], max_tokens=1))
        out = s.schedule()
        ids = [n.request_id for n in out.scheduled_new_reqs]
        s.update_from_output(out, worker.execute(out))
        if "cold" in ids:
            break
        admitted_before_cold += len(ids)
    else:
        raise AssertionError("cold was never admitted")
    assert admitted_before_cold == 8 * MAX_PASSED_OVER and step == MAX_PASSED_OVER
    play(s, worker)
    s.kv_cache_manager.block_pool.check_invariants()
