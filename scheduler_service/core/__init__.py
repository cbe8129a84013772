"""The scheduler core: pure Python, standard library only (a test enforces it)."""

from scheduler_service.core.block_pool import BlockPool
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.kv_cache_utils import FreeBlockQueue, KVCacheBlock, hash_block_tokens
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from scheduler_service.core.scheduler import Scheduler, SchedulerStats
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
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
    "BlockPool", "CachedRequestData", "EngineCoreOutput", "FCFSRequestQueue", "FinishReason", "FreeBlockQueue",
    "InvalidArgumentError", "KVCacheBlock", "KVCacheManager", "ModelRunnerOutput", "NewRequestData",
    "PriorityRequestQueue", "Request", "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "SchedulerStats", "TokenLogprobs", "WorkerDescription", "create_request_queue", "hash_block_tokens",
]
