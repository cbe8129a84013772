"""Where a CPU worker's threads run: the model runner's OpenMP team one thread per core, and every
other thread of the process (gRPC's, the event loop's) on the core of the team's last thread.

Left to the OS, a worker that uses every core for its forward pass also has a handful of service
threads (gRPC's pollers, the event loop) waking each step, and the stack's other processes beside
it; threads then migrate between cores and two OpenMP threads may share one while the other spins
at a barrier. Pinned this way each OpenMP thread keeps its core, and the service threads share a
helper's, never the runner thread's: the event loop's work at a step's end (sending the answer,
taking the next plan) runs beside the runner thread, which starts the step sent ahead at once, and
what they do during a step delays a helper in a parallel region, never the runner thread's serial
Python between them. Measured on a 2-core host with the whole stack on it, the placement switched
step by step in one served round: decode steps 2-4 ms (of ~110) shorter than with the service
threads on the runner's core or left to the OS, and the runner's wait between steps that were
planned ahead 0.15 ms (median) against 0.7 on the runner's core. See
benchmarks/results/README.md, "The served stack beside the in-process engine".

Only done when it cannot stack threads: a CPU worker whose torch thread count equals the number of
CPUs it may use (a worker given fewer threads than CPUs may share the machine with another one, and
the OS places them better), one OpenMP runtime in the process (the team is pinned through the C
kernels' libgomp, which must be torch's), and the C kernels built. ``--no-bind-cpu-threads`` turns
it off.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from paged_kernels import native

log = logging.getLogger(__name__)

_OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def plan(num_threads: int, allowed: set[int]) -> list[int] | None:
    """The CPU of each team thread (thread 0: the runner thread), or None when pinning is not
    wanted: fewer than two threads, or not exactly one thread per allowed CPU."""
    if num_threads < 2 or num_threads != len(allowed):
        return None
    return sorted(allowed)


def _openmp_runtimes() -> set[str]:
    """The OpenMP libraries mapped into this process (one expected: torch's)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if any(name in os.path.basename(path) for name in _OPENMP_RUNTIMES):
                found.add(path)
    return found


def bind_team(cpus: list[int]) -> list[int]:
    """Pin the calling thread's OpenMP team (as torch will use it) to ``cpus``, thread i to
    ``cpus[i]``; returns the threads' ids (empty: not pinned, and why is logged). Call on the
    thread that runs the forward passes."""
    pin = native.function("thread_affinity", "pin_team", [native.INT, native.PTR, native.PTR], native.INT)
    if pin is None:
        log.info("CPU threads not pinned: the C kernels are not available")
        return []
    runtimes = _openmp_runtimes()
    if len(runtimes) != 1:
        log.info("CPU threads not pinned: %d OpenMP runtimes in this process (%s)", len(runtimes),
                 ", ".join(sorted(runtimes)) or "none")
        return []
    n = len(cpus)
    if torch.get_num_threads() != n:
        raise ValueError(f"bind_team: {n} CPUs for a team of {torch.get_num_threads()} threads")
    tids = (ctypes.c_int32 * n)()
    pinned = pin(n, (ctypes.c_int32 * n)(*cpus), tids)
    if pinned != n:
        log.warning("CPU threads not pinned: %d of %d threads took their CPU", pinned, n)
        return []
    return list(tids)


def confine_others(team: list[int], cpu: int) -> int:
    """Pin every thread of this process outside ``team`` to ``cpu`` (threads they start later
    inherit it); returns how many were pinned."""
    done = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid in team:
            continue
        try:
            os.sched_setaffinity(tid, {cpu})
            done += 1
        except OSError:  # the thread ended meanwhile
            pass
    return done


def bind_worker_threads() -> str:
    """On the runner thread: pin its team and confine the process's other threads (see the module
    docstring); returns what was done, for the worker's start-up log."""
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"):
        return "CPU threads not pinned (thread placement is only set on Linux)"
    allowed = os.sched_getaffinity(0)
    cpus = plan(torch.get_num_threads(), allowed)
    if cpus is None:
        return (f"CPU threads not pinned ({torch.get_num_threads()} torch threads on {len(allowed)} "
                "allowed CPUs: pinned only when they are equal and at least 2)")
    team = bind_team(cpus)
    if not team:
        return "CPU threads not pinned (see above)"
    others = confine_others(team, cpus[-1])
    return (f"CPU threads pinned: OpenMP team on CPUs {','.join(map(str, cpus))}, "
            f"{others} service threads on CPU {cpus[-1]} with a helper thread")
