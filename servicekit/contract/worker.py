"""What a worker is: the one description of a worker's facts, on every floor.

A worker answers ``Describe`` with it (worker.proto ``DescribeResponse``), registers it in Redis with
the address to dial (``servicekit.registry``), and a scheduler keeps one per driven worker and sizes
that worker's block pool and batch from it (DESIGN.md decision 4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
    worker_id: str = ""  # its registry id
    address: str = ""  # host:port a scheduler dials (in the registry; empty in Describe answers)

    def at(self, *, worker_id: str, address: str = "") -> WorkerDescription:
        """The same worker under its registry id and address."""
        return replace(self, worker_id=worker_id, address=address)
