"""The llama.cpp peer driver (``benchmarks/peer_llamacpp.py``) against a fake ``llama-server`` on
loopback: the command line, greedy-only bodies sent all at once, token counts checked, errors said.

The real peer (``make peer-llamacpp`` + ``offline_throughput.py --peer llamacpp``) is too slow for
``make test``; this checks everything the driver does short of llama.cpp's own arithmetic.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_llama_server.py")


def _load_driver():
    spec = importlib.util.spec_from_file_location("peer_llamacpp", ROOT / "benchmarks" / "peer_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer = _load_driver()


@dataclass(frozen=True)
class Req:
    prompt_token_ids: list[int]
    output_len: int


REQUESTS = [Req([100 + i] * (30 + 7 * i), 5 + i) for i in range(5)]


@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    """An executable ``llama-server`` that runs the fake, with a BUILD_INFO beside it."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    (binary.parent / "BUILD_INFO").write_text("llama_cpp_python=0.3.36\nllama_cpp_commit=abc1234\n")
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(record))
    monkeypatch.setenv("FAKE_LLAMA_EXPECT", str(len(REQUESTS)))
    return binary, record


@pytest.fixture
def q4_1_gguf(tmp_path):
    """A tiny GGUF that declares itself Q4_1, with one F32 tensor."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    path = tmp_path / "tiny.Q4_1.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_1)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_runs_every_request_at_once_greedy_only_and_reports_what_ran(fake_binary, q4_1_gguf, tmp_path):
    binary, record_path = fake_binary
    result = peer.run_peer(REQUESTS, q4_1_gguf, binary=str(binary), slots=[3], threads=2,
                           log_dir=str(tmp_path / "logs"), ready_timeout_s=60)

    (row,) = result["rows"]
    assert row["output_tokens"] == sum(r.output_len for r in REQUESTS) and row["output_tokens_per_s"] > 0
    assert (row["slots"], row["total_slots"], row["build_info"]) == (3, 3, "b4242-abc1234")
    assert result["best"] is row
    assert result["version"] == "4242 (abc1234)"
    assert result["build"] == {"llama_cpp_python": "0.3.36", "llama_cpp_commit": "abc1234"}
    assert result["gguf"] == {"file": "tiny.Q4_1.gguf", "file_type": "MOSTLY_Q4_1", "tensor_types": {"F32": 1}}

    record = json.loads(record_path.read_text())
    argv = record["argv"]
    assert "--no-kv-unified" in argv  # each slot its own context, as -c / -np says
    argv_pairs = [a for a in argv if a != "--no-kv-unified"]
    flags = dict(zip(argv_pairs[::2], argv_pairs[1::2]))
    per_slot = 256  # the longest request, 58 + 9 tokens, rounded up
    assert flags == {"-m": q4_1_gguf, "--host": "127.0.0.1", "--port": flags["--port"], "-np": "3",
                     "-c": str(3 * per_slot), "-t": "2", "-tb": "2", "-fa": "off", "-cram": "0"}
    assert result["ctx_per_slot"] == per_slot
    assert record["max_in_flight"] == len(REQUESTS)  # all at once, not a slot's worth at a time
    bodies = sorted(record["bodies"], key=lambda b: len(b["prompt"]))
    assert bodies == [peer.completion_body(r.prompt_token_ids, r.output_len) for r in REQUESTS]
    assert bodies[0]["samplers"] == ["top_k"] and bodies[0]["top_k"] == 1 and bodies[0]["temperature"] == 0
    assert bodies[0]["cache_prompt"] is False and bodies[0]["ignore_eos"] is True
    assert all(isinstance(t, int) for b in bodies for t in b["prompt"])  # token ids, not text


@pytest.mark.parametrize("fault, message", [
    ("FAKE_LLAMA_SHORT", "output tokens, got"),  # a short answer is an error, not a figure
    ("FAKE_LLAMA_CRASH", "boom, cannot load the model"),  # a server dying at start shows its log
])
def test_faults_of_the_server_are_errors(fault, message, fake_binary, q4_1_gguf, tmp_path, monkeypatch):
    binary, _ = fake_binary
    monkeypatch.setenv(fault, "1")
    with pytest.raises(peer.PeerError, match=message):
        peer.run_peer(REQUESTS, q4_1_gguf, binary=str(binary), slots=[2], log_dir=str(tmp_path / "logs"),
                      ready_timeout_s=60)


def test_a_missing_binary_says_how_to_build_it(q4_1_gguf, tmp_path):
    with pytest.raises(peer.PeerError, match="make peer-llamacpp"):
        peer.run_peer(REQUESTS, q4_1_gguf, binary=str(tmp_path / "nope" / "llama-server"))
