"""The scheduler core: pure Python, standard library only (a test enforces it)."""

from scheduler_service.core.block_pool import BlockPool
from scheduler_service.core.config import SchedulerConfig
from servicekit.contract.errors import InvalidArgumentError
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.kv_cache_utils import FreeBlockQueue, KVCacheBlock, hash_block_tokens
from servicekit.contract.step import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
    WorkerInfo,
)
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from servicekit.contract.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler, SchedulerStats

__all__ = [
    "BlockPool", "CachedRequestData", "EngineCoreOutput", "FCFSRequestQueue", "FinishReason", "FreeBlockQueue",
    "InvalidArgumentError", "KVCacheBlock", "KVCacheManager", "ModelRunnerOutput", "NewRequestData",
    "PriorityRequestQueue", "Request", "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "SchedulerStats", "TokenLogprobs", "WorkerInfo", "create_request_queue", "hash_block_tokens",
]
