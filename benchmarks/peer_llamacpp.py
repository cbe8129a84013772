"""llama.cpp's ``llama-server`` as the CPU peer of ``offline_throughput.py --peer llamacpp``.

``make peer-llamacpp`` builds the binary (``benchmarks/build_llamacpp.sh``); this module starts it on
a free loopback port with the model's GGUF file, sends the benchmark's requests to ``/completion``
all at once, and stops it. Settings for a fair peer:

- the same prompt token ids (a list of ints: the server adds no BOS to those) and exactly each
  request's output length (``n_predict``, ``ignore_eos``);
- ``cache_prompt: false``: no reuse of KV between requests (our run does not share prefixes either,
  its prompts being random);
- greedy and nothing else: ``temperature: 0`` with ``"samplers": ["top_k"], "top_k": 1`` — the
  default chain runs every sampler even at temperature 0, which costs llama.cpp time we don't spend;
- ``-fa off``: on the CPU llama.cpp's flash attention halves its decode speed at 512-token contexts;
- ``-np`` slots, each with a context for the longest request; the same thread count as torch;
  ``-cram 0``: no host-memory prompt cache (nothing is reused, so saving prompts would only cost).

Standard library only (``gguf`` for the file type, which transformers' GGUF loading installs).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

DEFAULT_BINARY = "build/llamacpp/bin/llama-server"
BUILD_HINT = "build it with `make peer-llamacpp`"
_HOST = "127.0.0.1"


class PeerError(RuntimeError):
    """The peer could not run, or did not do what was asked (wrong token counts, early exit)."""


class PeerRequest(Protocol):
    prompt_token_ids: list[int]
    output_len: int


def completion_body(prompt_token_ids: Sequence[int], output_len: int) -> dict[str, Any]:
    """The ``/completion`` request for one benchmark request: greedy, exactly ``output_len`` tokens."""
    return {
        "prompt": [int(t) for t in prompt_token_ids],
        "n_predict": int(output_len),
        "ignore_eos": True,
        "cache_prompt": False,
        "temperature": 0.0,
        "samplers": ["top_k"],
        "top_k": 1,
        "stream": False,
    }


def server_command(binary: str, gguf: str, port: int, slots: int, ctx_per_slot: int, threads: int) -> list[str]:
    """The ``llama-server`` command line (``-c`` is the whole context, split over ``-np`` slots)."""
    return [binary, "-m", gguf, "--host", _HOST, "--port", str(port), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--no-kv-unified", "-t", str(threads), "-tb", str(threads),
            "-fa", "off", "-cram", "0"]


def ctx_per_slot(requests: Sequence[PeerRequest], granule: int = 256) -> int:
    """A slot's context: the longest prompt + output, rounded up to ``granule`` tokens."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    return -(-longest // granule) * granule


def gguf_description(path: str) -> dict[str, Any]:
    """The GGUF's declared file type (e.g. ``MOSTLY_Q4_1``) and how many tensors have each type."""
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(path)
    field = reader.fields.get("general.file_type")
    file_type = None
    if field is not None:
        value = int(field.parts[field.data[0]][0])
        try:
            file_type = LlamaFileType(value).name
        except ValueError:
            file_type = str(value)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {"file": os.path.basename(path), "file_type": file_type, "tensor_types": dict(types.most_common())}


def binary_version(binary: str) -> str:
    """``llama-server --version``'s first line, e.g. ``version: 0 (0c1e57098)``."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise PeerError(f"{binary} not found: {BUILD_HINT}") from None
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return "unknown"


def build_info(binary: str) -> dict[str, str]:
    """``key=value`` lines of the BUILD_INFO file ``make peer-llamacpp`` writes beside the binary."""
    path = Path(binary).with_name("BUILD_INFO")
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: dict | None = None, timeout_s: float = 30.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(_HOST, port, timeout=timeout_s)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else None)
    finally:
        conn.close()


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM) in bytes, 0 if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class LlamaServer:
    """A running ``llama-server`` on a free loopback port; use as a context manager."""

    def __init__(self, command: list[str], port: int, log_path: Path) -> None:
        self.command, self.port, self.log_path = command, port, log_path
        self.process: subprocess.Popen | None = None
        self.peak_rss_bytes = 0

    def __enter__(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        try:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise PeerError(f"{self.command[0]} not found: {BUILD_HINT}") from None
        finally:
            log.close()
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``/health`` answers 200 (loading answers 503); raise if the server exits or stalls."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerError(f"llama-server exited with {self.process.returncode} at start:\n{self.log_tail()}")
            try:
                status, _ = _request(self.port, "GET", "/health", timeout_s=5)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.2)
        raise PeerError(f"llama-server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def props(self) -> dict[str, Any]:
        status, props = _request(self.port, "GET", "/props")
        return props if status == 200 and isinstance(props, dict) else {}

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        self.peak_rss_bytes = _peak_rss(self.process.pid)
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_requests(port: int, requests: Sequence[PeerRequest], timeout_s: float = 3600.0) -> dict[str, Any]:
    """Send every request at once (one connection each, released together), wait for all.

    Raises PeerError when a response is not 200 or does not carry exactly the asked number of
    output tokens and prompt tokens (so a run that silently generated less never counts).
    """
    start = threading.Barrier(len(requests) + 1)

    def one(request: PeerRequest) -> tuple[float, dict]:
        body = completion_body(request.prompt_token_ids, request.output_len)
        start.wait()
        status, data = _request(port, "POST", "/completion", body, timeout_s=timeout_s)
        done = time.perf_counter()
        if status != 200 or not isinstance(data, dict):
            raise PeerError(f"/completion answered {status}: {str(data)[:300]}")
        return done, data

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [pool.submit(one, r) for r in requests]
        start.wait()
        t0 = time.perf_counter()
        results = [f.result() for f in futures]
    elapsed = max(done for done, _ in results) - t0
    for request, (_, data) in zip(requests, results):
        predicted = data.get("tokens_predicted")
        evaluated = data.get("tokens_evaluated")
        if predicted != request.output_len or evaluated != len(request.prompt_token_ids):
            raise PeerError(f"asked {len(request.prompt_token_ids)} prompt + {request.output_len} output tokens, "
                            f"got {evaluated} + {predicted} (truncated: {data.get('truncated')})")
    produced = sum(r.output_len for r in requests)
    return {"generate_s": round(elapsed, 3), "output_tokens": produced,
            "output_tokens_per_s": round(produced / elapsed, 2)}


def run_peer(requests: Sequence[PeerRequest], gguf: str, *, binary: str = DEFAULT_BINARY,
             slots: Sequence[int] = (16,), threads: int = 2, log_dir: str = "build/llamacpp/logs",
             ready_timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ``requests`` through ``llama-server`` once per slot count; every row plus the best."""
    if not os.path.isfile(binary):
        raise PeerError(f"{binary} not found: {BUILD_HINT}")
    per_slot = ctx_per_slot(requests)
    result: dict[str, Any] = {
        "binary": binary,
        "version": binary_version(binary),
        "build": build_info(binary),
        "gguf": gguf_description(gguf),
        "threads": threads,
        "ctx_per_slot": per_slot,
        "settings": {"flash_attn": "off", "cache_prompt": False, "samplers": ["top_k"], "top_k": 1,
                     "ignore_eos": True},
        "rows": [],
    }
    for n in slots:
        port = _free_port()
        command = server_command(binary, gguf, port, n, per_slot, threads)
        with LlamaServer(command, port, Path(log_dir) / f"llama-server-np{n}.log") as server:
            server.wait_ready(ready_timeout_s)
            props = server.props()
            load_before = os.getloadavg()[0]
            row = run_requests(port, requests)
            row.update(slots=n, build_info=props.get("build_info"), total_slots=props.get("total_slots"),
                       load_average_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)],
                       command=" ".join(command))
        row["peak_rss_bytes"] = server.peak_rss_bytes
        result["rows"].append(row)
        print(f"llama.cpp, {n} slots: {row['output_tokens_per_s']} output tok/s ({row['generate_s']} s, "
              f"peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB, load {row['load_average_before_after']})")
    result["best"] = max(result["rows"], key=lambda r: r["output_tokens_per_s"])
    return result
