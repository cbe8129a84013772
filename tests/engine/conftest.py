"""Models for engine tests: tiny random ones saved once per session, and SmolLM2-135M (loaded once,
only by tests marked ``model``)."""

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


@dataclass
class SmolLM2:
    hf: Any  # transformers model (float32, dequantized from the GGUF)
    tokenizer: Any


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servicekit.gguf_cache import hf_folder
    from servicekit.model_registry import ModelNotFoundError, resolve_model

    try:
        source = resolve_model("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    # the GGUF file's converted copy (the model cache), as the engine and the gateway load it
    hf = AutoModelForCausalLM.from_pretrained(hf_folder(source, weights=True).path).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_folder(source, weights=False).path)
    return SmolLM2(hf, tokenizer)
