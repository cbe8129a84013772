"""The worker's Prometheus metrics, read from its servicer at each scrape (on the worker's event
loop, where they change): steps run, requests held, and the KV cache it was sized with. What the
KV blocks hold is the scheduler's to say (it allocates them): see ``scheduler_service.metrics``."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servicekit.metrics import PREFIX


class WorkerCollector(Collector):
    """Metric families of one worker (``servicer``: a ``WorkerServicer``), labelled with its
    ``model_name`` and ``worker`` (the address it advertises)."""

    def __init__(self, servicer, info, address: str) -> None:
        self._servicer = servicer
        self._labels = [info.model, address]
        self._info = info

    def collect(self) -> Iterator[Metric]:
        names = ["model_name", "worker"]
        steps = CounterMetricFamily(PREFIX + "worker_model_steps", "Model steps the worker ran.", labels=names)
        steps.add_metric(self._labels, self._servicer.num_steps)
        held = GaugeMetricFamily(PREFIX + "worker_requests_held", "Requests whose state the worker holds.",
                                 labels=names)
        held.add_metric(self._labels, self._servicer.num_held)
        blocks = GaugeMetricFamily(PREFIX + "worker_kv_blocks", "KV-cache blocks of the worker (null block "
                                   "included).", labels=names)
        blocks.add_metric(self._labels, self._info.num_blocks)
        yield from (steps, held, blocks)
