"""Distributed start-up: joining torchrun's process group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from preinfer.errors import UsageError, first_line


def init_distributed(device: str) -> tuple[int, int]:
    """(rank, world size); under torchrun, joins the process group (NCCL on GPUs, gloo on CPU). With `--device
    cuda` (no index) each rank makes its local rank's GPU its current one, so that `cuda` means its own GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if world > 1 and not dist.is_initialized():
        join_process_group("nccl" if device.startswith("cuda") else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def join_process_group(backend: str) -> None:
    """Join torchrun's process group; a rendezvous that fails (the port taken, the address unreachable, a variable
    of torchrun's missing, the other ranks never coming) is one line naming where it met and what to do."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        dist.init_process_group(backend)
    except (dist.DistError, ValueError) as err:
        raise UsageError(f"rank {os.environ.get('RANK', '?')} of {os.environ['WORLD_SIZE']} cannot join the process "
                         f"group at MASTER_ADDR:MASTER_PORT {where} (torch.distributed: {first_line(err)}); start "
                         f"every rank with torchrun (a free --master-port, the same --nnodes), then run the same "
                         f"command again") from None
