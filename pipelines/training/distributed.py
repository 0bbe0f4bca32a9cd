"""Distributed start-up: joining torchrun's process group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(device: str) -> int:
    """This process's rank; under torchrun, joins the process group (NCCL on GPUs, gloo on CPU). With `--device
    cuda` (no index) each rank makes its local rank's GPU its current one, so that `cuda` means its own GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank() if dist.is_initialized() else 0
