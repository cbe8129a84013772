"""The gateway's settings: one frozen dataclass, built once in ``main()`` from flags and
``PAGEDSERVE_*`` environment variables (STYLE.md habit 4)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from servicekit.redis_keys import RedisKeys

DEFAULT_PORT = 50051


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    model: str = "smollm2-135m"  # tokenizer source; must be the name the workers were started with
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 picks a free port
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "ps:"
    max_queued_requests: int = 1024  # requests waiting in Redis before RESOURCE_EXHAUSTED; 0 = no limit
    output_ttl_s: int = 600  # output streams live this long after their last entry (resume window)
    registry_refresh_s: float = 2.0
    read_block_ms: int = 1000  # longest blocking XREAD of the fan-out loop
    redis_outage_s: float = 10.0  # streams fail with UNAVAILABLE after this long without Redis
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names the wake stream
    drain_grace_s: float = 30.0
    # The most UTF-8 bytes one token covers, as far as sizing goes: text over max_model_len times
    # this is refused before it is tokenized. 16 leaves room for long tokens (runs of spaces in
    # code); English averages ~4 bytes per token.
    prompt_bytes_per_token: int = 16

    def __post_init__(self) -> None:
        RedisKeys(self.key_prefix)
        if not self.model:
            raise ValueError("model: must be non-empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {self.max_queued_requests}")
        if self.redis_outage_s <= 0:
            raise ValueError(f"redis_outage_s: must be positive, got {self.redis_outage_s}")
        if self.prompt_bytes_per_token < 1:
            raise ValueError(f"prompt_bytes_per_token: must be >= 1, got {self.prompt_bytes_per_token}")
        if self.output_ttl_s < 1 or self.registry_refresh_s <= 0 or self.read_block_ms < 1:
            raise ValueError("output_ttl_s, registry_refresh_s and read_block_ms must be positive")
