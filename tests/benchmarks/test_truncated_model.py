"""benchmarks/truncated_model.py: a model's first N layers, with the model's own weights, loadable
by the engine the stack runs (``serve.py --num-layers``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from truncated_model import first_layers  # noqa: E402


def test_the_first_layers_keep_their_weights_and_serve(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pagedserve import LLM, SamplingParams

    folder = first_layers(tiny_model_dir, 1, tmp_path / "cut")

    assert AutoConfig.from_pretrained(folder).num_hidden_layers == 1
    whole, cut = load_file(Path(tiny_model_dir) / "model.safetensors"), load_file(Path(folder) / "model.safetensors")
    assert set(cut) == {k for k in whole if not k.startswith("model.layers.1.")}
    assert all(torch.equal(cut[k], whole[k]) for k in cut)
    (out,) = LLM(folder, dtype="float32", num_blocks=64).generate(
        ["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_more_layers_than_the_model_has_is_refused_by_name(tiny_model_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="--num-layers: .* has 2 decoder layers, asked for 3"):
        first_layers(tiny_model_dir, 3, tmp_path / "cut")
