"""The sections of ``benchmarks/gpu_check.py``, one module each, and what they share (``common``).

Each section module has ``run(ctx: Context) -> dict``; the dict is JSON-ready and has ``passed``.
The driver runs each in its own process (a CUDA fault in one cannot poison the next), under its
own time budget.
"""
