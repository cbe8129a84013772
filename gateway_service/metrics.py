"""The gateway's Prometheus metrics: what a request's client sees, measured where its stream is
read (:meth:`GenerationService.generate`), so gRPC and HTTP calls count alike.

Names and meanings follow vLLM v1's frontend metrics with our prefix: token counters,
``request_success{finished_reason}``, and the latency histograms with vLLM's bucket bounds
(``servicekit.metrics``). Times run from the call's admission (Redis ``admit`` included), as
vLLM's run from the request's arrival at its engine client.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway_service.messages import GenerateChunk
from servicekit.metrics import ITL_BUCKETS, PREFIX, REDIS_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS


class GatewayMetrics:
    """The gateway's metrics in ``registry``, labelled with the served ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        label = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*label, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=registry).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.").labels(
            model_name)
        self._success = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))
        self._model = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time from admission to the first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's successive outputs.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from admission to the last token.",
                             REQUEST_LATENCY_BUCKETS)
        self.redis_admit = Histogram(PREFIX + "redis_round_trip_seconds", "Round trip of a Redis call.", ["op"],
                                     buckets=REDIS_BUCKETS, registry=registry).labels("admit")
        self.streams = Gauge(PREFIX + "gateway_streams_in_flight", "Generate calls (gRPC or HTTP) being streamed.",
                             label, registry=registry).labels(model_name)

    def finished(self, reason: str) -> None:
        self._success.labels(self._model, reason).inc()

    def start(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """One request's clock: started at admission, fed every chunk the client gets."""

    __slots__ = ("_m", "_start", "_last")

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._m = metrics
        self._start = time.perf_counter()
        self._last: float | None = None

    def chunk(self, chunk: GenerateChunk) -> None:
        now = time.perf_counter()
        if chunk.token_ids:
            if self._last is None:
                self._m.ttft.observe(now - self._start)
            else:
                self._m.itl.observe(now - self._last)
            self._last = now
        if chunk.finish_reason is not None and chunk.usage is not None:
            self._m.e2e.observe(now - self._start)
            self._m.prompt_tokens.inc(chunk.usage.prompt_tokens)
            self._m.generation_tokens.inc(chunk.usage.completion_tokens)
            self._m.finished(str(chunk.finish_reason))

    def client_left(self) -> None:
        """The call ended before its request finished (client gone, deadline): vLLM counts such
        requests as finished with reason ``abort``."""
        self._m.finished("abort")
