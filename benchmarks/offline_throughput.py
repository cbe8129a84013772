"""Offline throughput: pagedserve's continuous batching vs transformers' static batching.

The same requests (fixed seed: prompt lengths uniform in [32, 512] random token ids, output lengths
uniform in [16, 256], every request generating exactly its length) go through

- ``pagedserve.LLM.generate`` — all at once, continuous batching over the paged KV cache, and
- transformers ``generate`` in static batches of 8 in arrival order (left-padded; a batch runs until
  its longest request is done; only the tokens each request asked for count as useful).

Both decode greedily. Model load time is excluded from the throughput figures and reported
separately. Peak resident memory (RSS) is sampled during each phase. The run's compute limit (its
FLOPs ÷ the GEMM rate measured at start in the dtype it runs, ``compute_limit.py``) and our share of it
are printed too. Results go to a JSON file and a PNG bar chart beside it. Figures from a shared
machine are noisy: the 1-minute load average is printed at start and stored per phase.

    python benchmarks/offline_throughput.py                      # the full run (a few minutes on CPU)
    python benchmarks/offline_throughput.py --num-requests 8     # a quick one
    python benchmarks/offline_throughput.py --skip-hf --profile  # where pagedserve's step time goes
    make peer-llamacpp && python benchmarks/offline_throughput.py --peer llamacpp   # + llama.cpp (peer_llamacpp.py)
    make peer-vllm && python benchmarks/offline_throughput.py --skip-hf --peer vllm  # + vLLM's CPU backend (peer_vllm.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import peer_llamacpp  # beside this script
import step_profile
import torch


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(n: int, seed: int, vocab_size: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[BenchRequest]:
    rng = random.Random(seed)
    low_id = 100  # skip the special tokens at the start of the vocabulary
    return [
        BenchRequest([rng.randrange(low_id, vocab_size) for _ in range(rng.randint(*prompt_range))],
                     rng.randint(*output_range))
        for _ in range(n)
    ]


class PeakRSS:
    """Samples this process's resident set size in a background thread; ``peak`` per phase."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self.load_before = self.load_after = 0.0

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @contextmanager
    def phase(self) -> Iterator[PeakRSS]:
        self.peak = self.current()
        self.load_before = os.getloadavg()[0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(self.interval_s):
                self.peak = max(self.peak, self.current())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.peak = max(self.peak, self.current())
            self.load_after = os.getloadavg()[0]

    def load(self) -> list[float]:
        """1-minute load average before and after the phase: other processes' CPU use skews results."""
        return [round(self.load_before, 2), round(self.load_after, 2)]


def run_pagedserve(model: str, requests: list[BenchRequest], args: argparse.Namespace,
                   dtype: str | None = None) -> dict:
    from pagedserve import LLM, SamplingParams
    from worker_service import cpu_memory

    rss = PeakRSS()
    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              attention_backend=args.attention_backend, dtype=dtype or args.dtype,
              skip_tokenizer_init=not args.structured,  # the grammar engine reads the tokenizer
              **({} if args.num_speculative_tokens is None else {"num_speculative_tokens": args.num_speculative_tokens}))
    init_s = time.perf_counter() - t0
    if args.structured:  # serve.py --structured's schemas; the grammar, not max_tokens, ends each request
        from serve import words_schema

        params = [SamplingParams(max_tokens=2 * r.output_len, temperature=0.0,
                                 structured_output={"json": words_schema(r.output_len)}) for r in requests]
    else:
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    profiling = step_profile.install(llm) if args.profile else nullcontext()
    with rss.phase(), profiling as profile:
        t0 = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=args.progress)
        elapsed = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outputs)
    expected = sum(r.output_len for r in requests)
    if args.structured:  # a word of many tokens can leave the array unfinished at max_tokens: counted, not refused
        finished = {"stop": sum(o.finish_reason == "stop" for o in outputs),
                    "length": sum(o.finish_reason == "length" for o in outputs)}
    elif produced != expected:
        raise RuntimeError(f"pagedserve produced {produced} tokens, expected {expected}")
    stats = llm.scheduler.stats()
    info = llm.info
    result = {
        "engine_init_s": round(init_s, 3),  # loading the weights through transformers included
        "generate_s": round(elapsed, 3),
        "output_tokens": produced,
        "output_tokens_per_s": round(produced / elapsed, 2),
        "peak_rss_bytes": rss.peak,
        "load_average_before_after": rss.load(),
        "num_preemptions": stats.num_preemptions,
        **({"structured": "json_schema (serve.words_schema)", "finish_reasons": finished} if args.structured else {}),
        "num_blocks": info.num_blocks,
        "block_size": info.block_size,
        "attention_backend": llm.runner.attention_backend,
        "speculation": {"num_speculative_tokens": llm.runner.config.num_speculative_tokens,
                        "prompt_lookup": [llm.runner.config.prompt_lookup_min, llm.runner.config.prompt_lookup_max]},
        "dtype": str(llm.runner.loaded.dtype).removeprefix("torch."),
        "dtype_reason": llm.runner.loaded.dtype_reason,
        # the runner's CPU memory placement (worker_service.cpu_memory): process-wide malloc tuning,
        # applied when the engine starts, i.e. after the transformers phase of this script
        "malloc_tuned": cpu_memory.tune_malloc() if llm.runner.device.type == "cpu" else False,
    }
    if profile is not None:
        result["profile"] = step_profile.report(profile, elapsed, produced)
    del llm
    return result


def run_hf_static(hf_model: Any, requests: list[BenchRequest], batch_size: int, pad_token_id: int, *,
                  max_seconds: float = float("inf")) -> dict:
    """Static batches in order; once ``max_seconds`` have passed no further batch starts (the
    figures then cover ``batches_run`` of ``batches`` batches, each measured whole)."""
    rss = PeakRSS()
    useful = 0
    generated = 0
    batches_run = 0
    with rss.phase(), torch.inference_mode():
        t0 = time.perf_counter()
        for start in range(0, len(requests), batch_size):
            if batches_run and time.perf_counter() - t0 > max_seconds:
                break
            batches_run += 1
            batch = requests[start : start + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long, device=hf_model.device)
            mask = torch.zeros((len(batch), width), dtype=torch.long, device=hf_model.device)
            for i, r in enumerate(batch):  # left padding
                ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids, device=ids.device)
                mask[i, width - len(r.prompt_token_ids):] = 1
            new = max(r.output_len for r in batch)
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                    do_sample=False, pad_token_id=pad_token_id)
            generated += (out.shape[1] - width) * len(batch)
            useful += sum(r.output_len for r in batch)
        elapsed = time.perf_counter() - t0
    return {
        "batch_size": batch_size,
        "batches": -(-len(requests) // batch_size),
        "batches_run": batches_run,
        "generate_s": round(elapsed, 3),
        "useful_output_tokens": useful,
        "generated_tokens_incl_padding": generated,
        "output_tokens_per_s": round(useful / elapsed, 2),
        "peak_rss_bytes": rss.peak,
        "load_average_before_after": rss.load(),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, values = ["pagedserve\n(continuous)"], [result["pagedserve"]["output_tokens_per_s"]]
    colors = ["tab:blue"]
    if result.get("hf_static"):
        names.append(f"transformers\n(static, batch {result['hf_static']['batch_size']})")
        values.append(result["hf_static"]["output_tokens_per_s"])
        colors.append("tab:gray")
    for row in result.get("llamacpp", {}).get("rows", []):
        names.append(f"llama.cpp\n({row['slots']} slots)")
        values.append(row["output_tokens_per_s"])
        colors.append("tab:orange")
    for row in result.get("vllm", {}).get("rows", []):
        names.append(f"vLLM CPU\n({row['settings']})")
        values.append(row["output_tokens_per_s"])
        colors.append("tab:green")
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(values)), 4))
    bars = ax.bar(names, values, color=colors)
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s (load time excluded)")
    ratio = result.get("speedup")
    ax.set_title(f"{result['model']}, {result['num_requests']} requests" + (f" — {ratio:.2f}x" if ratio else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--skip-hf", action="store_true", help="run pagedserve only")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="1536MiB", help="enough for the default workload without preemption")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compare-dtype", default="",
                   help="also run pagedserve in this dtype (e.g. float32) in the same run, and print the ratio")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.add_argument("--profile", action="store_true",
                   help="time pagedserve's step by part (GEMM, attention, KV writes, sampling, worker and "
                        "scheduler Python) and print each part's share of the wall time (step_profile.py)")
    p.add_argument("--structured", action="store_true",
                   help="pagedserve only: constrain every request by a JSON schema (serve.py --structured's), so "
                        "--profile shows what the grammar costs per step (its bitmask, matchers and mask rows)")
    p.add_argument("--tune-malloc-for-transformers", action="store_true",
                   help="apply pagedserve's CPU malloc tuning (worker_service.cpu_memory) before the transformers "
                        "phase too, so both phases run with the same allocator settings")
    p.add_argument("--peer", choices=["llamacpp", "vllm"], action="append", default=[],
                   help="also run the same requests through llama.cpp's llama-server with the model's GGUF file "
                        "(build it first: make peer-llamacpp), or vLLM's CPU backend's offline LLM (make peer-vllm); "
                        "repeatable")
    p.add_argument("--vllm-settings", choices=["matched", "default", "ngram", "both", "all"], default="both",
                   help="vLLM's max_num_seqs / max_num_batched_tokens: ours (matched), its own defaults, or both runs; "
                        "ngram: ours and its n-gram speculation with pagedserve's draft settings; all: the three "
                        "(the ratio to vLLM's best is over matched and default; ngram's is printed beside it)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="pagedserve's draft tokens per step (n-gram speculation; default: its own default, 0: off)")
    p.add_argument("--peer-slots", type=int, nargs="+", default=[16], help="llama-server slot counts to run")
    p.add_argument("--peer-binary", default=peer_llamacpp.DEFAULT_BINARY)
    p.add_argument("--output", default="benchmarks/results/offline_throughput.json")
    args = p.parse_args(argv)
    if args.structured and (not args.skip_hf or args.peer or args.compare_dtype):
        p.error("--structured runs pagedserve alone: add --skip-hf, without --peer or --compare-dtype")

    from servicekit.model_registry import resolve_model
    from worker_service.loader import load_hf_config, resolve_dtype

    source = resolve_model(args.model)
    hf_config = load_hf_config(source)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, hf_config, device)
    from peer_vllm import cpu_flags, cpu_model  # beside this script

    print(f"load average at start {os.getloadavg()} on {os.cpu_count()} CPUs: figures are noisy when it exceeds them")
    print(f"CPU {cpu_model()}, flags {cpu_flags()}")
    gemm = None
    if device.type == "cpu":  # the compute limit's denominator, measured before anything else runs
        from compute_limit import gemm_rate

        from worker_service.models import model_class_for

        model_cfg = model_class_for(hf_config).config_from_hf(hf_config)
        gemm = gemm_rate(model_cfg, dtype)
    requests = make_requests(args.num_requests, args.seed, hf_config.vocab_size, tuple(args.prompt_len),
                             tuple(args.output_len))
    print(f"{len(requests)} requests: {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens; torch threads {torch.get_num_threads()}")

    result: dict[str, Any] = {
        "model": args.model,
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "num_requests": len(requests),
        "seed": args.seed,
        "prompt_len_range": list(args.prompt_len),
        "output_len_range": list(args.output_len),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_time_excluded": True,
        "engine_options": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                           "kv_cache_memory": args.kv_cache_memory},
    }
    # transformers first, then its model is dropped, so each phase's peak RSS is its own
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from servicekit.gguf_cache import hf_folder

        t0 = time.perf_counter()
        hf_source = hf_folder(source, weights=True)  # a GGUF file: its converted copy (the engine's too)
        hf_model = AutoModelForCausalLM.from_pretrained(hf_source.path, dtype=dtype,
                                                        **hf_source.from_pretrained_kwargs()).eval()
        result["hf_model_load_s"] = round(time.perf_counter() - t0, 3)
        pad = hf_config.pad_token_id if hf_config.pad_token_id is not None else 0
        if args.tune_malloc_for_transformers:
            from worker_service import cpu_memory

            cpu_memory.tune_malloc()
        result["hf_static"] = run_hf_static(hf_model, requests, args.hf_batch_size, pad)
        result["hf_static"]["malloc_tuned"] = args.tune_malloc_for_transformers
        print(f"transformers static batches of {args.hf_batch_size}: {result['hf_static']['output_tokens_per_s']} "
              f"useful output tok/s ({result['hf_static']['generate_s']} s, "
              f"peak RSS {result['hf_static']['peak_rss_bytes'] / 2**30:.2f} GiB)")
        del hf_model
        gc.collect()
    result["pagedserve"] = run_pagedserve(args.model, requests, args)
    print(f"pagedserve ({result['pagedserve']['dtype']}: {result['pagedserve']['dtype_reason']}): "
          f"{result['pagedserve']['output_tokens_per_s']} output tok/s "
          f"({result['pagedserve']['generate_s']} s, peak RSS {result['pagedserve']['peak_rss_bytes'] / 2**30:.2f} GiB, "
          f"{result['pagedserve']['num_blocks']} KV blocks, load average {result['pagedserve']['load_average_before_after']})")
    if gemm is not None:
        from compute_limit import compute_limit, describe

        result["pagedserve"]["compute_limit"] = compute_limit(
            model_cfg, [(len(r.prompt_token_ids), r.output_len) for r in requests], gemm,
            result["pagedserve"]["output_tokens_per_s"])
        print(describe(result["pagedserve"]["compute_limit"], result["dtype"]))
    if args.compare_dtype:
        gc.collect()
        other = run_pagedserve(args.model, requests, args, dtype=args.compare_dtype)
        result["pagedserve_compare"] = other
        result["vs_compare_dtype"] = round(result["pagedserve"]["output_tokens_per_s"] / other["output_tokens_per_s"], 2)
        print(f"pagedserve ({other['dtype']}): {other['output_tokens_per_s']} output tok/s ({other['generate_s']} s, "
              f"peak RSS {other['peak_rss_bytes'] / 2**30:.2f} GiB, load average {other['load_average_before_after']}); "
              f"{result['pagedserve']['dtype']} / {other['dtype']}: {result['vs_compare_dtype']}x")
    if "hf_static" in result:
        result["speedup"] = round(result["pagedserve"]["output_tokens_per_s"] / result["hf_static"]["output_tokens_per_s"], 2)
        print(f"speedup: {result['speedup']}x")
    print(f"load time excluded from throughput (reported separately): pagedserve engine init "
          f"{result['pagedserve']['engine_init_s']} s" +
          (f", transformers load {result['hf_model_load_s']} s" if "hf_model_load_s" in result else ""))

    if "llamacpp" in args.peer:
        if not source.gguf_file:
            raise SystemExit(f"--peer llamacpp needs a GGUF model; {args.model} resolves to {source.path}")
        peer = peer_llamacpp.run_peer(requests, os.path.join(source.path, source.gguf_file),
                                      binary=args.peer_binary, slots=args.peer_slots, threads=torch.get_num_threads())
        result["llamacpp"] = peer
        best = peer["best"]
        print(f"llama.cpp {peer['version']} (llama-cpp-python {peer['build'].get('llama_cpp_python', '?')}), "
              f"GGUF {peer['gguf']['file']} type {peer['gguf']['file_type']} {peer['gguf']['tensor_types']}")
        result["vs_llamacpp_best"] = round(result["pagedserve"]["output_tokens_per_s"] / best["output_tokens_per_s"], 2)
        print(f"pagedserve / llama.cpp best ({best['slots']} slots): {result['vs_llamacpp_best']}x")

    if "vllm" in args.peer:
        import peer_vllm  # beside this script

        from worker_service.config import parse_memory

        engine = dict(dtype=result["pagedserve"]["dtype"], enable_prefix_caching=True, enable_chunked_prefill=True,
                      seed=args.seed)
        matched = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        ours = result["pagedserve"]["speculation"]
        runs = {"matched": matched, "default": {},
                "ngram": {**matched, "speculative_config": {
                    "method": "ngram", "num_speculative_tokens": ours["num_speculative_tokens"] or 3,
                    "prompt_lookup_min": ours["prompt_lookup"][0], "prompt_lookup_max": ours["prompt_lookup"][1]}}}
        chosen = {"both": ["matched", "default"], "all": ["matched", "default", "ngram"]}.get(
            args.vllm_settings, [args.vllm_settings])
        result["vllm"] = {"rows": []}
        for name in chosen:
            row = peer_vllm.run_offline(args.model, requests, {**engine, **runs[name]},
                                        kv_cache_bytes=parse_memory(args.kv_cache_memory),
                                        threads=torch.get_num_threads())
            row["settings"] = name
            result["vllm"]["rows"].append(row)
            print(f"vLLM {row['vllm_version']} (CPU, {name} settings {runs[name] or 'its defaults'}): "
                  f"{row['output_tokens_per_s']} output tok/s ({row['generate_s']} s, peak RSS of its processes "
                  f"{row['peak_rss_bytes'] / 2**30:.2f} GiB; engine init {row['engine_init_s']} s, excluded); "
                  f"env {row['env']}")
        ours_rate = result["pagedserve"]["output_tokens_per_s"]
        plain = [r for r in result["vllm"]["rows"] if r["settings"] != "ngram"]
        if plain:
            best = max(plain, key=lambda r: r["output_tokens_per_s"])
            result["vllm"]["best"] = best
            result["vs_vllm_best"] = round(ours_rate / best["output_tokens_per_s"], 2)
            print(f"pagedserve / vLLM best ({best['settings']} settings): {result['vs_vllm_best']}x")
        for row in result["vllm"]["rows"]:
            if row["settings"] == "ngram":
                result["vs_vllm_ngram"] = round(ours_rate / row["output_tokens_per_s"], 2)
                print(f"pagedserve / vLLM with its n-gram speculation: {result['vs_vllm_ngram']}x")

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
