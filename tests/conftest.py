"""Suite-wide setup. Triton kernels run under Triton's interpreter on machines without CUDA; the
variable must be set before any kernel is defined (i.e. before ``kernels`` modules are imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
