"""``benchmarks/step_profile.py`` (offline_throughput.py --profile) against the engine as it is: every
category it names is a function the engine calls, so a moved or renamed one fails here, not in the
middle of a benchmark run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from worker.factories import random_prompts

from pagedserve import LLM, SamplingParams

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_every_category_is_timed_and_the_engine_is_restored(tiny_llama, backend, capsys):
    step_profile = _load("step_profile")
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, block_size=8, dtype="float32", attention_backend=backend)
    prompts = random_prompts([12, 30, 5], seed=7)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]

    scheduler = llm.scheduler
    with step_profile.install(llm) as profile:
        got = [o.token_ids for o in llm.generate(prompts, params)]
    table = step_profile.report(profile, total_s=sum(profile.seconds.values()) * 1.1, output_tokens=18)

    assert got == expected  # timing changes nothing
    names = {row["category"]: row for row in table["rows"]}
    called = {name for name, row in names.items() if row["calls"] > 0}
    print(sorted(called))
    for part in ("scheduler: schedule()", "linear layers (GEMM)", "KV-cache writes", "sampler",
                 "logits (LM-head GEMM + fp32)", "worker: input staging (_prepare_inputs)"):
        assert part in called
    if backend == "cpu":  # prefill chunks and decode rows, each timed on its own
        assert {"attention prefill (cpu: C kernel)", "attention decode (cpu: C kernel)"} <= called
    assert "| linear layers (GEMM)" in capsys.readouterr().out
    # the wrappers are gone: the engine has its own scheduler back, and the instance attributes
    # that shadowed the runner's methods were removed
    assert llm.scheduler is scheduler and "execute_model" not in vars(llm.runner)
