"""Where an engine step's wall time goes: ``offline_throughput.py --profile``.

``install(llm)`` wraps, for the duration of a ``with`` block, the callables a step is made of —
the scheduler's ``schedule()`` / ``update_from_output()``, the worker's batch diff and input
staging, every ``nn.Linear`` (GEMM), the KV-cache write, the attention op (split into its prefill
and decode parts where the backend has them), the LM head and the sampler — and charges each
call's *exclusive* wall time to its category (a wrapped call inside another is subtracted from the
outer one), so the rows add up to the profiled span; what no wrapper covers is "everything else".

Nothing here touches the engine's code: without ``--profile`` no wrapper exists and a step costs
what it always did. With it, each timed call adds about a microsecond of Python (measured and
printed, so the overhead is visible). On CUDA each boundary synchronizes the device, so the times
are device times, at the price of the overlap the GPU would otherwise have.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

EVERYTHING_ELSE = "everything else (engine loop, outputs)"


class StepProfile:
    """Exclusive wall time and call counts per category, from wrapped callables."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # category -> exclusive seconds
        self.calls: Counter[str] = Counter()  # category -> number of timed calls
        self._stack: list[list[Any]] = []  # [category, start of its current exclusive stretch]
        self._sync = synchronize

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed under ``category``; time spent in wrapped calls inside it is theirs."""
        stack, seconds, calls, sync, clock = self._stack, self.seconds, self.calls, self._sync, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if sync is not None:
                sync()
            now = clock()
            if stack:  # pause the caller's stretch
                outer = stack[-1]
                seconds[outer[0]] += now - outer[1]
            frame = [category, now]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                end = clock()
                stack.pop()
                seconds[category] += end - frame[1]
                calls[category] += 1
                if stack:
                    stack[-1][1] = end  # the caller's next stretch starts now

        return timed

    def per_call_overhead_s(self, n: int = 20_000) -> float:
        """Seconds one timed call adds (wrapper vs bare call of a no-op), measured here."""
        probe = StepProfile()
        noop = lambda: None  # noqa: E731
        timed = probe.wrap("probe", noop)
        t0 = time.perf_counter()
        for _ in range(n):
            noop()
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            timed()
        return max(0.0, (time.perf_counter() - t0 - bare) / n)

    def table(self, total_s: float) -> list[dict[str, Any]]:
        """Rows sorted by time: category, seconds, share of ``total_s``, calls; the remainder last."""
        rows = [{"category": c, "seconds": round(s, 3), "share": s / total_s, "calls": self.calls[c]}
                for c, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])]
        rest = total_s - sum(self.seconds.values())
        rows.append({"category": EVERYTHING_ELSE, "seconds": round(rest, 3), "share": rest / total_s, "calls": 0})
        return rows


@contextmanager
def _patched(targets: list[tuple[Any, str, Callable[..., Any]]]) -> Iterator[None]:
    """Set each ``obj.attr`` to its replacement; restore the originals (or remove the instance
    attribute that shadowed a class one) on exit, whatever happens."""
    saved = [(obj, attr, attr in vars(obj), getattr(obj, attr)) for obj, attr, _ in targets]
    try:
        for obj, attr, replacement in targets:
            setattr(obj, attr, replacement)
        yield
    finally:
        for obj, attr, had_own, original in reversed(saved):
            if had_own or isinstance(obj, type):
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)


class _TimedScheduler:
    """The engine's scheduler with its two per-step calls timed, everything else passed through. A
    stand-in rather than patched methods: the compiled core's objects take no instance attributes
    (``scheduler_service.core.compiled``)."""

    def __init__(self, scheduler: Any, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
        self._scheduler = scheduler
        self.schedule = wrap("scheduler: schedule()", scheduler.schedule)
        self.update_from_output = wrap("scheduler: update_from_output()", scheduler.update_from_output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


@contextmanager
def install(llm: Any) -> Iterator[StepProfile]:
    """Profile ``llm`` (a ``pagedserve.LLM``) inside the block; yields the accumulating profile."""
    import worker_service.sampler as sampler_module
    from worker_service.models.cpu_gemm import PackedLinear

    runner, scheduler = llm.runner, llm.scheduler
    backend = runner.attention_backend
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
    profile = StepProfile(sync)
    w = profile.wrap
    targets: list[tuple[Any, str, Callable[..., Any]]] = [
        (llm, "scheduler", _TimedScheduler(scheduler, w)),
        (runner, "execute_model", w("worker: execute_model glue", runner.execute_model)),
        (runner, "_update_states", w("worker: batch diff (_update_states)", runner._update_states)),
        (runner, "_prepare_inputs", w("worker: input staging (_prepare_inputs)", runner._prepare_inputs)),
        (runner, "_sampling_metadata", w("worker: sampling metadata", runner._sampling_metadata)),
        (runner, "_collect", w("worker: collect sampled tokens", runner._collect)),
        (runner.model, "forward", w("model: other ops (embed, RMSNorm, rotary, SiLU*up, residual, "
                                    "per-layer Python)", runner.model.forward)),
        (torch.nn.Linear, "forward", w("linear layers (GEMM)", torch.nn.Linear.forward)),
        (PackedLinear, "forward", w("linear layers (GEMM)", PackedLinear.forward)),
        # the MLP's gate/up GEMM with SiLU * up in its pass (on the tiles; None where it does not run)
        (PackedLinear, "silu_mul", w("linear layers (GEMM)", PackedLinear.silu_mul)),
        (runner, "reshape_and_cache", w("KV-cache writes", runner.reshape_and_cache)),
        (runner, "paged_attention", w(f"attention ({backend}): batch split / glue", runner.paged_attention)),
        (runner.model, "compute_logits", w("logits (LM-head GEMM + fp32)", runner.model.compute_logits)),
        # a plain greedy step's LM head: the GEMM and each row's argmax, no fp32 logits
        (runner.model, "greedy_token_ids", w("logits (LM-head GEMM + fp32)", runner.model.greedy_token_ids)),
        *([(runner.model.head_gemm, "forward", w("logits (LM-head GEMM + fp32)", runner.model.head_gemm.forward))]
          if getattr(runner.model, "head_gemm", None) is not None else []),
        (runner, "sampler", w("sampler", runner.sampler)),
        # structured output (worker_service.structured_output): per step, the constrained rows'
        # next-token bitmask, the mask applied to their logits, and each matcher advanced
        (runner.structured, "bitmask", w("grammar: next-token bitmasks (xgrammar)", runner.structured.bitmask)),
        (runner.structured, "accept", w("grammar: matchers advanced (xgrammar)", runner.structured.accept)),
        (sampler_module, "mask_to_grammar", w("grammar: mask applied to logits", sampler_module.mask_to_grammar)),
    ]
    if backend == "cpu":
        # The tuned CPU path runs prefill chunks and decode rows through the C kernel (or, without
        # it, SDPA and the batched torch decode), all looked up in paged_kernels.cpu at call time; a
        # call's exclusive time is charged, so the SDPA fallback inside _native_prefill is its own row.
        import paged_kernels.cpu as cpu

        targets.append((cpu, "_native_prefill", w("attention prefill (cpu: C kernel)", cpu._native_prefill)))
        # the chunks of a step that go on the tiles (AMX, or emulated on AVX512-BF16), in one call
        targets.append((cpu, "_amx_prefill_batch", w("attention prefill (cpu: tiles)", cpu._amx_prefill_batch)))
        targets.append((cpu, "_prefill", w("attention prefill (cpu: gather + SDPA)", cpu._prefill)))
        targets.append((cpu, "_native_decode", w("attention decode (cpu: C kernel)", cpu._native_decode)))
    with _patched(targets):
        yield profile


def report(profile: StepProfile, total_s: float, output_tokens: int) -> dict[str, Any]:
    """Print the table (share of ``total_s``) and return it as JSON-ready data."""
    import os

    rows = profile.table(total_s)
    num_calls = sum(profile.calls.values())
    overhead = profile.per_call_overhead_s() * num_calls
    print(f"\nprofile of generate(): {total_s:.2f} s wall, {output_tokens / total_s:.1f} output tok/s while "
          f"profiled; {num_calls} timed calls, est. instrumentation {overhead:.3f} s "
          f"({100 * overhead / total_s:.1f} %); load average {os.getloadavg()}")
    print(f"| {'where the time goes':<78} | {'s':>8} | {'share':>6} | {'calls':>7} |")
    print(f"| {'-' * 78} | {'-' * 8} | {'-' * 6} | {'-' * 7} |")
    for r in rows:
        print(f"| {r['category']:<78} | {r['seconds']:>8.3f} | {100 * r['share']:>5.1f}% | {r['calls']:>7} |")
    return {"total_s": round(total_s, 3), "timed_calls": num_calls, "instrumentation_s_estimate": round(overhead, 3),
            "load_average": list(os.getloadavg()),
            "rows": [{**r, "share": round(r["share"], 4)} for r in rows]}
