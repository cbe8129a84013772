"""Models for engine tests: tiny random ones saved once per session (SmolLM2-135M, ``smollm2``,
is every folder's: ``helpers/stack.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from worker.factories import make_hf_model


@dataclass
class SavedModel:
    path: str  # a Hugging Face folder for LLM(model=...)
    hf: Any  # the same weights as a transformers model, for references


def _save(tmp_path_factory, family: str) -> SavedModel:
    hf = make_hf_model(family)
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    hf.save_pretrained(path)
    return SavedModel(str(path), hf)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> SavedModel:
    return _save(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> SavedModel:
    return _save(tmp_path_factory, "qwen2")
