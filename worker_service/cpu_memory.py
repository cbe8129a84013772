"""Where a CPU worker's big tensors live: huge pages for the KV cache, a tuned malloc for activations.

Both matter only on the CPU, where memory traffic — not arithmetic — bounds decode attention:

* :func:`zeros` backs the KV cache with transparent huge pages. Attention reads each sequence's
  blocks scattered over the whole cache (often gigabytes); with 4 KiB pages nearly every block costs
  a TLB miss.
* :func:`tune_malloc` keeps freed activation memory in the heap. A forward pass allocates and frees
  tensors of megabytes per layer; with glibc's defaults the larger ones are fresh ``mmap`` s that
  page-fault in on every step. In a worker process it also puts every thread on the main heap: a
  thread's own arena (glibc gives each thread one) is a chain of 64 MiB heaps that grows into fresh
  pages. :func:`warm_heap` faults the activation memory into that heap at start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import time
import warnings

import torch

log = logging.getLogger(__name__)


# Huge pages cost at most this many seconds of a populated mapping's start: where the machine
# hands them out slowly, the rest of the mapping takes plain pages (see :func:`zeros`).
HUGE_PAGE_BUDGET_S = 1.0
_HUGE_PAGE_PROBE = 64 << 20  # bytes populated between two looks at the pace


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, populate: bool = False) -> torch.Tensor:
    """A zero tensor; on Linux CPUs backed by transparent huge pages where the kernel allows them.

    An anonymous private mapping advised ``MADV_HUGEPAGE`` gets 2 MiB pages whether the system's THP
    mode is ``always`` or ``madvise`` (measured here: the reference's K/V gather from a 1.5 GiB cache
    ran 1.4-1.9x faster). ``populate``: fault every page in now (see :func:`populate_pages`) rather than
    on first write. Some VMs fault huge pages in slowly (measured on a 2-core Firecracker VM: 4-7 s
    per GiB against 0.25 s with 4 KiB pages, for no measurable change in offline throughput with
    the C decode kernel: 499.1 / 499.7 against 498.9 / 483.0 tok/s): a populated mapping is timed
    as it goes, and once the whole would take longer than :data:`HUGE_PAGE_BUDGET_S` the rest is
    advised ``MADV_NOHUGEPAGE`` and takes plain pages.
    """
    numel = math.prod(shape)
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or advise is None or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    try:
        mapping.madvise(advise)
    except OSError:  # THP disabled ("never") or unsupported: plain pages, same tensor
        pass
    with warnings.catch_warnings():  # "non-writable buffer" does not apply: the mapping is writable
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    if populate:
        _populate_within_budget(mapping, flat)
    return flat.view(dtype).view(shape)


def _populate_within_budget(mapping: mmap.mmap, flat: torch.Tensor) -> None:
    """Populate ``flat`` (all of ``mapping``'s bytes) 64 MiB at a time with the advice it has; once
    the pace projects the whole past :data:`HUGE_PAGE_BUDGET_S` (huge pages get slower as free
    memory fragments), the rest is advised ``MADV_NOHUGEPAGE`` and populated with plain pages."""
    nbytes = flat.numel()
    no_huge = getattr(mmap, "MADV_NOHUGEPAGE", None)  # None: the advice cannot be changed, only followed
    started = time.perf_counter()
    done = 0
    while done < nbytes:
        end = min(nbytes, done + _HUGE_PAGE_PROBE)
        populate_pages(flat[done:end])
        done = end
        elapsed = time.perf_counter() - started
        projected = elapsed * nbytes / done
        if no_huge is not None and done < nbytes and projected > HUGE_PAGE_BUDGET_S:
            try:
                mapping.madvise(no_huge, done, nbytes - done)  # done: a multiple of the page size
            except OSError:  # refused: the rest keeps the advice it has, asked no more
                no_huge = None
                continue
            log.info("huge pages fault in slowly here (%.2f s for the first %d MiB, %.1f s projected for %d MiB): "
                     "the rest of this mapping takes 4 KiB pages", elapsed, done >> 20, projected, nbytes >> 20)
            populate_pages(flat[done:])
            return


_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (not in Python's mmap module before 3.13)


def populate_pages(tensor: torch.Tensor) -> float:
    """Fault in every page behind the contiguous CPU ``tensor`` now; returns the seconds it took.

    A fresh mapping's pages are allocated (and zeroed) on first write, which in a VM costs about a
    second per GiB: left lazy, a KV cache pays it during its first requests, inside their steps
    (measured: 1.9 s of a 38 s offline run). vLLM's ``torch.zeros`` and llama.cpp's buffer clear pay
    it at start; so does this. ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it (huge pages
    kept), else one write per 4 KiB page.
    """
    started = time.perf_counter()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return 0.0
    done = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        done = libc.madvise(tensor.data_ptr(), nbytes, _MADV_POPULATE_WRITE) == 0  # page-aligned: an mmap
    except (OSError, AttributeError):
        pass
    if not done:  # older kernel, or memory not from zeros(): touch a byte per page
        tensor.view(-1).view(torch.uint8)[::4096].zero_()
    return time.perf_counter() - started


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value (HEAP_MAX / 2 on 64-bit)
_TRIM_THRESHOLD = 1 << 30
_TOP_PAD = 64 << 20
_tuned = False
_one_heap = False


def warm_heap(nbytes: int, chunk: int = 16 << 20) -> float:
    """Fault ``nbytes`` of heap in now, then hand them back to malloc, which keeps them (after
    :func:`tune_malloc`, whose trim threshold is above what a step frees): the steps' activations
    then grow into warm pages rather than faulting fresh ones in while requests wait. Measured on a
    2-core VM serving a burst of 64 requests: the worker's kernel time 0.85 -> 0.15 s, output
    626-635 -> 653-656 tok/s. Chunks below the mmap threshold, so that they come from the heap.
    Returns the seconds it took (0: malloc is not tuned here, and freed memory would go back)."""
    if not _tuned or nbytes <= 0:
        return 0.0
    started = time.perf_counter()
    chunks = [torch.empty(chunk, dtype=torch.uint8) for _ in range(-(-nbytes // chunk))]
    for block in chunks:
        block[::4096] = 0  # a write per page faults it in
    del chunks
    return time.perf_counter() - started


def tune_malloc(*, one_heap: bool = False) -> bool:
    """Serve allocations up to 32 MiB from the heap and keep up to 1 GiB of freed heap: a step's
    activations then reuse warm pages instead of faulting fresh ones in (decode steps ran ~8%
    faster here). ``one_heap`` (a process that is a worker and nothing else): one arena, so that
    every thread created after this call allocates from the main heap too. A worker runs its steps
    on a thread of their own, which otherwise got an arena of 64 MiB heaps of its own that kept
    growing into fresh pages: on a 2-core VM serving a burst of 64 requests, 2.4 of 27 CPU seconds
    went to the kernel faulting them in, against 0.2 s in one thread (the worker calls this before
    it starts any thread; an in-process engine steps on its caller's thread and leaves the caller's
    arenas alone). Process-wide and glibc-only (a worker's ``--no-tune-malloc`` skips the call).
    Returns whether the settings are in effect.
    """
    global _tuned, _one_heap
    if _tuned and (_one_heap or not one_heap):
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = [(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (_M_TOP_PAD, _TOP_PAD)]
    if one_heap:
        settings.append((_M_ARENA_MAX, 1))
    _tuned = all(mallopt(param, value) == 1 for param, value in settings)
    _one_heap = _tuned and one_heap
    if not _tuned:
        log.warning("mallopt rejected the activation-memory settings; CPU steps may run slower")
    return _tuned
