"""The scheduler's Prometheus metrics, read from :meth:`SchedulerApp.stats` at each scrape.

Pulled, not pushed (all but :class:`RequestMetrics`, observed by each ``WorkerEngine``): the
scheduler's counters and queue lengths already exist (the ``Stats`` RPC
shows them), so a collector turns one consistent snapshot into metric families, and no code in
the scheduling path changes for metrics. The scrape runs on the scheduler's event loop
(``servicekit.metrics.MetricsPort``), where the counters are only ever changed.

Names follow vLLM v1 (``num_requests_running``, ``kv_cache_usage_perc``, ``prefix_cache_*``,
``num_preemptions``), per worker (label ``worker``: its address) and model (``model_name``); the
rest are ours: routing, failover and takeover counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servicekit.metrics import PREFIX, REQUEST_LATENCY_BUCKETS


DEFAULT_TENANT_LABEL = "default"  # the label of tenant "" (no keys, no user field)
OTHER_TENANTS_LABEL = "other"  # the label of every tenant past the bound


class RequestMetrics:
    """What each ``WorkerEngine`` observes of its requests: vLLM's ``request_queue_time_seconds``
    (arrival at the gateway to first scheduling) and, per tenant, the prompt and generated tokens
    of finished requests (``tenant_prompt_tokens`` / ``tenant_generation_tokens``). The tenant is a
    label: the first ``max_tenants`` tenants seen keep their own, every later one counts as
    ``other`` (a tenant may be a client's ``user`` field: the label set stays bounded)."""

    def __init__(self, registry: CollectorRegistry, max_tenants: int) -> None:
        labels = ["model_name", "tenant"]
        self._queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Time from arrival to first scheduling.",
                                     labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry)
        self._prompt = Counter(PREFIX + "tenant_prompt_tokens", "Prompt tokens of finished requests "
                               "(aborted ones included), per tenant.", labels, registry=registry)
        self._generation = Counter(PREFIX + "tenant_generation_tokens", "Tokens generated for finished requests "
                                   "(aborted ones included), per tenant.", labels, registry=registry)
        self._max_tenants = max_tenants
        self._labels: dict[str, str] = {}

    def label(self, tenant: str) -> str:
        """The tenant's label value: its own while within the bound, else ``other``."""
        label = self._labels.get(tenant)
        if label is None:
            label = OTHER_TENANTS_LABEL
            if len(self._labels) < self._max_tenants:
                label = self._labels[tenant] = tenant or DEFAULT_TENANT_LABEL
        return label

    def queue_time(self, model: str, tenant: str, seconds: float) -> None:
        self._queue_time.labels(model, self.label(tenant)).observe(seconds)

    def finished(self, model: str, usage: dict[str, list[int]]) -> None:
        """``usage``: ``{tenant: [prompt tokens, generated tokens]}`` (``Scheduler.take_tenant_usage``)."""
        for tenant, (num_prompt, num_generated) in usage.items():
            label = self.label(tenant)
            self._prompt.labels(model, label).inc(num_prompt)
            self._generation.labels(model, label).inc(num_generated)


class SchedulerCollector(Collector):
    """Metric families from ``stats()`` (a ``scheduler_service.service.ServiceStats``)."""

    def __init__(self, stats: Callable[[], object]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        labels = ["model_name", "worker"]

        def family(kind, name: str, doc: str, value: Callable) -> Metric:
            metric = kind(PREFIX + name, doc, labels=labels)
            for w in stats.workers:
                if w.core is not None:
                    metric.add_metric([w.model, w.address], value(w))
            return metric

        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the worker's running batch.",
                     lambda w: w.core.num_running)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting for the worker (preempted "
                     "ones included).", lambda w: w.core.num_waiting)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of the worker's KV blocks in use "
                     "(1 = full).", lambda w: w.core.kv_cache_usage)
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     lambda w: w.core.prefix_cache_queries)
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda w: w.core.prefix_cache_hits)
        yield family(CounterMetricFamily, "num_preemptions", "Requests that lost their KV blocks and started over.",
                     lambda w: w.core.num_preemptions)
        yield family(CounterMetricFamily, "worker_steps", "Steps the scheduler ran on the worker.",
                     lambda w: w.num_steps)
        yield family(CounterMetricFamily, "worker_steps_ahead",
                     "Of those, planned and sent while the step before ran (--async-scheduling).",
                     lambda w: w.num_steps_ahead)
        yield family(CounterMetricFamily, "requests_routed", "Requests the scheduler placed on the worker.",
                     lambda w: w.num_routed)
        yield family(CounterMetricFamily, "requests_prefix_routed", "Of those, placed there for a prefix-cache hit.",
                     lambda w: w.num_routed_prefix_hit)
        connected = GaugeMetricFamily(PREFIX + "worker_connected", "1 while the scheduler drives the worker.",
                                      labels=labels)
        for w in stats.workers:
            connected.add_metric([w.model, w.address], 1.0 if w.connected else 0.0)
        yield connected
        for name, doc, value in (
                ("scheduler_requests_finished", "Requests finished on this scheduler's workers.", stats.num_finished),
                ("scheduler_requests_aborted", "Of those, aborted (client gone, stop string, deadline).",
                 stats.num_aborted),
                ("requests_resumed", "Requests of a lost worker placed again (worker failover).", stats.num_resumed),
                ("worker_failovers", "Workers lost while holding requests.", stats.num_worker_failovers),
                ("requests_taken_over", "Requests this scheduler took over from dead schedulers.",
                 stats.num_reclaimed),
                ("requests_lost_to_takeover", "Requests this scheduler held that another scheduler took over.",
                 stats.num_taken_over),
                ("requests_dead_lettered", "Requests given up after too many takeovers.", stats.num_dead_lettered)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
