"""What frozen layers streamed from host memory (`stream_frozen`, `preinfer.stream_frozen`) and masters on disk
(`masters` disk) change in a visit's device and host bytes, and whether the streaming hides behind compute.

- Streamed: every frozen decoder layer a visit holds lives in host memory (pinned): its codes under a frozen
  dtype (its norms and biases stay on the device), else all its weights in the resident dtype. The device holds
  at most two of them at once (the one computing and the next being copied), so the device loses
  (frozen - 2) layers' streamed bytes and the host gains every frozen layer's. On a CPU device, the device is the
  host: nothing moves, nothing changes.
- Masters on disk: the frozen weights' masters are memory-mapped from safetensors files (the model's own, then the
  run's), not resident: the host column drops them (the kernel's page cache may hold what was read, but it can
  drop those pages again; they are no process memory that must fit).
- Hiding: the copy of layer i + 1 runs on a side stream while layer i computes. A step runs its micro-batches
  layer-major (one copy serves them all), so the copy of one layer, its bytes over the GPU's host-to-device rate
  (`pcie_gbs`, an achieved rate over pinned memory, not the link's raw one), is set against one layer's forward
  over the step's tokens, 2 x its parameters x tokens FLOPs at the GPU's peak x `mfu`: the shortest of a layer's
  phases (backward of a frozen layer computes its input's gradient, as many FLOPs again, plus the recomputed
  forward with `recompute`). The copy hides where it is no longer; `tokens_to_hide` is the fewest tokens per step
  for that.
"""

from __future__ import annotations

import math

from preinfer.memory.quantized import coded_layer_bytes, layer_tensors
from preinfer.memory.settings import DTYPES, GPUS, Settings
from preinfer.memory.shapes import ModelShape

RESIDENT_STREAMED = 2  # streamed layers on the device at once: the one computing and the next being copied


def streamed_layer_bytes(m: ModelShape, settings: Settings) -> int:
    """Bytes one streamed frozen layer moves to the device: its codes, or (frozen dtype auto) its weights."""
    w = DTYPES[settings.dtype]["weight"]
    if settings.frozen_dtype == "auto":
        return sum(layer_tensors(m)) * w
    return coded_layer_bytes(m, settings.frozen_dtype, w)


def streamed(m: ModelShape, settings: Settings, frozen: int, weights: int, host: int) -> tuple[int, int]:
    """Device weight bytes and host bytes of a visit with `frozen` frozen decoder layers held, from those without
    streaming and with masters in host memory (module docstring)."""
    if settings.masters == "disk":
        host = 0
    if not settings.stream_frozen or settings.host_device or frozen == 0:
        return weights, host
    layer = streamed_layer_bytes(m, settings)
    return weights - (frozen - min(RESIDENT_STREAMED, frozen)) * layer, host + frozen * layer


def stream_timing(m: ModelShape, settings: Settings) -> dict | None:
    """One streamed layer's copy against its forward over a step's tokens on the GPU (module docstring); None
    without streaming, on a CPU device, or for a GPU the table does not list."""
    gpu = GPUS.get(settings.gpu)
    if not settings.stream_frozen or settings.host_device or gpu is None or settings.gpu_mem_gb is not None:
        return None
    layer = streamed_layer_bytes(m, settings)
    copy_s = layer / (gpu["pcie_gbs"] * 1e9)
    rate = (gpu["tflops_fp32"] if settings.dtype == "float32" else gpu["tflops_bf16"]) * 1e12 * settings.mfu
    flops_per_token = 2 * m.layer_params()
    tokens = settings.micro_batch * settings.seq_len
    forward_s = flops_per_token * tokens / rate
    backward_s = forward_s * (2 if settings.recompute else 1)
    return dict(pcie=gpu["pcie"], pcie_gbs=gpu["pcie_gbs"], layer_bytes=layer, copy_ms=copy_s * 1e3,
                forward_ms=forward_s * 1e3, backward_ms=backward_s * 1e3, tokens=tokens, hides=copy_s <= forward_s,
                tokens_to_hide=math.ceil(copy_s * rate / flops_per_token))
