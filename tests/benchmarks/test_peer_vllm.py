"""The vLLM peer driver (``benchmarks/peer_vllm.py``): the model folder it hands vLLM and the
environment vLLM runs in. vLLM itself (``make peer-vllm``, 3.5 GB, 50-80 s to start) is too heavy
for ``make test``; its runs are benchmarks (``offline_throughput.py --peer vllm``, ``serve.py --peer
vllm``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_driver():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("peer_vllm", ROOT / "benchmarks" / "peer_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer = _load_driver()


def test_the_model_folder_names_its_architecture_and_the_tied_embedding(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    source = tmp_path / "tied"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True}))
    (source / "tokenizer.json").write_text("{}")
    embedding = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    save_file({"lm_head.weight": embedding, "model.norm.weight": torch.ones(3)}, str(source / "model.safetensors"))

    folder = peer.model_folder(str(source), tmp_path / "for-vllm")

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    tensors = load_file(str(folder / "model.safetensors"))
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert torch.equal(tensors["model.embed_tokens.weight"], embedding)
    assert (folder / "tokenizer.json").exists()
    assert peer.model_folder(str(source), tmp_path / "for-vllm") == folder  # made once


def test_vllm_runs_bound_to_the_allowed_cpus_with_our_kv_budget_and_tcmalloc(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/of/ours")
    env = peer.environment(kv_cache_bytes=1536 * 2**20, threads=2)
    allowed = sorted(os.sched_getaffinity(0))[:2]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, allowed))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # whole GiB, rounded up: never less than ours
    assert env["OMP_NUM_THREADS"] == "2" and "PYTHONPATH" not in env
    assert ("LD_PRELOAD" in env) == os.path.exists(peer.TCMALLOC)
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert set(peer.settings(env)) <= {"VLLM_TARGET_DEVICE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS",
                                       "LD_PRELOAD"}


def test_a_missing_venv_says_how_to_install_it(tmp_path):
    with pytest.raises(peer.PeerError, match="make peer-vllm"):
        peer.python(tmp_path)


def test_the_cpu_is_named_with_its_family_and_model():
    """Hosts named alike ("AMD EPYC") differ by family: the results record it (the first processor's)."""
    cpuinfo = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
               "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n")
    assert peer.cpu_model(cpuinfo) == "AMD EPYC (family 26, model 2)"
    assert peer.cpu_model("flags\t: avx2\n") == "? (family ?, model ?)"
