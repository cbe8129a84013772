"""SIMULATION ONLY — a stand-in for ``ModelRunner`` that runs no model.

Used by ``benchmarks/scale.py`` to measure the control plane (gateway, Redis, scheduler, Step
streams) with more workers than this machine has accelerators: each step *sleeps* for a timed
model of a GPU step, ``latency = a + b × scheduled tokens`` seconds, and returns deterministic
tokens (a pure function of the request's seed and output position, like the real sampler's
randomness, so resumed requests continue identically). Nothing here computes attention or logits.

It implements the same seam as ``worker_service.model_runner.ModelRunner`` (``info`` and
``execute_model``), and is selected only by the worker's explicit ``--simulate-step-latency a,b``
flag, never by default; a worker running it logs a SIMULATION warning and its worker id starts
with ``sim-``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from servicekit.contract.step import ModelRunnerOutput, SchedulerOutput
from servicekit.contract.worker import WorkerDescription

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def simulated_token(seed: int, position: int, vocab_size: int, avoid: frozenset[int] = frozenset()) -> int:
    """The token 'sampled' at output ``position``: a pure function of (seed, position)."""
    token = _mix64((seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK) % vocab_size
    while token in avoid:  # never EOS: the simulation stops at max_tokens only
        token = (token + 1) % vocab_size
    return token


def parse_step_latency(text: str) -> tuple[float, float]:
    """``"a,b"`` (seconds, seconds per token) -> (a, b); raises ValueError."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"expected 'a,b' (seconds, seconds per scheduled token), got {text!r}")
    a, b = (float(p) for p in parts)
    if a < 0 or b < 0:
        raise ValueError(f"step latency terms must be >= 0, got {text!r}")
    return a, b


class SimulatedRunner:
    """SIMULATION: sleeps ``a + b × total scheduled tokens`` per step and returns deterministic
    tokens; tracks only each live request's token count (to know when it samples)."""

    def __init__(self, info: WorkerDescription, *, step_latency: tuple[float, float],
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.info = info
        self.step_latency = step_latency
        self._sleep = sleep
        self._eos = frozenset(info.eos_token_ids)
        self._num_tokens: dict[str, int] = {}  # request id -> prompt + outputs known
        self._num_prompt: dict[str, int] = {}
        self._seed: dict[str, int] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self._num_tokens.pop(rid, None)
            self._num_prompt.pop(rid, None)
            self._seed.pop(rid, None)
        computed: dict[str, int] = {}
        for r in so.scheduled_new_reqs:
            self._num_prompt[r.request_id] = len(r.prompt_token_ids)
            self._num_tokens[r.request_id] = len(r.prompt_token_ids) + len(r.output_token_ids)
            self._seed[r.request_id] = r.sampling_params.seed or 0
            computed[r.request_id] = r.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        if so.continuation:  # as the real runner: each decodes its last token as known here
            computed.update((rid, self._num_tokens[rid] - 1) for rid in cached.req_ids)
        sampled: dict[str, list[int]] = {}
        spec = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            total = self._num_tokens[rid]
            drafts = spec.get(rid, ())
            if computed[rid] + n > total + len(drafts):  # as the real runner: a plan past the known tokens is a bug
                raise ValueError(f"scheduler output schedules tokens past the known token ids of {rid}")
            if computed[rid] + n == total + len(drafts):
                # as the real runner verifies drafts: the tokens up to the first that differs from its draft
                position = total - self._num_prompt[rid]
                tokens = [simulated_token(self._seed[rid], position, self.info.vocab_size, self._eos)]
                for draft in drafts:
                    if tokens[-1] != draft:
                        break
                    tokens.append(simulated_token(self._seed[rid], position + len(tokens), self.info.vocab_size,
                                                  self._eos))
                sampled[rid] = tokens
                self._num_tokens[rid] = total + len(tokens)
        if so.total_num_scheduled_tokens:
            a, b = self.step_latency
            self._sleep(a + b * so.total_num_scheduled_tokens)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def build_simulated_runner(model: str, *, step_latency: tuple[float, float], num_blocks: int, block_size: int,
                           max_model_len: int | None) -> SimulatedRunner:
    """A SimulatedRunner reporting ``model``'s name, vocabulary and EOS ids (read from its config,
    no weights), with ``num_blocks`` KV blocks (none allocated)."""
    from servicekit.model_registry import resolve_model
    from worker_service.loader import load_hf_config

    config = load_hf_config(resolve_model(model))
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    info = WorkerDescription(model=model, num_blocks=num_blocks, block_size=block_size,
                      max_model_len=max_model_len or config.max_position_embeddings,
                      vocab_size=config.vocab_size, eos_token_ids=eos_ids)
    return SimulatedRunner(info, step_latency=step_latency)
