"""What a worker is: the one description of a worker's facts, on every floor.

A worker answers ``Describe`` with it (worker.proto ``DescribeResponse``), registers it in Redis with
the address to dial (``servicekit.registry``), and a scheduler keeps one per driven worker and sizes
that worker's block pool and batch from it (docs/architecture.md, decision 4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# What a CPU worker states as ``prefill_chunk_attention_limit``. A chunk's attention grows with the
# context already cached: on a 2-core CPU 512 tokens after 7,500 cached ones took 3.8 s
# (SmolLM2-135M), 512 after none 0.4 s; 2^20 attended positions keep a step around a second at any
# context there. A GPU worker states 0 (no limit): its attention is cheap beside the rest of a step.
CPU_PREFILL_CHUNK_ATTENTION_LIMIT = 1 << 20


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    model: str  # the name it was started with (gateways match their --model against it)
    num_blocks: int  # KV-cache blocks, including the reserved null block 0
    block_size: int  # tokens per block
    max_model_len: int  # prompt + output tokens, at most
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int = 0  # rows of its persistent batch (0: not stated)
    max_num_batched_tokens: int = 0  # tokens per step at most (0: not stated)
    # key positions one prefill chunk should attend at most here (0: no limit / not stated)
    prefill_chunk_attention_limit: int = 0
    worker_id: str = ""  # its registry id
    address: str = ""  # host:port a scheduler dials (in the registry; empty in Describe answers)

    def at(self, *, worker_id: str, address: str = "") -> WorkerDescription:
        """The same worker under its registry id and address."""
        return replace(self, worker_id=worker_id, address=address)
