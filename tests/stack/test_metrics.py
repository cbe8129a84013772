"""Every service's Prometheus /metrics, scraped over HTTP and parsed with prometheus_client's own
parser: the counters and histograms move as the traffic the test sends says they must."""

from __future__ import annotations

import json
import math
import re

import openai
import pytest

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import InvalidArgumentError
from servicekit.metrics import TTFT_BUCKETS

from helpers.metrics import scrape
from helpers.stack import REPO, scheduler_stats, wait_until_kv_free

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]


async def test_gateway_counts_requests_tokens_and_latencies_of_grpc_and_http_calls(stack, hf_tokenizer):
    m = dict(model_name=stack.model)
    http_prompt, grpc_prompt = "Metrics over HTTP", "Metrics over gRPC"
    before = await scrape(stack.gateway.http_port)
    async with openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as client:
        await client.completions.create(model=stack.model, prompt=http_prompt, max_tokens=7, temperature=0,
                                        extra_body={"ignore_eos": True})
    async with AsyncClient(stack.gateway_address, timeout=60, multiplex=False) as sdk:  # a Generate call each
        await sdk.generate(grpc_prompt, max_tokens=5, ignore_eos=True)
        with pytest.raises(InvalidArgumentError):
            await sdk.generate("Hello", max_tokens=5, model="no-such-model")
    after = await scrape(stack.gateway.http_port)

    def moved(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    prompt_tokens = sum(len(hf_tokenizer(p)["input_ids"]) for p in (http_prompt, grpc_prompt))
    assert moved("pagedserve:request_success_total", finished_reason="length", **m) == 2
    assert moved("pagedserve:generation_tokens_total", **m) == 12
    assert moved("pagedserve:prompt_tokens_total", **m) == prompt_tokens
    assert moved("pagedserve:time_to_first_token_seconds_count", **m) == 2
    assert moved("pagedserve:e2e_request_latency_seconds_count", **m) == 2
    assert 1 <= moved("pagedserve:inter_token_latency_seconds_count", **m) <= 10  # <= tokens - 1 per request
    assert moved("pagedserve:e2e_request_latency_seconds_sum", **m) >= moved(
        "pagedserve:time_to_first_token_seconds_sum", **m) > 0
    assert moved("pagedserve:redis_round_trip_seconds_count", op="admit") == 2
    bounds = [float(ls["le"]) for ls in after.labels_of("pagedserve:time_to_first_token_seconds_bucket")]
    assert bounds == [*TTFT_BUCKETS, math.inf]  # vLLM's bounds: its dashboards apply
    assert after.get("pagedserve:gateway_streams_in_flight", **m) == 0

    generate = dict(grpc_service="pagedserve.v1.Generation", grpc_method="Generate", grpc_type="SERVER_STREAM")
    assert moved("grpc_server_started_total", **generate) == 2
    assert moved("grpc_server_handled_total", grpc_code="OK", **generate) == 1
    assert moved("grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **generate) == 1
    assert moved("grpc_server_handling_seconds_count", **generate) == 2

    # The SDK's default: both generations in one GenerateMany call, which ends OK when the client closes.
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        await sdk.generate(grpc_prompt, max_tokens=5, ignore_eos=True)
        with pytest.raises(InvalidArgumentError):
            await sdk.generate("Hello", max_tokens=5, model="no-such-model")
    later = await scrape(stack.gateway.http_port)
    many = dict(grpc_service="pagedserve.v1.Generation", grpc_method="GenerateMany", grpc_type="BIDI_STREAM")
    assert later.get("grpc_server_started_total", **many) - after.get("grpc_server_started_total", **many) == 1
    assert later.get("grpc_server_handled_total", grpc_code="OK", **many) - after.get(
        "grpc_server_handled_total", grpc_code="OK", **many) == 1
    assert later.get("pagedserve:request_success_total", finished_reason="length", **m) - after.get(
        "pagedserve:request_success_total", finished_reason="length", **m) == 1


async def test_scheduler_reports_routing_prefix_cache_and_queues_per_worker(stack):
    labels = dict(model_name=stack.model, worker=stack.worker.address)
    prompt = "Prefix caching is measured in tokens, looked up and hit. " * 4
    port = stack.scheduler.metrics_port
    assert port > 0
    before = await scrape(port)
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        first = await sdk.generate(prompt, max_tokens=2, ignore_eos=True)
        second = await sdk.generate(prompt, max_tokens=2, ignore_eos=True)
    await wait_until_kv_free(stack.scheduler_address)
    after = await scrape(port)

    def moved(name: str, **extra: str) -> float:
        return after.get(name, **labels, **extra) - before.get(name, **labels, **extra)

    assert moved("pagedserve:requests_routed_total") == 2
    queue_time = dict(model_name=stack.worker.info.model)
    assert after.get("pagedserve:request_queue_time_seconds_count", **queue_time) - before.get(
        "pagedserve:request_queue_time_seconds_count", **queue_time) == 2
    hits = moved("pagedserve:prefix_cache_hits_total")
    assert hits == second.usage.cached_prompt_tokens > 0 and first.usage.cached_prompt_tokens == 0
    assert moved("pagedserve:prefix_cache_queries_total") >= first.usage.prompt_tokens + hits
    assert moved("pagedserve:worker_steps_total") >= 2
    assert after.get("pagedserve:num_requests_running", **labels) == 0
    assert after.get("pagedserve:kv_cache_usage_perc", **labels) == 0.0
    assert after.get("pagedserve:worker_connected", **labels) == 1
    stats = await scheduler_stats(stack.scheduler_address)
    assert after.get("pagedserve:requests_dead_lettered_total") == stats.num_dead_lettered
    [worker_stats] = [w for w in stats.workers if w.address == stack.worker.address]
    assert after.get("pagedserve:worker_steps_ahead_total", **labels) == worker_stats.num_steps_ahead
    assert worker_stats.num_steps_ahead <= worker_stats.num_steps
    for name in ("num_requests_waiting", "num_preemptions_total", "requests_prefix_routed_total",
                 "requests_resumed_total", "worker_failovers_total", "requests_taken_over_total"):
        assert after.labels_of("pagedserve:" + name), name
    # The scheduler's own gRPC server: the Stats call above counted.
    stats_rpc = dict(grpc_service="pagedserve.v1.SchedulerAdmin", grpc_method="Stats", grpc_code="OK")
    assert (await scrape(port)).get("grpc_server_handled_total", **stats_rpc) >= after.get(
        "grpc_server_handled_total", **stats_rpc) + 1


async def test_worker_reports_steps_and_its_step_stream(stack):
    labels = dict(model_name=stack.worker.info.model, worker=stack.worker.address)
    port = stack.worker.metrics_port
    before = await scrape(port)
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        await sdk.generate("Worker metrics", max_tokens=6, ignore_eos=True)
    after = await scrape(port)

    assert after.get("pagedserve:worker_model_steps_total", **labels) - before.get(
        "pagedserve:worker_model_steps_total", **labels) >= 6  # a prefill, then one step per token
    assert after.get("pagedserve:worker_kv_blocks", **labels) == stack.worker.info.num_blocks
    step = dict(grpc_method="Step", grpc_type="BIDI_STREAM")
    assert after.get("grpc_server_started_total", **step) >= 1


async def test_every_metric_of_the_grafana_dashboard_is_served(stack):
    """deploy/grafana/pagedserve.json asks only for metrics some service serves."""
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        await sdk.generate("Dashboard", max_tokens=3, ignore_eos=True)
    served = set()
    for port in (stack.gateway.http_port, stack.scheduler.metrics_port, stack.worker.metrics_port):
        served |= {name for name, _labels, _value in (await scrape(port)).samples}
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pagedserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    asked = {name for expr in exprs for name in re.findall(r"\b(?:pagedserve:|grpc_server_)[a-z0-9_]+", expr)}
    assert len(asked) >= 20
    assert asked <= served, sorted(asked - served)
