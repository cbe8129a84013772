"""One source per setting: every knob is declared once, with one default, whether it reaches the
code through a service's flags, ``pagedserve serve`` or ``LLM(...)``; docs/configuration.md is
generated from the same declarations and current."""

from __future__ import annotations

import inspect
from pathlib import Path

from pagedserve.config_doc import commands, concerns, render
from servicekit.contract.settings import declared_in

REPO = Path(__file__).resolve().parents[1]
# Each service listens on its own port, with its own default (servicekit.ports): one knob per service.
OWN_TO_EACH_SERVICE = {"port"}


def test_every_knob_is_declared_once():
    every = [cls for classes in commands().values() for cls in classes]
    declared: dict[str, list[str]] = {}
    for cls in concerns(every):
        for f in declared_in(cls):
            declared.setdefault(f.name, []).append(cls.__name__)
    twice = {name: owners for name, owners in declared.items() if len(owners) > 1 and name not in OWN_TO_EACH_SERVICE}
    assert twice == {}


def test_llm_declares_no_engine_setting_of_its_own():
    from pagedserve.llm import LLM

    own = set(inspect.signature(LLM.__init__).parameters) - {"self", "engine_settings"}
    model_runner, scheduling = commands()["LLM(...)"]
    settings = {f.name for cls in (model_runner, scheduling) for f in cls.__dataclass_fields__.values()}
    assert own & settings == {"model"}  # the one positional argument, declared by ModelConfig


def test_llm_and_pagedserve_serve_batch_alike_for_the_same_settings():
    """The flags of ``pagedserve serve`` reach its worker and scheduler (through their own parsers)
    as the same model-runner and scheduling settings ``LLM`` builds from the same keywords."""
    from pagedserve import launcher
    from pagedserve.llm import engine_configs
    from scheduler_service.main import build_parser as scheduler_parser
    from scheduler_service.main import settings_from_args as scheduler_settings
    from worker_service.main import build_parser as worker_parser
    from worker_service.main import settings_from_args as worker_settings

    given = dict(max_num_seqs=64, max_num_batched_tokens=512, enable_prefix_caching=False, policy="priority",
                 block_size=32, dtype="float32", prefill_chunk_attention_limit=4096, kv_cache_memory="256MiB",
                 long_prefill_token_threshold=128, enable_chunked_prefill=True)
    argv = []
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    stack = launcher.StackConfig(**launcher.settings_kwargs(launcher.StackConfig, launcher.build_parser({}).parse_args(argv)))
    worker = worker_settings(worker_parser({}).parse_args(launcher.worker_flags(stack)))
    scheduler = scheduler_settings(scheduler_parser({}).parse_args(launcher.scheduler_flags(stack)))

    runner, scheduling = engine_configs("smollm2-135m", given)
    assert worker.runner == runner
    assert scheduler.scheduling == scheduling
    # and with nothing given, everyone takes the same defaults
    bare = launcher.StackConfig()
    runner, scheduling = engine_configs("smollm2-135m", {})
    assert worker_settings(worker_parser({}).parse_args(launcher.worker_flags(bare))).runner == runner
    assert scheduler_settings(scheduler_parser({}).parse_args(launcher.scheduler_flags(bare))).scheduling == scheduling


def test_configuration_doc_is_generated_and_current():
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert text == render(), "docs/configuration.md is stale: run `make docs`"
