"""The sampling parameters a request gets for the fields it leaves unset, as vLLM takes them from
a model's generation config: the model's own where it ships them, else ours for the models we
name, else none (OpenAI's defaults: temperature 1, no top-k / top-p / min-p filter).

Where they come from, first found wins, field by field:

1. the model's ``generation_config.json`` (a Hugging Face folder) or its GGUF file's
   ``general.sampling.*`` metadata (llama.cpp's keys: ``temp``, ``top_k``, ``top_p``, ``min_p``,
   ``penalty_repeat``);
2. :data:`KNOWN`: defaults for our short names, where the model ships none;
3. nothing: :class:`~servicekit.contract.sampling_params.SamplingParams`' own defaults.

The gateway applies them (``--sampling-defaults``: ``auto``, ``neutral`` for none, or a JSON object
merged over ``auto``'s), shows them in ``/v1/models`` and the gRPC ``ModelInfo``, and logs them at
start. A request's explicit value always wins. Standard library (and ``gguf``, imported only for a
GGUF file).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.model_registry import ModelSource

log = logging.getLogger(__name__)

# the SamplingParams fields a model's generation config may give defaults for
FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}

# Our short names' defaults where the model ships none. SmolLM2-135M-Instruct (Q4_1): its first
# tokens are near ties — for "What is the capital of France?" P("The") 0.157, P("L") 0.137,
# P("La") 0.102 — so sampled at any temperature it answered in French nonsense in 3 to 7 of 20
# seeds (temperature 0.1: 3; 0.3 with top-p 0.9, top-k 40, min-p 0.05: 7; llama.cpp's 0.8 / 40 /
# 0.95 / 0.05: 7; 1.0: 11), greedily "The capital of France is Paris." So it decodes greedily
# unless a request asks otherwise.
KNOWN: dict[str, dict[str, float]] = {"smollm2-135m": {"temperature": 0.0}}

AUTO, NEUTRAL = "auto", "neutral"


def model_defaults(source: ModelSource | None) -> tuple[dict[str, float], str]:
    """(the defaults, where they came from) for ``source`` (rule 1, then 2; ``None``: a model
    not found locally, which has neither)."""
    if source is None:
        return {}, "none (the model is not a local one)"
    shipped, origin = _shipped(source)
    if shipped:
        return shipped, origin
    known = KNOWN.get(source.name.lower())
    if known:
        return dict(known), f"pagedserve's defaults for {source.name}"
    return {}, "none (the model ships no sampling defaults)"


def _shipped(source: ModelSource) -> tuple[dict[str, float], str]:
    if source.gguf_file:
        path = os.path.join(source.path, source.gguf_file)
        try:
            from gguf import GGUFReader

            fields = GGUFReader(path).fields
        except (ImportError, OSError, ValueError) as exc:
            log.warning("sampling defaults: could not read %s (%s)", path, exc)
            return {}, ""
        found = {name: float(fields[key].contents()) for key, name in _GGUF_KEYS.items() if key in fields}
        return found, f"{source.gguf_file}'s general.sampling metadata"
    path = os.path.join(source.path, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}, ""
    found = {name: float(config[name]) for name in FIELDS if isinstance(config.get(name), (int, float))}
    return found, path


def resolve(setting: str, source: ModelSource | None) -> tuple[dict[str, float], str]:
    """The defaults ``--sampling-defaults`` asks for: ``auto`` (:func:`model_defaults`),
    ``neutral`` (none), or a JSON object of :data:`FIELDS` merged over ``auto``'s."""
    if setting == NEUTRAL:
        return {}, "none (--sampling-defaults neutral)"
    found, origin = model_defaults(source)
    if setting == AUTO:
        return found, origin
    return {**found, **parse_overrides(setting)}, f"--sampling-defaults over {origin}"


def for_model(setting: str, model: str) -> tuple[dict[str, float], str]:
    """:func:`resolve` for a model given by name (``servicekit.model_registry``); a name that is no
    local model (a test's, a Hub id not downloaded) has none of its own."""
    from servicekit.model_registry import ModelNotFoundError, resolve_model

    try:
        source = resolve_model(model)
    except ModelNotFoundError:
        source = None
    return resolve(setting, source)


def parse_overrides(text: str) -> dict[str, float]:
    """A ``--sampling-defaults`` JSON object, checked: known fields, numbers."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidArgumentError("sampling_defaults", f'must be "{AUTO}", "{NEUTRAL}" or a JSON object of '
                                                        f"{', '.join(FIELDS)}; got {text[:80]!r}")
    unknown = sorted(set(value).difference(FIELDS))
    if unknown:
        raise InvalidArgumentError("sampling_defaults", f"unknown fields {', '.join(unknown)}; "
                                                        f"takes {', '.join(FIELDS)}")
    bad = [k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise InvalidArgumentError("sampling_defaults", f"{', '.join(bad)} must be numbers")
    if "top_k" in value and value["top_k"] != int(value["top_k"]):
        raise InvalidArgumentError("sampling_defaults", f"top_k must be an integer, got {value['top_k']!r}")
    out = {k: float(v) for k, v in value.items()}
    try:  # each value in the range a request's own would be checked against
        SamplingParams(**unset_filled({}, out))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError("sampling_defaults", f"{exc.field}: {exc.message}") from None
    return out


def unset_filled(given: Mapping, defaults: Mapping[str, float]) -> dict:
    """``given`` (a body's or a message's fields by name) with each default its ``None`` or missing
    fields take; explicit values stay."""
    out = dict(given)
    for name, value in defaults.items():
        if out.get(name) is None:
            out[name] = int(value) if name == "top_k" else value
    return out
