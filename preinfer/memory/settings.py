"""The planner's inputs beside the model shape: the GPU table, bytes per parameter and per activation element of
each dtype, and `Settings`."""

from __future__ import annotations

from dataclasses import dataclass

from preinfer.config.choices import DEFAULT_ATTENTION, DEFAULT_LOSS_CHUNK


GB = 10**9  # GPU memory is sold in decimal gigabytes (a "24 GB" RTX 4090 has 24e9 bytes, about 22.4 GiB)
GIB = 2**30

# Fraction of a GPU's memory a training process can fill with tensors: the CUDA context (~0.5 GB), cuBLAS
# workspaces and the caching allocator's fragmentation take the rest (assumption: about 10%).
USABLE_FRACTION = 0.9

# GPU table: memory, dense peak TFLOPS in bf16 (tensor cores, fp32 accumulate) and in float32 (no TF32, PyTorch's
# default for float32 matmuls), $/hour from the reference paper's cloud prices (None where it gives none), and the
# host link: its PCIe generation and width, and the host-to-device rate in GB/s a pinned copy achieves over it
# (about 80% of the link's raw rate: PCIe 4.0 x16 is 31.5 GB/s raw, about 25 achieved; 3.0 x16 15.8, about 12).
PCIE3, PCIE4 = dict(pcie="PCIe 3.0 x16", pcie_gbs=12.0), dict(pcie="PCIe 4.0 x16", pcie_gbs=25.0)
GPUS: dict[str, dict] = {
    "4090": dict(mem_gb=24, tflops_bf16=165.2, tflops_fp32=82.6, price=0.29, **PCIE4),  # RTX 4090 (Ada), fp32 accumulate
    "v100": dict(mem_gb=32, tflops_bf16=125.0, tflops_fp32=15.7, price=None, **PCIE3),  # V100 SXM2: fp16 tensor cores
    "a100-40": dict(mem_gb=40, tflops_bf16=312.0, tflops_fp32=19.5, price=1.20, **PCIE4),  # A100 SXM4 40 GB
    "a100-80": dict(mem_gb=80, tflops_bf16=312.0, tflops_fp32=19.5, price=1.20, **PCIE4),  # A100 SXM4 80 GB
    "a800": dict(mem_gb=80, tflops_bf16=312.0, tflops_fp32=19.5, price=0.69, **PCIE4),  # A800: A100 silicon, slower NVLink
    "dcu": dict(mem_gb=64, tflops_bf16=100.0, tflops_fp32=25.0, price=None, **PCIE4),  # Hygon DCU K100 class, approximate
}

# Bytes per parameter: (weight, gradient, float32 master copy, optimizer moments m + v), and activation bytes c.
# Adam's per-tensor `step` counters (4 bytes per parameter tensor) are neglected.
DTYPES: dict[str, dict] = {
    "float32": dict(weight=4, grad=4, master=0, moments=8, act=4),  # 4 W in all
    # bf16 weights for every resident parameter; the trainable ones also have an fp32 master, an fp32 gradient
    # (each bf16 gradient is added into it as autograd produces it) and fp32 moments: 2 + 16 bytes, as the
    # trainer's meter measures and as BAdam counts it (2M + 16M/D GB)
    "bf16-mixed": dict(weight=2, grad=4, master=4, moments=8, act=2),
    "bf16": dict(weight=2, grad=2, master=0, moments=4, act=2),  # pure bf16, moments in bf16 too
}
# The run precision (`preinfer.config.choices.Precision`) of each planner dtype (pure bf16 has none: bf16-mixed
# is the nearest), and the planner dtype of each run precision (fp16-mixed holds bf16-mixed's bytes).
RUN_PRECISIONS = {"float32": "fp32", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed"}
PRECISION_DTYPES = {precision: dtype for dtype, precision in reversed(RUN_PRECISIONS.items())} | {
    "fp16-mixed": "bf16-mixed"}



@dataclass(frozen=True)
class Settings:
    """The inputs of a plan other than the model shape."""

    seq_len: int = 1024
    micro_batch: int = 1
    dtype: str = "float32"
    recompute: bool = False
    attention: str = DEFAULT_ATTENTION  # sdpa (no [T, T] probabilities saved) or eager
    gpu: str = "4090"
    gpu_mem_gb: float | None = None  # overrides the GPU table's memory
    blocks: int = 3
    separate_ends: bool = False  # the embedding and the head in blocks of their own (`blocks` splits the layers)
    tokens: int | None = None
    bandwidth_gbps: float = 25.0  # 2 x 25 Gbps links in the paper's clusters; one link assumed
    nodes: int = 1  # data-parallel replicas, one link each, for the --dp-sync comparison
    steps_per_visit: int = 100  # a visit's steps, for visit sync's bytes per step
    price_per_hour: float | None = None  # overrides the paper's price for the GPU
    mfu: float = 0.4  # model-FLOPs utilisation: fraction of peak FLOPs a training step achieves (assumption)
    compression: float | None = None  # store codec ratio; None: COMPRESSION of the store dtype
    store_dtype: str | None = None  # one of STORE_DTYPES; None: float32 when training in float32, else bfloat16
    pipeline: int | None = None  # pipeline degree for the traffic comparison; None: the plan's own (at least 2)
    epochs_per_visit: float = 1.0  # epochs each visit trains over the dataset (one caching pass serves them all)
    budget_bytes: int | None = None  # bytes the run may fill, given directly (--memory-budget); overrides the GPU's
    frozen_dtype: str = "auto"  # frozen decoder-layer linear weights: auto (resident dtype), bf16, int8 or nf4
    optimizer: str = "adam"  # adam, adamw: two moments; adam8bit, adamw8bit: 8-bit moments; sgd: one momentum buffer
    fused_step: bool = False  # each gradient freed as its step runs in backward
    host_device: bool = False  # the device is the host (CPU): the frozen weights' host masters share its budget
    expand: str = "auto"  # landscape expansion of the suffix: none, lowrank (rank-r factors), sgd, or auto (lowrank
    # where a BCD run makes it: a dense model with frozen_dtype auto, one GPU; else none)
    expand_rank: int = 8  # lowrank: the factors' rank
    stream_frozen: bool = False  # frozen layers in host memory, at most two on the device (preinfer.memory.streaming)
    masters: str = "host"  # where the frozen weights' masters live: host memory, or disk (memory-mapped, not resident)
    loss: str = "auto"  # the next-token loss: chunked (auto, liger: priced as chunked) or plain (`preinfer.chunked_loss`)
    loss_chunk: int = DEFAULT_LOSS_CHUNK  # tokens per chunk of the chunked loss
    offload: bool = False  # with recompute: the layers' kept inputs in host memory until backward

    def chunk(self) -> int | None:
        """Tokens per chunk of the loss as the planner prices it; None for the plain loss."""
        return None if self.loss == "plain" else self.loss_chunk

    def capacity(self) -> int:
        """Bytes a training process can fill on one GPU (the memory budget where one is given)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        gb = self.gpu_mem_gb if self.gpu_mem_gb is not None else GPUS[self.gpu]["mem_gb"]
        return int(gb * GB * USABLE_FRACTION)
