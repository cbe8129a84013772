"""The scheduler core: pure Python, standard library only (a test enforces it); compiled by mypyc
where ``make install`` could (``compiled``: the build of these sources runs when there is one)."""

from scheduler_service.core import compiled

compiled.activate(__path__)  # before any module of the core is imported

from scheduler_service.core.block_pool import BlockPool
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.kv_cache_utils import FreeBlockQueue, KVCacheBlock, hash_block_tokens
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler, SchedulerStats
from scheduler_service.core.waiting_queue import (
    FCFSWaitingQueue,
    OrderedWaitingQueue,
    PriorityWaitingQueue,
    create_waiting_queue,
)
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.scheduling import SchedulingConfig
from servicekit.contract.step import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from servicekit.contract.worker import WorkerDescription

__all__ = [
    "BlockPool", "CachedRequestData", "EngineCoreOutput", "FCFSWaitingQueue", "FinishReason", "FreeBlockQueue",
    "InvalidArgumentError", "KVCacheBlock", "KVCacheManager", "ModelRunnerOutput", "NewRequestData",
    "OrderedWaitingQueue",
    "PriorityWaitingQueue", "Request", "RequestStatus", "SamplingParams", "Scheduler", "SchedulingConfig",
    "SchedulerOutput", "SchedulerStats", "TokenLogprobs", "WorkerDescription", "create_waiting_queue", "hash_block_tokens",
]
