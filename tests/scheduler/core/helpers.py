"""Factories and fakes for scheduler-core tests: build a scheduler, build requests, play the worker."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_service.core import (
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulingConfig,
    SchedulerOutput,
    WorkerDescription,
)
from servicekit.contract.worker import CPU_PREFILL_CHUNK_ATTENTION_LIMIT

EOS = 2
VOCAB_SIZE = 32_000
_CONFIG_FIELDS = set(SchedulingConfig.__dataclass_fields__)
_WORKER_FIELDS = set(WorkerDescription.__dataclass_fields__)


def make_worker(**overrides) -> WorkerDescription:
    """A small fake CPU worker: 4-token blocks, 64 usable blocks, EOS = 2, a CPU's attention cap."""
    values = dict(model="fake", num_blocks=65, block_size=4, max_model_len=256, vocab_size=VOCAB_SIZE,
                  eos_token_ids=(EOS,), prefill_chunk_attention_limit=CPU_PREFILL_CHUNK_ATTENTION_LIMIT)
    values.update(overrides)
    return WorkerDescription(**values)


def make_scheduler(*, seed_rng: random.Random | None = None, **overrides) -> Scheduler:
    """A scheduler over ``make_worker()``; keyword overrides go to SchedulingConfig or WorkerDescription by name."""
    unknown = set(overrides) - _CONFIG_FIELDS - _WORKER_FIELDS
    if unknown:
        raise TypeError(f"unknown overrides {sorted(unknown)}")
    config = SchedulingConfig(**{k: v for k, v in overrides.items() if k in _CONFIG_FIELDS})
    worker = make_worker(**{k: v for k, v in overrides.items() if k in _WORKER_FIELDS})
    return Scheduler(config, worker, seed_rng=seed_rng)


_ids = iter(range(10**9))


def make_prompt(n_tokens: int, seed: int | str = 0) -> list[int]:
    """``n_tokens`` deterministic token ids in [10, VOCAB_SIZE) (never EOS), distinct per seed."""
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB_SIZE) for _ in range(n_tokens)]


def make_request(n_tokens: int = 8, *, request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                 max_tokens: int = 16, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, output_token_ids: tuple[int, ...] | list[int] = (),
                 block_size: int | None = None, **sampling) -> Request:
    """A request with an ``n_tokens`` prompt of its own (unless ``prompt_token_ids`` is given)."""
    k = next(_ids)
    rid = request_id if request_id is not None else f"req-{k}"
    prompt = prompt_token_ids if prompt_token_ids is not None else make_prompt(n_tokens, rid)
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return Request(rid, prompt, params, arrival_time=float(k) if arrival_time is None else arrival_time,
                   priority=priority, cache_salt=cache_salt, output_token_ids=output_token_ids,
                   block_size=block_size)


def sampling_ids(scheduler: Scheduler, out: SchedulerOutput) -> list[str]:
    """Ids of the requests that sample in ``out`` (call before update_from_output)."""
    ids = []
    for rid, n in out.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        if req.num_computed_tokens + n == req.num_tokens + len(out.scheduled_spec_decode_tokens.get(rid, ())):
            ids.append(rid)
    return ids


def model_output(scheduler: Scheduler, out: SchedulerOutput,
                 tokens: dict[str, int] | Callable[[str], int] | int = 100) -> ModelRunnerOutput:
    """One sampled token per sampling request: from a dict (default 100), a function of the id, or a constant
    (a request with draft tokens then keeps none of them: its first token is taken as differing)."""
    sampled = {}
    for rid in sampling_ids(scheduler, out):
        if callable(tokens):
            tok = tokens(rid)
        elif isinstance(tokens, dict):
            tok = tokens.get(rid, 100)
        else:
            tok = tokens
        sampled[rid] = [tok]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def step(scheduler: Scheduler, tokens: dict[str, int] | Callable[[str], int] | int = 100):
    """schedule() → hand-made model output → update_from_output(); returns (plan, outputs by id)."""
    out = scheduler.schedule()
    results = scheduler.update_from_output(out, model_output(scheduler, out, tokens))
    return out, {o.request_id: o for o in results}


@dataclass
class _HeldRequest:
    token_ids: list[int]  # prompt + outputs as the worker knows them
    num_prompt_tokens: int
    block_ids: list[int]  # block table, append-only
    num_computed_tokens: int
    params: SamplingParams


@dataclass
class FakeWorker:
    """Plays a worker from the diffs alone and checks what a worker relies on (outputs.py invariants).

    KV is simulated: each slot stores (position, token id) written when the token is computed, so a
    prefix-cache hit or a block table pointing at the wrong block shows up as a mismatch.
    ``token_fn(request_id, output_index)`` is the model: a pure function, as sampling is in pagedserve.
    With ``num_drafts``, it proposes up to that many draft tokens per request that sampled, as a real
    worker does (what followed the latest earlier occurrence of its last two tokens), and verifies
    the drafts it is given.
    """

    num_blocks: int
    block_size: int
    token_fn: Callable[[str, int], int]
    check_every: int = 8  # verify a request's whole KV context every this many sampled tokens
    num_drafts: int = 0  # draft tokens to propose per request (0: none)
    held: dict[str, _HeldRequest] = field(default_factory=dict)
    kv: list = field(default_factory=list)
    # its latest answer's drafts: request id -> (token count they follow, drafts)
    proposed: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    num_skipped: int = 0  # continuation rows skipped: the request had all of its max_tokens

    def __post_init__(self) -> None:
        self.kv = [None] * (self.num_blocks * self.block_size)

    def _check_context(self, held: _HeldRequest, upto: int) -> None:
        bs = self.block_size
        for pos in range(upto):
            slot = held.block_ids[pos // bs] * bs + pos % bs
            assert self.kv[slot] == (pos, held.token_ids[pos]), f"KV mismatch at position {pos}"

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.held.pop(rid, None)
        for rid in out.preempted_req_ids:
            assert rid in self.held, f"preempted {rid} was not held"
            del self.held[rid]
        new_ids = {n.request_id for n in out.scheduled_new_reqs}
        cached_ids = set(out.scheduled_cached_reqs.req_ids)
        assert not new_ids & cached_ids
        assert new_ids | cached_ids == set(out.num_scheduled_tokens)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert not set(out.num_scheduled_tokens) & out.finished_req_ids
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.held, f"{new.request_id} sent as new twice"
            assert new.sampling_params.seed is not None
            held = _HeldRequest(list(new.prompt_token_ids) + list(new.output_token_ids),
                                len(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens,
                                new.sampling_params)
            assert new.num_computed_tokens % self.block_size == 0
            self.held[new.request_id] = held
        cached = out.scheduled_cached_reqs
        assert len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens)
        for rid, new_block_ids, num_computed_tokens in zip(cached.req_ids, cached.new_block_ids,
                                                          cached.num_computed_tokens):
            held = self.held[rid]
            if out.continuation:  # the scheduler's count is a lower bound; it decodes its last token
                assert num_computed_tokens <= len(held.token_ids)
                assert held.num_computed_tokens == len(held.token_ids) - 1, "a continuation of a request not decoding"
            else:
                assert num_computed_tokens == held.num_computed_tokens
            held.block_ids.extend(new_block_ids)
        sampled: dict[str, list[int]] = {}
        bs = self.block_size
        spec = out.scheduled_spec_decode_tokens
        num_scheduled = out.num_scheduled_tokens
        if out.continuation:
            assert not spec and not out.scheduled_new_reqs and set(num_scheduled.values()) <= {1}
            # one whose drafts gave it all of its max_tokens in the previous step is skipped
            num_scheduled = {rid: n for rid, n in num_scheduled.items()
                             if len(self.held[rid].token_ids) - self.held[rid].num_prompt_tokens
                             < self.held[rid].params.max_tokens}
            self.num_skipped += len(out.num_scheduled_tokens) - len(num_scheduled)
            # its own drafts, from its previous answer, for the tokens it holds now
            spec = {rid: drafts[:out.num_own_drafts] for rid, (count, drafts) in self.proposed.items()
                    if rid in num_scheduled and count == len(self.held[rid].token_ids) and out.num_own_drafts}
            num_scheduled = {rid: n + len(spec.get(rid, ())) for rid, n in num_scheduled.items()}
        assert set(spec) <= set(out.num_scheduled_tokens), "drafts for a request not scheduled"
        # Write every scheduled token's KV first (per layer, as a real batch does), then sample.
        for rid, n in num_scheduled.items():
            held = self.held[rid]
            known = held.token_ids + spec.get(rid, [])  # drafts are this step's inputs after its tokens
            assert n >= 1 and held.num_computed_tokens + n <= len(known)
            assert rid not in spec or held.num_computed_tokens + n == len(known), "drafts of a request not decoding"
            assert len(held.block_ids) * bs >= held.num_computed_tokens + n, "too few blocks"
            for pos in range(held.num_computed_tokens, held.num_computed_tokens + n):
                self.kv[held.block_ids[pos // bs] * bs + pos % bs] = (pos, known[pos])
            held.num_computed_tokens += n
        for new in out.scheduled_new_reqs:
            # The prefix-cache hit holds our tokens once the batch's KV is written: a hit may name
            # blocks another request of this very step fills (blocks are cached at allocation).
            self._check_context(self.held[new.request_id], new.num_computed_tokens)
        for rid in num_scheduled:
            held = self.held[rid]
            drafts = spec.get(rid, [])
            if held.num_computed_tokens == len(held.token_ids) + len(drafts):
                index = len(held.token_ids) - held.num_prompt_tokens
                if index % self.check_every == 0:
                    self._check_context(held, len(held.token_ids))
                # a real worker's verification: the sampled tokens up to the first that differs
                # from its draft; the rejected drafts' positions count as not computed
                tokens = [self.token_fn(rid, index)]
                for draft in drafts:
                    if tokens[-1] != draft:
                        break
                    tokens.append(self.token_fn(rid, index + len(tokens)))
                held.num_computed_tokens = len(held.token_ids) - 1 + len(tokens)
                held.token_ids.extend(tokens)
                sampled[rid] = tokens
        proposed = {rid: self._propose(self.held[rid]) for rid in sampled} if self.num_drafts else {}
        proposed = {r: d for r, d in proposed.items() if d}
        self.proposed = {r: (len(self.held[r].token_ids), d) for r, d in proposed.items()}
        return ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=proposed)

    def _propose(self, held: _HeldRequest) -> list[int]:
        tokens = held.token_ids
        k = min(self.num_drafts, held.params.max_drafts(len(tokens) - held.num_prompt_tokens))
        suffix = tokens[-2:]
        for start in range(len(tokens) - 3, -1, -1):
            if tokens[start:start + 2] == suffix:
                return tokens[start + 2:start + 2 + k] if k > 0 else []
        return []
