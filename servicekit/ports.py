"""The default ports of the stack (docs/architecture.md, "Defaults"), named once: each service's settings and
``pagedserve serve`` start from these."""

GATEWAY_PORT = 50051  # gRPC: pagedserve.v1.Generation
GATEWAY_HTTP_PORT = 8000  # the gateway's HTTP port (OpenAI API, /metrics)
SCHEDULER_PORT = 50052  # admin: stats + health
WORKER_PORT = 50061  # the first worker; the next ones count up
