"""Where a model's sampling defaults come from (``servicekit.sampling_defaults``)."""

from __future__ import annotations

import json

import pytest

from servicekit import sampling_defaults as sd
from servicekit.contract.errors import InvalidArgumentError
from servicekit.model_registry import ModelSource


def _hf_folder(tmp_path, generation_config: dict | None, name: str = "some-model") -> ModelSource:
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return ModelSource(name=name, path=str(tmp_path))


def test_a_folder_s_generation_config_gives_the_sampling_fields_it_sets(tmp_path):
    # Qwen2.5-Instruct's, less the fields that are not sampling defaults
    source = _hf_folder(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                   "repetition_penalty": 1.05, "eos_token_id": [151645, 151643]})
    found, origin = sd.resolve(sd.AUTO, source)
    assert found == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0, "repetition_penalty": 1.05}
    assert origin.endswith("generation_config.json")
    assert sd.unset_filled({}, found)["top_k"] == 20 and isinstance(sd.unset_filled({}, found)["top_k"], int)


def test_a_gguf_file_s_general_sampling_metadata_is_read(tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.min_p", 0.05)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found, origin = sd.resolve(sd.AUTO, ModelSource(name="m", path=str(tmp_path), gguf_file="m.gguf"))
    assert found == pytest.approx({"temperature": 0.6, "top_k": 40.0, "min_p": 0.05})
    assert "general.sampling" in origin


def test_a_short_name_without_shipped_defaults_gets_pagedserve_s(tmp_path):
    found, origin = sd.resolve(sd.AUTO, _hf_folder(tmp_path, {"bos_token_id": 1}, name="SmolLM2-135M"))
    assert found == {"temperature": 0.0} and "pagedserve" in origin
    # what the model ships wins over ours
    found, _ = sd.resolve(sd.AUTO, _hf_folder(tmp_path, {"temperature": 0.5}, name="smollm2-135m"))
    assert found == {"temperature": 0.5}


def test_no_defaults_for_an_unknown_model_neutral_or_a_model_not_found(tmp_path):
    assert sd.resolve(sd.AUTO, _hf_folder(tmp_path, None))[0] == {}
    assert sd.resolve(sd.NEUTRAL, _hf_folder(tmp_path, {"temperature": 0.5}))[0] == {}
    assert sd.resolve(sd.AUTO, None)[0] == {}


def test_overrides_merge_over_the_model_s_field_by_field(tmp_path):
    source = _hf_folder(tmp_path, {"temperature": 0.7, "top_p": 0.8})
    found, origin = sd.resolve('{"top_p": 0.95, "min_p": 0.05}', source)
    assert found == {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05}
    assert origin.startswith("--sampling-defaults over")


@pytest.mark.parametrize("text, words", [
    ("greedy", ['"auto"', '"neutral"', "JSON object"]),
    ("[0.5]", ["JSON object"]),
    ('{"temp": 0.5}', ["unknown fields temp", "temperature"]),
    ('{"temperature": "low"}', ["temperature must be numbers"]),
    ('{"temperature": true}', ["temperature must be numbers"]),
    ('{"temperature": -1}', ["temperature", ">= 0"]),
    ('{"top_p": 0}', ["top_p"]),
    ('{"top_k": 2.5}', ["top_k must be an integer"]),
])
def test_bad_overrides_are_refused_by_name(text, words):
    with pytest.raises(InvalidArgumentError) as info:
        sd.parse_overrides(text)
    assert info.value.field == "sampling_defaults"
    for word in words:
        assert word in str(info.value)


def test_explicit_values_stay_and_null_is_unset():
    defaults = {"temperature": 0.0, "top_k": 40.0}
    assert sd.unset_filled({"temperature": 1.0, "top_k": None, "n": 2}, defaults) == {
        "temperature": 1.0, "top_k": 40, "n": 2}
