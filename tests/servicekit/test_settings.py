"""Settings declarations (``servicekit.contract.settings``, ``servicekit.flags``): ranges checked by
the declaration, one error type, flags handed on by a launcher parse back to the same values."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.scheduling import SchedulingConfig
from servicekit.contract.settings import check_settings, declared_in, project, setting
from servicekit.contract.worker import WorkerDescription
from servicekit.flags import add_setting_flags, settings_argv, settings_kwargs


@dataclass(frozen=True, kw_only=True)
class Knobs:
    count: int = setting(2, minimum=1, maximum=8, help="a count")
    ratio: float = setting(0.5, above=0, maximum=1, help="a share")
    mode: str = setting("a", choices=("a", "b"), help="a mode")
    flag: bool = setting(True, help="a switch")
    limit: int | None = setting(None, type=int, minimum=2, help="optional")
    names: tuple[str, ...] = setting((), help="a list")

    def __post_init__(self) -> None:
        check_settings(self)


@pytest.mark.parametrize(("field", "value"), [
    ("count", 0), ("count", 9), ("count", 1.5), ("count", True), ("ratio", 0.0), ("ratio", 1.01),
    ("ratio", float("nan")), ("mode", "c"), ("flag", 1), ("limit", 1), ("limit", "3"),
])
def test_a_value_outside_its_declaration_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidArgumentError) as e:
        Knobs(**{field: value})
    assert e.value.field == field


def test_values_inside_their_declaration_are_kept():
    knobs = Knobs(count=8, ratio=1, mode="b", flag=False, limit=None, names=("x",))
    assert (knobs.count, knobs.ratio, knobs.mode, knobs.flag, knobs.limit) == (8, 1, "b", False, None)


def test_flags_a_launcher_hands_on_parse_back_to_the_same_settings():
    import argparse

    given = Knobs(count=3, ratio=0.25, mode="b", flag=False, limit=4, names=("x", "y"))
    argv = settings_argv(given)
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, {}, Knobs)
    assert Knobs(**settings_kwargs(Knobs, parser.parse_args(argv))) == given
    assert settings_argv(Knobs()) == []  # defaults are not spelled out


def test_declared_in_lists_only_a_class_s_own_fields():
    from scheduler_service.config import SchedulerConfig

    own = {f.name for f in declared_in(SchedulerConfig)}
    assert "workers" in own and "max_num_seqs" not in own and "redis_url" not in own


def test_a_scheduler_batches_within_what_its_worker_states():
    """-1 (the default attention cap) takes the worker's word: a CPU's cap, or none from a GPU worker;
    a value given wins; the batch limits never exceed the worker's."""
    cpu = WorkerDescription("m", 100, 16, 4096, 1000, (2,), max_num_seqs=8, max_num_batched_tokens=512,
                            prefill_chunk_attention_limit=1 << 20)
    unstated = WorkerDescription("m", 100, 16, 4096, 1000, (2,))
    default = SchedulingConfig()
    assert default.for_worker(cpu) == SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                                       prefill_chunk_attention_limit=1 << 20)
    assert default.for_worker(unstated) == SchedulingConfig(prefill_chunk_attention_limit=0)
    assert SchedulingConfig(prefill_chunk_attention_limit=4096).for_worker(cpu).prefill_chunk_attention_limit == 4096


def test_a_service_s_scheduling_part_is_a_plain_scheduling_config():
    from scheduler_service.config import SchedulerConfig

    settings = SchedulerConfig(max_num_seqs=7, policy="priority", workers=("a:1",))
    assert settings.scheduling == SchedulingConfig(max_num_seqs=7, policy="priority")
    assert project(settings, SchedulingConfig) == settings.scheduling
