"""pagedserve: PagedAttention + continuous batching, as gRPC services or in one process.

Kept light: names are imported lazily, so ``import pagedserve`` (e.g. for the client SDK) does not
import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "AsyncClient": "pagedserve.aio_client",
    "Client": "pagedserve.client",
    "LLM": "pagedserve.llm",
    "RequestMetrics": "pagedserve.llm",
    "RequestOutput": "pagedserve.llm",
    "SamplingParams": "servicekit.contract.sampling_params",
    "StructuredOutput": "servicekit.contract.structured_output",
    "ToolCall": "pagedserve.client_types",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from pagedserve.aio_client import AsyncClient
    from pagedserve.client import Client
    from pagedserve.client_types import ToolCall
    from pagedserve.llm import LLM, RequestMetrics, RequestOutput
    from servicekit.contract.sampling_params import SamplingParams
    from servicekit.contract.structured_output import StructuredOutput


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
