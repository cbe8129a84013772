"""gRPC channel options every client of a pagedserve service uses (the SDK, schedulers dialing
workers); servers add theirs on top (``servicekit.serving.SERVER_OPTIONS``)."""

from __future__ import annotations

# Large prompts travel whole in one message (a NewRequest carries every prompt token id).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer on a long-lived idle stream (Worker.Step) within ~30 s.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
