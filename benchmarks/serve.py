"""Load generator for the served stack, through the SDK, compared with ``pagedserve.LLM`` in one
process on the same requests.

    python benchmarks/serve.py --start-stack --model smollm2-135m --num-requests 200 --llm
    python benchmarks/serve.py --start-stack --llm --num-requests 64 --input-len 256 --output-len 128 \
        --range-ratio 0.5 --torch-threads 2 --rounds 3     # the served-vs-in-process check
    (add --stream-interval 4: the scheduler publishes a request's tokens four at a time)
    python benchmarks/serve.py --address 127.0.0.1:50051 --request-rate 8
    python benchmarks/serve.py --start-stack --llm ... --num-layers 5    # the same on a 2-core AVX2 host
        at the AMX host's step time (benchmarks/truncated_model.py)
    python benchmarks/serve.py --start-stack --backend both     # gRPC SDK vs OpenAI HTTP API
    python benchmarks/serve.py --http-url http://127.0.0.1:8000/v1 --backend openai
    python benchmarks/serve.py --peer vllm -- --backend openai --endpoint /v1/completions \
        --dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0.5 \
        --num-prompts 64 --request-rate inf --ignore-eos --temperature 0   # beside vLLM, its load generator

Requests: random token-id prompts and output lengths drawn uniformly around ``--input-len`` /
``--output-len`` (``--range-ratio``), ``ignore_eos`` so every request produces its output length,
sent all at once (``--request-rate inf``) or as a Poisson process, through the gRPC SDK
(``--backend grpc``), the official ``openai`` client against the gateway's HTTP API
(``--backend openai``), or both in turn (``both``: the HTTP run gets prompts of the same lengths
with other token ids, so the prefix cache favours neither). Reports completed / failed,
request and output-token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median, p99)
as text and JSON (``benchmarks/results/serve-*.json``) with a PNG of the latency distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    seed: int
    structured_output: dict | None = None  # --structured: a JSON schema; it, not max_tokens, ends the request


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunk arrivals after the first
    error: str = ""


def make_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    # Ids from a middle slice of the vocabulary: no special tokens at the low end.
    lo, hi = min(1000, vocab_size // 4), vocab_size - 1
    return [BenchRequest([rng.randint(lo, hi) for _ in range(length(input_len))], length(output_len), i)
            for i in range(n)]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:  # not measured (the in-process engine has no chunk gaps): None, never a fake 0
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


def summarize(name: str, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    # The in-process engine gives TTFT and E2E per request but no chunk gaps: its ITL stays empty.
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1 and r.ttft > 0]
    return {
        "name": name, "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_token_throughput": output_tokens / duration if duration else 0.0,
        "total_output_tokens": output_tokens,
        "ttft_s": percentiles([r.ttft for r in done if r.ttft > 0]), "tpot_s": percentiles(tpot),
        "itl_s": percentiles([g for r in done for g in r.itl]), "e2e_s": percentiles([r.e2e for r in done]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


async def drive(requests: list[BenchRequest], rate: float, seed: int,
                chunks: Callable[[BenchRequest], AsyncIterator[tuple[int, bool]]]) -> tuple[list[RequestResult], float]:
    """Send ``requests`` (all at once, or as a Poisson process of ``rate``) and time each one's
    chunks: ``chunks(request)`` yields (tokens it adds to the count, whether output arrived)."""
    rng = random.Random(seed)

    async def one(req: BenchRequest, delay: float) -> RequestResult:
        await asyncio.sleep(delay)
        result = RequestResult(ok=False, prompt_len=len(req.prompt_token_ids))
        start = last = time.perf_counter()
        arrived_before = False
        try:
            async for new_tokens, arrived in chunks(req):
                now = time.perf_counter()
                if arrived:
                    if not arrived_before:
                        result.ttft, arrived_before = now - start, True
                    else:
                        result.itl.append(now - last)
                    last = now
                result.output_tokens += new_tokens
            result.e2e = time.perf_counter() - start
            result.ok = (0 < result.output_tokens <= req.max_tokens if req.structured_output
                         else result.output_tokens == req.max_tokens)
            if not result.ok:
                result.error = f"got {result.output_tokens} of {req.max_tokens} tokens"
        except Exception as exc:  # a failed request is counted, not fatal
            result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result

    delays, t = [], 0.0
    for _ in requests:
        delays.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    started = time.perf_counter()
    results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)))
    return list(results), time.perf_counter() - started


async def run_stack(address: str, requests: list[BenchRequest], rate: float, temperature: float,
                    seed: int, multiplex: bool = True) -> tuple[list[RequestResult], float]:
    from pagedserve.aio_client import AsyncClient

    async with AsyncClient(address, timeout=3600, multiplex=multiplex) as client:
        await client.generate([requests[0].prompt_token_ids[0]], max_tokens=2)  # warm-up

        async def chunks(req: BenchRequest) -> AsyncIterator[tuple[int, bool]]:
            async with client.stream(req.prompt_token_ids, max_tokens=req.max_tokens,
                                     ignore_eos=req.structured_output is None, structured_output=req.structured_output,
                                     temperature=temperature, seed=req.seed) as stream:
                async for chunk in stream:
                    yield len(chunk.token_ids), bool(chunk.token_ids)

        return await drive(requests, rate, seed, chunks)


def words_schema(num_tokens: int) -> dict:
    """A JSON schema of about ``num_tokens`` tokens' worth of output: an array of short lowercase words."""
    return {"type": "array", "minItems": max(1, num_tokens // 4), "maxItems": max(1, num_tokens // 4),
            "items": {"type": "string", "pattern": "^[a-z]{3,6}$"}}


def structured_requests(requests: list[BenchRequest]) -> list[BenchRequest]:
    """``--structured``: each request constrained by a JSON schema (:func:`words_schema`) sized to
    about its output length, with room past it for the grammar to end."""
    return [replace(r, max_tokens=2 * r.max_tokens, structured_output={"json": words_schema(r.max_tokens)})
            for r in requests]


def as_long_as(requests: list[BenchRequest], results: list[RequestResult]) -> list[BenchRequest]:
    """The requests unconstrained, each asking for the tokens its constrained run produced."""
    return [replace(r, structured_output=None, max_tokens=max(1, res.output_tokens)) for r, res in zip(requests, results)]


def fresh_tokens(requests: list[BenchRequest], vocab_size: int, seed: int) -> list[BenchRequest]:
    """The same requests (lengths, seeds) with other prompt token ids: no prefix-cache hits on the
    prompts of an earlier run."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab_size // 4), vocab_size - 1
    return [BenchRequest([rng.randint(lo, hi) for _ in r.prompt_token_ids], r.max_tokens, r.seed) for r in requests]


async def run_openai(base_url: str, model: str, requests: list[BenchRequest], rate: float, temperature: float,
                     seed: int) -> tuple[list[RequestResult], float]:
    """The same load through the official ``openai`` client, streamed, token counts from the
    ``include_usage`` chunk (a chunk's text arriving marks TTFT and ITL)."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600) as client:
        await client.completions.create(model=model, prompt=[requests[0].prompt_token_ids[0]], max_tokens=2)

        async def chunks(req: BenchRequest) -> AsyncIterator[tuple[int, bool]]:
            stream = await client.completions.create(
                model=model, prompt=req.prompt_token_ids, max_tokens=req.max_tokens, temperature=temperature,
                seed=req.seed, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                usage = chunk.usage.completion_tokens if chunk.usage is not None else 0
                yield usage, bool(chunk.choices and chunk.choices[0].text)

        return await drive(requests, rate, seed, chunks)


def load_llm(model: str, engine_options: dict):
    """The in-process engine, warmed up (one tiny request)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, **engine_options)
    llm.generate([[1000]], SamplingParams(max_tokens=2))
    return llm


def run_llm(llm, requests: list[BenchRequest], temperature: float) -> tuple[list[RequestResult], float]:
    """All requests at once through the in-process engine; TTFT, TPOT and E2E from each output's
    ``metrics`` (end of the step that produced the token, as the stack's client sees its chunk)."""
    from pagedserve import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=temperature, seed=r.seed)
              for r in requests]
    started = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    duration = time.perf_counter() - started
    results = []
    for o, r in zip(outputs, requests):
        m = o.metrics
        result = RequestResult(ok=len(o.token_ids) == r.max_tokens, prompt_len=len(r.prompt_token_ids),
                               output_tokens=len(o.token_ids))
        if m is not None and m.first_token_time is not None:
            result.ttft = m.first_token_time - m.arrival_time
            result.e2e = (m.finished_time or m.last_token_time) - m.arrival_time
        results.append(result)
    return results, duration


class CpuAccount:
    """CPU seconds each process of the run spent from now on: the stack's services (when this script
    started them) and this client. On a 2-core machine every second the others spend is a second the
    worker's GEMMs wait for.

    On Linux the figures are the scheduler's own per-thread accounts (``/proc/PID/task/*/schedstat``,
    nanoseconds): exact, where ``/proc/PID/stat``'s tick samples overcharge processes that wake on
    timers. They also give each process's *run-queue wait*: seconds its threads were ready to run but
    had no CPU (for the worker: how long its forward pass was held up by the other processes).
    Elsewhere: psutil's user + system times, and no wait figure."""

    def __init__(self, stack) -> None:
        import psutil

        self._procs = {"client (this benchmark)": psutil.Process()}
        for child in stack.children if stack is not None else []:
            self._procs[child.name] = psutil.Process(child.proc.pid)
        self._start = {name: self._total(p) for name, p in self._procs.items()}

    @staticmethod
    def _total(proc) -> tuple[float, float | None]:
        """(CPU seconds, run-queue wait seconds or None) of every live thread of ``proc``."""
        if not os.path.exists(f"/proc/{proc.pid}/schedstat"):  # not Linux, or no schedstat in this kernel
            t = proc.cpu_times()
            return t.user + t.system, None
        cpu_ns = wait_ns = 0
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    on_cpu, waited, _ = f.read().split()
            except OSError:
                continue  # the thread ended meanwhile
            cpu_ns += int(on_cpu)
            wait_ns += int(waited)
        return cpu_ns / 1e9, wait_ns / 1e9

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """(CPU seconds, run-queue wait seconds) per process since the start; the second is empty
        where the platform does not account waits. A thread that ended meanwhile is not counted."""
        cpu, waits = {}, {}
        for name, p in self._procs.items():
            (now_cpu, now_wait), (start_cpu, start_wait) = self._total(p), self._start[name]
            cpu[name] = round(now_cpu - start_cpu, 2)
            if now_wait is not None and start_wait is not None:
                waits[name] = round(now_wait - start_wait, 2)
        return cpu, waits


def ratio_summary(rounds: list[tuple[dict, dict]]) -> dict[str, float | list[float] | None]:
    """Stack over in-process output-token throughput, from paired rounds ``(stack summary,
    in-process summary)`` (``summarize``'s dicts): the per-round ratios of their
    ``output_token_throughput``, the ratios' median, their mean with its standard error (None for
    one round), and the pooled ratio (all rounds' tokens over all their time, each side). Single
    rounds on a shared 2-core host swing by several percent: the mean's error says how far a run
    can be trusted."""
    if not rounds:
        raise ValueError("ratio_summary: no rounds")

    def pooled(side: int) -> float:
        tokens = sum(pair[side]["total_output_tokens"] for pair in rounds)
        return tokens / max(sum(pair[side]["duration_s"] for pair in rounds), 1e-9)

    ratios = [stack["output_token_throughput"] / max(in_process["output_token_throughput"], 1e-9)
              for stack, in_process in rounds]
    stderr = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else None
    return {"rounds": ratios, "median": statistics.median(ratios), "mean": statistics.fmean(ratios),
            "stderr": stderr, "pooled": pooled(0) / max(pooled(1), 1e-9)}


def report(summary: dict) -> str:
    lines = [f"== {summary['name']} ==",
             f"completed {summary['completed']}  failed {summary['failed']}  in {summary['duration_s']:.2f}s",
             f"request throughput       {summary['request_throughput']:.2f} req/s",
             f"output token throughput  {summary['output_token_throughput']:.1f} tok/s"]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        p = summary[key]
        if p["mean"] is None:
            lines.append(f"{label:<5} ms  (not measured)")
            continue
        lines.append(f"{label:<5} ms  mean {p['mean'] * 1e3:8.1f}  median {p['median'] * 1e3:8.1f}  "
                     f"p99 {p['p99'] * 1e3:8.1f}")
    if summary.get("cpu_seconds"):
        lines.append("CPU seconds during the run: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in summary["cpu_seconds"].items())
                     + f" (wall {summary['duration_s']:.1f} s x {os.cpu_count()} CPUs)")
    if summary.get("cpu_wait_seconds"):
        lines.append("seconds ready to run but waiting for a CPU: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in summary["cpu_wait_seconds"].items()))
    if summary["errors"]:
        lines.append(f"errors: {summary['errors']}")
    return "\n".join(lines)


def plot(results: list[RequestResult], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, values, title in ((axes[0], [r.ttft * 1e3 for r in done], "TTFT (ms)"),
                              (axes[1], [g * 1e3 for r in done for g in r.itl], "ITL (ms)"),
                              (axes[2], [r.e2e for r in done], "end-to-end latency (s)")):
        ax.hist(values, bins=40)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servicekit.contract.scheduling import POLICIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="benchmark a running gateway")
    where.add_argument("--start-stack", action="store_true", help="start `pagedserve serve` for the run")
    where.add_argument("--http-url", help="benchmark a running gateway's HTTP API (base URL, e.g. "
                                          "http://127.0.0.1:8000/v1); implies --backend openai")
    where.add_argument("--peer", choices=("vllm",),
                       help="start vLLM's CPU backend (`vllm serve`, make peer-vllm) and then `pagedserve serve`, and "
                            "drive each with vLLM's own `vllm bench serve` and the arguments after `--` (the same for "
                            "both); results side by side")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="--peer vllm: pagedserve's draft tokens per step (n-gram speculation; default: its own, "
                             "0: off)")
    parser.add_argument("--policy", choices=POLICIES, default=None,
                        help="--peer vllm and --start-stack: pagedserve's scheduling policy (default: its own, spf; "
                             "lpm: the longest cached prompt prefix first; spf: the fewest prompt tokens left to "
                             "compute first)")
    parser.add_argument("--vllm-ngram", action="store_true",
                        help="--peer vllm: run vllm serve with its own n-gram speculation at pagedserve's draft "
                             "settings (--speculative-config)")
    parser.add_argument("--backend", choices=("grpc", "openai", "both"), default="grpc",
                        help="gRPC SDK, the OpenAI HTTP API through the openai client, or both in turn")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in mean*(1±ratio)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="batch size (stack worker and LLM)")
    parser.add_argument("--kv-cache-memory", default="", help="KV budget for both, e.g. 2GiB")
    parser.add_argument("--llm", action="store_true", help="also run pagedserve.LLM on the same requests")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="intra-op threads for the worker and the in-process engine alike (0: torch's default)")
    parser.add_argument("--stream-interval", type=int, default=0,
                        help="with --start-stack: the scheduler's --stream-interval (tokens per published record; "
                             "0: the scheduler's default, 1)")
    parser.add_argument("--multiplex", choices=("on", "off"), default="on",
                        help="the SDK's streams over one GenerateMany call (on, its default) or a Generate call each")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="with --start-stack: one more flag for the worker, e.g. "
                             "--worker-arg=--simulate-step-latency=0.005,0 (no model: the services' own cost)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the runs this many times, alternating stack and --llm on fresh prompts "
                             "(the machine's speed drifts between runs: each pair compares fairly; the ratio's median, "
                             "mean with its standard error, and pooled ratio are printed and saved)")
    parser.add_argument("--num-layers", type=int, default=0,
                        help="with --start-stack: serve (and load in process) only the model's first N decoder layers, "
                             "for a fast CPU's step time on a slow one (0: the whole model)")
    parser.add_argument("--structured", action="store_true",
                        help="gRPC: every request constrained by a JSON schema, then the same requests unconstrained "
                             "with the output lengths the constrained run produced (new prompt ids): the ratio is "
                             "what structured output costs")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.peer:
        return serve_vs_peer(args, bench_args)

    from servicekit.model_registry import resolve_model

    if args.num_layers:
        if not args.start_stack:
            parser.error("--num-layers cuts the model of the stack this script starts (--start-stack)")
        import atexit
        import shutil
        import tempfile

        from truncated_model import first_layers

        folder = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        name = f"{Path(args.model).name}-{args.num_layers}-layers"
        args.model = first_layers(args.model, args.num_layers, folder / name)
        print(f"model: {args.model}", flush=True)
    if args.torch_threads:  # the stack's processes inherit it; the in-process engine is set below
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    if args.stream_interval:
        if not args.start_stack:
            parser.error("--stream-interval is set on the stack this script starts (--start-stack)")
        os.environ["PAGEDSERVE_STREAM_INTERVAL"] = str(args.stream_interval)

    engine_options = {"max_num_seqs": args.max_num_seqs}
    if args.kv_cache_memory:
        engine_options["kv_cache_memory"] = args.kv_cache_memory
    vocab_size = _vocab_size(resolve_model(args.model))
    requests = make_requests(args.num_requests, args.input_len, args.output_len, args.range_ratio, vocab_size,
                             args.seed)
    summaries = []
    pairs: list[tuple[dict, dict]] = []  # (stack, in-process) summaries of each round
    stack = None
    if args.http_url:
        args.backend = "openai"
    elif args.address and args.backend != "grpc":
        parser.error("--backend openai/both with --address: give the HTTP API as --http-url instead")
    try:
        address, http_url = args.address, args.http_url
        if args.start_stack:
            from pagedserve.launcher import Stack, StackConfig, free_port

            http_port = free_port()
            stack = Stack(StackConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                                      kv_cache_memory=args.kv_cache_memory or None, port=free_port(),
                                      http_port=http_port, scheduler_port=free_port(), worker_port=free_port(),
                                      log_level="WARNING", worker_args=tuple(args.worker_arg),
                                      **({} if args.policy is None else {"policy": args.policy})))
            address = stack.start()
            http_url = f"http://127.0.0.1:{http_port}/v1"
        llm = None
        if args.llm:  # loaded now, so the rounds below alternate the stack and it on the same machine state
            if args.torch_threads:
                import torch

                torch.set_num_threads(args.torch_threads)
            llm = load_llm(args.model, engine_options)
        print(f"load average before: {os.getloadavg()}", flush=True)
        for round_index in range(args.rounds):
            # Each round's prompts are new to both (no prefix-cache hits on an earlier round's).
            round_requests = requests if round_index == 0 else fresh_tokens(requests, vocab_size,
                                                                            args.seed + 100 + round_index)
            label = f" round {round_index + 1}" if args.rounds > 1 else ""
            if args.structured:
                constrained = structured_requests(round_requests)
                results, duration = asyncio.run(run_stack(address, constrained, args.request_rate,
                                                          args.temperature, args.seed, args.multiplex == "on"))
                summaries.append(summarize("stack, JSON schema" + label, results, duration))
                print(report(summaries[-1]), flush=True)
                free = fresh_tokens(as_long_as(constrained, results), vocab_size, args.seed + 7)
                results, duration = asyncio.run(run_stack(address, free, args.request_rate,
                                                          args.temperature, args.seed, args.multiplex == "on"))
                summaries.append(summarize("stack, unconstrained" + label, results, duration))
                print(report(summaries[-1]), flush=True)
                ratio = summaries[-2]["output_token_throughput"] / max(summaries[-1]["output_token_throughput"], 1e-9)
                print(f"JSON schema / unconstrained output-token throughput{label}: {ratio:.1%} (goal >= 80%)",
                      flush=True)
                continue
            if args.backend in ("grpc", "both"):
                cpu = CpuAccount(stack)
                results, duration = asyncio.run(run_stack(address, round_requests, args.request_rate,
                                                          args.temperature, args.seed, args.multiplex == "on"))
                summaries.append(summarize("stack (gRPC SDK)" + label, results, duration))
                summaries[-1]["cpu_seconds"], summaries[-1]["cpu_wait_seconds"] = cpu.take()
                print(report(summaries[-1]), flush=True)
            if args.backend in ("openai", "both"):
                http_requests = (fresh_tokens(round_requests, vocab_size, args.seed + 1) if args.backend == "both"
                                 else round_requests)
                served_name = args.model if args.http_url is None else _served_model(http_url)
                cpu = CpuAccount(stack)
                results, duration = asyncio.run(run_openai(http_url, served_name, http_requests,
                                                           args.request_rate, args.temperature, args.seed))
                summaries.append(summarize("stack (OpenAI HTTP)" + label, results, duration))
                summaries[-1]["cpu_seconds"], summaries[-1]["cpu_wait_seconds"] = cpu.take()
                print(report(summaries[-1]), flush=True)
            if args.backend == "both":
                grpc_run, http_run = summaries[-2], summaries[-1]
                print(f"HTTP / gRPC output-token throughput: "
                      f"{http_run['output_token_throughput'] / max(grpc_run['output_token_throughput'], 1e-9):.1%}; "
                      f"median TTFT {http_run['ttft_s']['median'] * 1e3:.1f} ms vs "
                      f"{grpc_run['ttft_s']['median'] * 1e3:.1f} ms (goal: HTTP within 10%)")
            if llm is not None:
                served = summaries[-1]
                cpu = CpuAccount(None)
                llm_results, llm_duration = run_llm(llm, round_requests, args.temperature)
                summaries.append(summarize("LLM (in-process)" + label, llm_results, llm_duration))
                summaries[-1]["cpu_seconds"], summaries[-1]["cpu_wait_seconds"] = cpu.take()
                print(report(summaries[-1]))
                pairs.append((served, summaries[-1]))
                ratio = ratio_summary(pairs[-1:])["rounds"][0]
                print(f"stack / in-process output-token throughput{label}: {ratio:.1%} (goal >= 95%)", flush=True)
        if len(pairs) > 1:
            over = ratio_summary(pairs)
            print(f"stack / in-process over {len(pairs)} rounds: " + ", ".join(f"{r:.1%}" for r in over["rounds"])
                  + f"; median {over['median']:.1%}, mean {over['mean']:.1%} (standard error {over['stderr']:.1%}), "
                  f"pooled {over['pooled']:.1%} (goal >= 95%)")
        print(f"load average after: {os.getloadavg()}", flush=True)
    finally:
        if stack is not None:
            stack.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"serve-{Path(args.model).name}-n{args.num_requests}-r{args.request_rate}{'-' + args.tag if args.tag else ''}"
    payload = {"config": vars(args), "results": summaries}
    if pairs:
        payload["stack_over_in_process"] = ratio_summary(pairs)
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str))
    plot(results, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')}")
    return 0


def serve_vs_peer(args: argparse.Namespace, bench_args: list[str]) -> int:
    """``--peer vllm``: the same ``vllm bench serve`` arguments against ``vllm serve`` and ``pagedserve
    serve`` (benchmarks/peer_vllm.py), with the batch settings of this script's flags for both."""
    import peer_vllm

    import torch

    from worker_service.config import parse_memory
    from worker_service.loader import choose_dtype

    if not bench_args:
        raise SystemExit("--peer vllm: give `vllm bench serve` arguments after `--`, e.g. -- --backend openai "
                         "--endpoint /v1/completions --dataset-name random --random-input-len 256 "
                         "--random-output-len 128 --num-prompts 64 --request-rate inf --ignore-eos --temperature 0")
    threads = args.torch_threads or len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    result = peer_vllm.compare_served(
        args.model, bench_args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
        dtype=choose_dtype("auto", torch.device("cpu")).name,
        kv_cache_bytes=parse_memory(args.kv_cache_memory or "1GiB"), threads=threads, out=args.out,
        tag=f"-{args.tag}" if args.tag else "", num_speculative_tokens=args.num_speculative_tokens,
        vllm_ngram=args.vllm_ngram, policy=args.policy)
    for name in ("pagedserve", "vllm"):
        r = result[name]
        print(f"{name:10s} {r['output_throughput']:8.1f} output tok/s  TTFT median {r['median_ttft_ms']:8.1f} ms "
              f"p99 {r['p99_ttft_ms']:8.1f}  TPOT median {r['median_tpot_ms']:6.1f} ms  completed {r['completed']}")
    print(f"pagedserve / vLLM: {result['ratios']}; load average at start {result['load_average_at_start']}, "
          f"CPU {result['cpu']}, flags {result['cpu_flags']}; wrote {result['path']}")
    return 0


def _served_model(base_url: str) -> str:
    """The model a running gateway serves (its /v1/models)."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def _vocab_size(source) -> int:
    from worker_service.loader import load_hf_config

    return load_hf_config(source).vocab_size


if __name__ == "__main__":
    sys.exit(main())
