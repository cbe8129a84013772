"""Suite-wide setup. Triton kernels run under Triton's interpreter on machines without CUDA; the
variable must be set before any kernel is defined (i.e. before ``kernels`` modules are imported).

The fixtures several folders use (a real redis-server, the tiny model and its tokenizer, the
in-process reference engine and the in-process stack) live in ``helpers/stack.py`` and are given to
every folder here."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.stack import (  # noqa: E402, F401  (fixtures for every folder; after TRITON_INTERPRET)
    hf_model,
    hf_tokenizer,
    llm,
    redis_server,
    smollm2,
    stack,
    tiny_model_dir,
)
