"""The worker's device-memory rules: the CUDA KV budget (free memory minus a stated headroom) and the
per-step host→device inputs (zero-copy on the CPU). The CUDA memory query is the one thing faked:
no GPU here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.factories import make_hf_config
from worker_service.config import ModelRunnerConfig
from worker_service.kv_cache import activation_reserve, bytes_per_block, cuda_kv_budget, determine_num_blocks
from worker_service.model_runner import _to
from worker_service.models import model_class_for

GIB = 1 << 30


def test_budget_is_free_memory_minus_headroom_and_reserve():
    # 80 GiB device, 60 GiB free after the weights, 10 % headroom (8 GiB), 1 GiB activations
    assert cuda_kv_budget(60 * GIB, 80 * GIB, 0.9, 1 * GIB) == 51 * GIB
    # the whole device may be used: only the reserve is kept back
    assert cuda_kv_budget(60 * GIB, 80 * GIB, 1.0, 1 * GIB) == 59 * GIB


def test_budget_goes_non_positive_when_the_device_is_already_fuller_than_the_headroom_allows():
    # another process holds most of the device: 5 GiB free is less than the 8 GiB headroom
    assert cuda_kv_budget(5 * GIB, 80 * GIB, 0.9, 0) < 0


def test_cuda_block_count_comes_from_free_memory_minus_headroom(monkeypatch):
    cfg = model_class_for(make_hf_config()).config_from_hf(make_hf_config())
    config = ModelRunnerConfig(model="tiny", block_size=16, max_num_seqs=4096, gpu_memory_fraction=0.5)
    per_block = bytes_per_block(cfg, 16, torch.bfloat16)
    free, total = 3 * GIB, 4 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    blocks = determine_num_blocks(config, cfg, torch.bfloat16, torch.device("cuda"), max_model_len=1024)

    budget = cuda_kv_budget(free, total, 0.5, activation_reserve(config, cfg, torch.bfloat16))
    assert blocks == budget // per_block
    assert blocks * per_block <= free - total // 2  # never into the headroom


def test_cuda_budget_too_small_for_two_blocks_is_an_error(monkeypatch):
    cfg = model_class_for(make_hf_config()).config_from_hf(make_hf_config())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * GIB, 10 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(ValueError, match="at least 2"):
        determine_num_blocks(ModelRunnerConfig(model="tiny"), cfg, torch.bfloat16, torch.device("cuda"), 1024)


def test_cpu_step_inputs_are_zero_copy_views():
    array = np.arange(6, dtype=np.int64)
    tensor = _to(array, torch.device("cpu"))
    array[0] = 42
    assert tensor[0].item() == 42 and not tensor.is_pinned()
