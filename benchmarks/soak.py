"""Load held for minutes: does anything grow?

Starts the stack as ``pagedserve serve`` does (Redis, one worker, the scheduler, a gateway; as
processes, on free loopback ports) and drives it for ``--minutes`` with ``--concurrency`` mixed
clients, each looping over a random kind of call:

- gRPC streams (the SDK), a fifth of them cancelled after a few tokens;
- OpenAI HTTP streams, a fifth of them disconnected after a few chunks;
- OpenAI HTTP whole completions and chats;
- now and then a request that must be refused: an out-of-range ``temperature``, a prompt longer
  than the model's context.

Every ``--sample-s`` seconds it samples every process's resident memory (``/proc/PID/status``
VmRSS). At the end, with the load stopped: the scheduler's block pools (every block free, nothing
running or waiting) and Redis (every key of a request carries a TTL). Reported: calls completed /
refused as expected / cancelled / failed, TTFT and TPOT percentiles per minute, each process's RSS
growth from the end of the warm-up (``--warmup-s``) to the end (goal: < 5 %), and a plot.

    python benchmarks/soak.py                    # 10 minutes
    python benchmarks/soak.py --minutes 3 --tag short

Results: ``benchmarks/results/soak[-<tag>].json`` and a PNG (RSS and TTFT over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tenant_fairness import cpu_flags  # noqa: E402
from ttft_fairness import percentile, save_figure, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("grpc-stream", "http-stream", "http-whole", "http-chat", "invalid")
WORDS = "the river carried boats past the mill while lamps were lit along the quay at dusk".split()


@dataclass
class Call:
    kind: str
    start: float  # s since the load began
    outcome: str = ""  # completed | refused | cancelled | failed
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str = ""


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))


async def one_call(kind: str, rng: random.Random, grpc_client, http_client, model: str, t0: float) -> Call:
    import openai

    from pagedserve.errors import InvalidArgumentError

    call = Call(kind, time.perf_counter() - t0)
    max_tokens = rng.randint(8, 64)
    started = time.perf_counter()
    stamps: list[float] = []
    try:
        if kind == "grpc-stream":
            cancel_after = rng.randint(2, 6) if rng.random() < 0.2 else None
            async with grpc_client.stream(prompt(rng), max_tokens=max_tokens, temperature=0.7) as stream:
                async for chunk in stream:
                    stamps += [time.perf_counter()] * len(chunk.token_ids)
                    if cancel_after is not None and len(stamps) >= cancel_after:
                        call.outcome = "cancelled"
                        break
        elif kind == "http-stream":
            cut_after = rng.randint(2, 6) if rng.random() < 0.2 else None
            stream = await http_client.completions.create(model=model, prompt=prompt(rng), max_tokens=max_tokens,
                                                          stream=True)
            async with stream:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        stamps.append(time.perf_counter())
                    if cut_after is not None and len(stamps) >= cut_after:
                        call.outcome = "cancelled"
                        break
        elif kind == "http-whole":
            reply = await http_client.completions.create(model=model, prompt=prompt(rng), max_tokens=max_tokens)
            stamps = [time.perf_counter()] * reply.usage.completion_tokens
        elif kind == "http-chat":
            reply = await http_client.chat.completions.create(
                model=model, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt(rng)}])
            stamps = [time.perf_counter()] * reply.usage.completion_tokens
        else:  # must be refused, by name
            if rng.random() < 0.5:
                await http_client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
            else:
                await grpc_client.generate(" ".join(WORDS * 1200), max_tokens=4)  # > max_model_len
            call.outcome, call.error = "failed", "an invalid request was accepted"
            return call
    except (openai.BadRequestError, InvalidArgumentError) as exc:
        call.outcome = "refused" if kind == "invalid" else "failed"
        call.error = "" if kind == "invalid" else str(exc)[:200]
        return call
    except Exception as exc:  # counted, shown, never fatal: the soak goes on
        call.outcome, call.error = "failed", f"{type(exc).__name__}: {str(exc)[:200]}"
        return call
    call.outcome = call.outcome or "completed"
    call.tokens = len(stamps)
    if stamps and kind.endswith("stream"):
        call.ttft = stamps[0] - started
        if len(stamps) > 1:
            call.tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return call


async def drive(address: str, http_url: str, model: str, args: argparse.Namespace, children) -> dict:
    import openai

    from pagedserve.aio_client import AsyncClient

    rng = random.Random(args.seed)
    calls: list[Call] = []
    samples: list[dict] = []
    t0 = time.perf_counter()
    end = t0 + args.minutes * 60
    weights = [0.35, 0.3, 0.15, 0.15, 0.05]

    async with AsyncClient(address, timeout=120) as grpc_client, \
            openai.AsyncOpenAI(base_url=http_url, api_key="unused", max_retries=0, timeout=120) as http_client:
        async def client(k: int) -> None:
            local = random.Random(rng.random())
            while time.perf_counter() < end:
                kind = local.choices(KINDS, weights)[0]
                calls.append(await one_call(kind, local, grpc_client, http_client, model, t0))

        async def sampler() -> None:
            while time.perf_counter() < end:
                samples.append({"t": time.perf_counter() - t0,
                                **{c.name: rss_kib(c.proc.pid) for c in children}})
                await asyncio.sleep(args.sample_s)

        await asyncio.gather(sampler(), *(client(k) for k in range(args.concurrency)))
    samples.append({"t": time.perf_counter() - t0, **{c.name: rss_kib(c.proc.pid) for c in children}})
    return {"calls": calls, "samples": samples, "seconds": time.perf_counter() - t0}


async def settle(scheduler_address: str, redis_url: str, prefix: str) -> dict:
    """With the load stopped: the block pools and Redis's keys."""
    import redis.asyncio as aioredis

    from pagedserve.admin import async_scheduler_stats

    deadline = time.monotonic() + 30
    while True:
        stats = await async_scheduler_stats(scheduler_address)
        free = all(w.all_free for w in stats.workers)
        if free or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    redis = aioredis.from_url(redis_url)
    try:
        persistent, with_ttl = [], 0
        async for key in redis.scan_iter(match=f"{prefix}*", count=1000):
            ttl = await redis.ttl(key)
            if ttl == -1:
                persistent.append(key.decode())
            else:
                with_ttl += 1
    finally:
        await redis.aclose()
    return {"all_blocks_free": free,
            "workers": [{"address": w.address, "free": w.num_free_blocks, "total": w.num_total_blocks,
                         "running": w.num_running, "waiting": w.num_waiting} for w in stats.workers],
            "keys_with_ttl": with_ttl, "keys_without_ttl": sorted(persistent)}


def summarize(run: dict, args: argparse.Namespace) -> dict:
    calls: list[Call] = run["calls"]
    outcomes = {o: sum(1 for c in calls if c.outcome == o) for o in ("completed", "refused", "cancelled", "failed")}
    per_minute = []
    for m in range(int(args.minutes + 0.999)):
        window = [c for c in calls if m * 60 <= c.start < (m + 1) * 60]
        ttfts = [c.ttft for c in window if c.ttft is not None]
        tpots = [c.tpot for c in window if c.tpot is not None]
        per_minute.append({"minute": m, "calls": len(window), "tokens": sum(c.tokens for c in window),
                           "ttft_p50": statistics.median(ttfts) if ttfts else None,
                           "ttft_p99": percentile(ttfts, 99) if ttfts else None,
                           "tpot_p50": statistics.median(tpots) if tpots else None,
                           "tpot_p99": percentile(tpots, 99) if tpots else None})
    samples = run["samples"]
    growth = {}
    warm = [s for s in samples if s["t"] >= args.warmup_s]
    for name in (k for k in samples[0] if k != "t"):
        values = [s[name] for s in warm if s.get(name)]
        if len(values) >= 2:
            growth[name] = {"rss_after_warmup_kib": values[0], "rss_end_kib": values[-1],
                            "rss_max_kib": max(values), "growth": values[-1] / values[0] - 1}
    failures = [asdict(c) for c in calls if c.outcome == "failed"][:20]
    return {"outcomes": outcomes, "per_minute": per_minute, "rss_growth": growth,
            "goal_rss_growth_below_5pct": all(g["growth"] < 0.05 for g in growth.values()),
            "failures_shown": failures, "seconds": run["seconds"]}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    samples = report["samples"]
    for name in (k for k in samples[0] if k != "t"):
        top.plot([s["t"] for s in samples], [(s[name] or 0) / 1024 for s in samples], label=name)
    top.set_ylabel("RSS (MiB)")
    top.legend()
    minutes = report["summary"]["per_minute"]
    bottom.plot([m["minute"] * 60 + 30 for m in minutes], [m["ttft_p50"] for m in minutes], marker="o", label="TTFT p50")
    bottom.plot([m["minute"] * 60 + 30 for m in minutes], [m["ttft_p99"] for m in minutes], marker="o", label="TTFT p99")
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("time since the load began (s)")
    bottom.legend()
    fig.suptitle("soak: every process's memory and the streams' TTFT")
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=24, help="clients calling at once")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=90.0,
                        help="RSS growth is counted from here (past --output-ttl-s: Redis holds a steady state)")
    parser.add_argument("--output-ttl-s", type=int, default=60,
                        help="the stack's output-stream TTL: finished requests' streams leave Redis after it, so "
                             "its memory levels off within the run (the default 600 s would take longer than it)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from pagedserve.launcher import Stack, StackConfig, free_port

    ports = {name: free_port() for name in ("port", "http_port", "scheduler_port", "worker_port", "redis_port")}
    config = StackConfig(model=args.model, host="127.0.0.1", log_level="WARNING", output_ttl_s=args.output_ttl_s,
                         **ports)
    print(f"load average {os.getloadavg()}, CPU flags {cpu_flags()}", flush=True)
    stack = Stack(config)
    started = time.perf_counter()
    try:
        address = stack.start()
        print(f"stack serving at {address} after {time.perf_counter() - started:.1f}s (not in any figure)", flush=True)
        http_url = f"http://127.0.0.1:{ports['http_port']}/v1"
        children = [c for c in stack.children]
        run = asyncio.run(drive(address, http_url, args.model, args, children))
        end_state = asyncio.run(settle(f"127.0.0.1:{ports['scheduler_port']}",
                                       f"redis://127.0.0.1:{ports['redis_port']}/0", config.key_prefix))
    finally:
        stack.stop()
    summary = summarize(run, args)
    report = {"config": vars(args), "machine": {"cpus": os.cpu_count(), "cpu_flags": cpu_flags(),
                                                "platform": platform.platform(), "load_after": os.getloadavg()},
              "summary": summary, "end_state": end_state, "samples": run["samples"]}
    print(json.dumps({"outcomes": summary["outcomes"], "rss_growth": summary["rss_growth"],
                      "goal_rss_growth_below_5pct": summary["goal_rss_growth_below_5pct"],
                      "end_state": end_state}, indent=1), flush=True)
    for m in summary["per_minute"]:
        print(json.dumps(m), flush=True)
    for failure in summary["failures_shown"][:5]:
        print("failed:", failure, flush=True)
    stem = "soak" + (f"-{args.tag}" if args.tag else "")
    write_report(report, RESULTS / f"{stem}.json", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
