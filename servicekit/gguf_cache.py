"""A GGUF checkpoint converted once into a Hugging Face folder that later loads read instead.

transformers reads a GGUF file by parsing all its metadata in Python (the vocabulary and merges
too) for the config, again for the tokenizer and again for the weights, then dequantizing every
tensor. On a 2-core AVX2 host SmolLM2-135M's tokenizer took 18 s to load and its weights 32 s —
at every start of every gateway, worker and ``pagedserve.LLM``. The first load now saves what it
converted under ``$PAGEDSERVE_MODEL_CACHE`` (default ``~/.cache/pagedserve/models``; ``off`` turns
the cache off) and every later one reads that folder: the tokenizer in 3.5 s, the weights in 2.8 s.

Two parts per file, each made when first asked for: ``tokenizer`` (config and tokenizer: what the
gateway needs) and ``model`` (config, generation config, the weights dequantized to float32 as
safetensors: what a worker loads; ~4 bytes a parameter). The key covers
the file's real path, size and modification time and transformers' version, so a changed file or
another converter makes a new folder. A part is written to a temporary folder and renamed into
place, under a file lock: processes started together convert once and the others wait for it.
A cache that cannot be written (a read-only home, a full disk) only costs the time: the file is
loaded directly, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from servicekit.model_registry import ModelSource

log = logging.getLogger(__name__)

CACHE_ENV = "PAGEDSERVE_MODEL_CACHE"
FORMAT = 1  # bump when what a part holds changes: older folders are then left unused


def cache_root() -> Path | None:
    """Where converted checkpoints live; None when the cache is off (``PAGEDSERVE_MODEL_CACHE=off``)."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured.lower() in ("off", "0", "false", "no"):
        return None
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve" / "models"


def cache_key(gguf: Path) -> str:
    """The folder name for ``gguf``: its stem and a hash of what makes its conversion differ."""
    import transformers

    stat = gguf.stat()
    digest = hashlib.sha256(
        f"{FORMAT}|{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    return f"{gguf.stem}-{digest[:16]}"


def hf_folder(source: ModelSource, *, weights: bool) -> ModelSource:
    """``source`` as a Hugging Face folder: for a GGUF checkpoint, its converted copy in the cache
    (made now if missing: ``weights`` asks for the model part, else the tokenizer part); any other
    source as it is. Errors of the conversion itself (a file transformers cannot read) propagate as
    a direct load's would; a cache that cannot be written falls back to the GGUF file."""
    root = cache_root()
    if not source.gguf_file or root is None:
        return source
    gguf = Path(source.path, source.gguf_file)
    part = "model" if weights else "tokenizer"
    try:
        folder = root / cache_key(gguf) / part
        if not folder.is_dir():
            folder.parent.mkdir(parents=True, exist_ok=True)
            with _locked(folder.parent / f"{part}.lock"):
                if not folder.is_dir():  # another process may have made it while we waited
                    _convert(source, folder, weights=weights)
    except OSError as exc:
        log.warning("cannot use the model cache under %s (%s); loading %s itself (slower)", root, exc, gguf)
        return source
    return ModelSource(name=source.name, path=str(folder))


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(source: ModelSource, folder: Path, *, weights: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = source.from_pretrained_kwargs()
    log.info("converting %s (%s) once into %s", source.gguf_file, folder.name, folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        if weights:
            import torch
            from safetensors.torch import save_model

            # dequantized values are float32: a later load in another dtype casts as a direct one would
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **kwargs)
            # save_pretrained refuses a model loaded from GGUF (it counts as quantized): the config,
            # the generation config and the weights are written one by one, as it would (tied
            # weights once: loading ties them again from the config)
            config = model.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(tmp)
            if model.generation_config is not None:
                model.generation_config.save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            AutoConfig.from_pretrained(source.path, **kwargs).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(source.path, **kwargs).save_pretrained(tmp)
        for path in tmp.iterdir():  # on disk before the folder is named: a crash never leaves a short file
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            path.chmod(0o644)
        tmp.chmod(0o755)  # readable by other users, as the folder around it (an image's cache made as root)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """``python -m servicekit.gguf_cache MODEL``: convert a GGUF checkpoint into the cache now (an
    image build, an init container), so the services' first start reads it."""
    import argparse

    from servicekit.model_registry import resolve_model

    parser = argparse.ArgumentParser(prog="python -m servicekit.gguf_cache", description=main.__doc__)
    parser.add_argument("model", help="a short name (smollm2-135m), a .gguf file or a folder holding one")
    parser.add_argument("--tokenizer-only", action="store_true", help="only the gateway's part (no weights)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source = resolve_model(args.model)
    if not source.gguf_file:
        print(f"{args.model} is not a GGUF checkpoint: nothing to convert")
        return 0
    if cache_root() is None:
        print(f"the model cache is off (${CACHE_ENV})")
        return 1
    for weights in (False,) if args.tokenizer_only else (False, True):
        folder = hf_folder(source, weights=weights)
        if folder is source:
            return 1  # could not write it: the warning said why
        print(folder.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
