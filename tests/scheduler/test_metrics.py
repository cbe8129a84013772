"""The scheduler's per-tenant metrics (``scheduler_service.metrics.RequestMetrics``): tokens and
queue time with the tenant as a label, the label set bounded whatever tenants clients name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from helpers.metrics import Scrape
from scheduler_service.metrics import RequestMetrics


def scrape(registry: CollectorRegistry) -> Scrape:
    return Scrape(generate_latest(registry).decode())


def test_tokens_and_queue_time_per_tenant_with_a_bounded_label_set():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, max_tenants=2)
    metrics.finished("m", {"team-a": [100, 20], "": [7, 3]})
    metrics.queue_time("m", "team-a", 0.5)
    # every later tenant counts as "other": a client's user field cannot grow the label set
    for i in range(50):
        metrics.finished("m", {f"user-{i}": [1, 2]})
        metrics.queue_time("m", f"user-{i}", 0.1)
    metrics.finished("m", {"team-a": [1, 1]})  # a tenant seen first keeps its own label

    got = scrape(registry)
    assert got.get("pagedserve:tenant_prompt_tokens_total", tenant="team-a") == 101
    assert got.get("pagedserve:tenant_generation_tokens_total", tenant="team-a") == 21
    assert got.get("pagedserve:tenant_prompt_tokens_total", tenant="default") == 7  # tenant "" (no key, no user)
    assert got.get("pagedserve:tenant_prompt_tokens_total", tenant="other") == 50
    assert got.get("pagedserve:tenant_generation_tokens_total", tenant="other") == 100
    assert got.get("pagedserve:request_queue_time_seconds_count", tenant="other") == 50
    assert got.get("pagedserve:request_queue_time_seconds_count", tenant="team-a") == 1
    tenants = {labels["tenant"] for labels in got.labels_of("pagedserve:tenant_prompt_tokens_total")}
    assert tenants == {"team-a", "default", "other"}
