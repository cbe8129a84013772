"""CPU memory for a worker's big tensors (worker_service/cpu_memory.py): the KV cache's mapping,
populated at start, with huge pages only where they come cheaply."""

from __future__ import annotations

import gc

import pytest
import torch

from worker_service import cpu_memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping (VMA) of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_zeros_are_zero_writable_and_outlive_their_mapping():
    t = cpu_memory.zeros((3, 1000, 16), torch.float32, torch.device("cpu"))
    gc.collect()  # the mmap object has no other referent than the tensor
    assert t.shape == (3, 1000, 16) and int(t.abs().sum()) == 0
    t[2, 999, 15] = 7.0
    assert float(t.sum()) == 7.0
    assert cpu_memory.zeros((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


@pytest.mark.parametrize("how", ["madvise", "touch"])
def test_populated_zeros_are_resident_before_the_first_write(how, monkeypatch):
    if how == "touch":  # a kernel without MADV_POPULATE_WRITE: madvise refuses, one write per page
        monkeypatch.setattr(cpu_memory, "_MADV_POPULATE_WRITE", 12345)

    before = _rss()
    t = cpu_memory.zeros((64, 1 << 20), torch.uint8, torch.device("cpu"), populate=True)  # 64 MiB
    grown = _rss() - before

    assert grown >= 60 << 20, f"only {grown >> 20} MiB resident"
    assert int(t[::4096].sum()) == 0


@pytest.mark.parametrize("budget_s", [0.0, 1e9])
def test_a_mapping_over_its_huge_page_budget_takes_plain_pages_past_the_probe(budget_s, monkeypatch):
    # Budget 0: any huge-page cost is too much, so past the 64 MiB probe the mapping is advised
    # MADV_NOHUGEPAGE; an unbounded budget keeps the advice. Either way: zero, resident, writable.
    monkeypatch.setattr(cpu_memory, "HUGE_PAGE_BUDGET_S", budget_s)
    probe = cpu_memory._HUGE_PAGE_PROBE
    before = _rss()
    t = cpu_memory.zeros((probe + (32 << 20),), torch.uint8, torch.device("cpu"), populate=True)  # 96 MiB
    assert _rss() - before >= (probe + (28 << 20))
    assert int(t[::4096].sum()) == 0
    t[-1] = 9
    assert int(t[-4096:].sum()) == 9
    rest = t.data_ptr() + probe + (16 << 20)
    if budget_s == 0.0:
        assert _anon_huge_kib(rest) == 0
    elif _anon_huge_kib(t.data_ptr()) > 0:  # this machine gives huge pages at all: the rest got them too
        assert _anon_huge_kib(rest) > 0


def test_warm_heap_faults_memory_in_only_where_malloc_keeps_it(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_tuned", False)
    assert cpu_memory.warm_heap(64 << 20) == 0.0  # untuned: freed memory would go straight back
    monkeypatch.setattr(cpu_memory, "_tuned", True)
    assert cpu_memory.warm_heap(0) == 0.0
    assert cpu_memory.warm_heap(4 << 20, chunk=1 << 20) > 0.0


@pytest.mark.parametrize(("argv", "tuned"), [
    ([], True),
    (["--no-tune-malloc"], False),
    (["--device", "cuda"], False),
    (["--simulate-step-latency", "0.001,0"], False),
])
def test_a_worker_tunes_malloc_when_it_is_built_before_its_threads(argv, tuned, monkeypatch):
    # the worker's make_app: before any thread of the process exists (every thread then shares the
    # main heap); not for a GPU worker, a simulated one, or when told not to
    from worker_service import main as worker_main

    calls = []
    monkeypatch.setattr(cpu_memory, "tune_malloc", lambda **kw: calls.append(kw) or True)
    settings = worker_main.settings_from_args(worker_main.build_parser({}).parse_args(["--model", "tiny", *argv]))
    app = worker_main.make_app(settings)
    assert calls == ([{"one_heap": True}] if tuned else []) and app.servicer is None
