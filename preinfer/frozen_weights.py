"""Frozen linear weights held in fewer bits for their forward and the backward through them, masters kept exact.

`FrozenWeights(layers, dtype, device)` takes the decoder layers whose `nn.Linear` submodules it manages (the
embedding and the LM head stay in their resident dtype). Every such weight has a master in host memory: these are
the authoritative weights. On an accelerator each master is a copy (pinned when the device is CUDA); on the CPU the
master is the loaded weight's own storage, never a second copy, so that a model loaded at W bytes stays at W bytes
plus its codes. `quantize(indices)` swaps each managed `nn.Linear` of those layers for a `FrozenLinear` holding
codes built from the master on the device, and points the weight's Parameter at its host master (its device
storage is freed), so that state dicts, checkpoints, exports and fingerprints see the master and never the codes;
`restore(indices)` puts the original `nn.Linear` (the same module and Parameter objects) back with the master
copied onto the device bit for bit (on the CPU: the master itself, trained in place), for a block's visit.
Quantizing a restored layer first copies its device weight (trained during the visit) into its master unless they
are one storage, then builds the codes from the master: codes are never built from codes. `masters()` gives the
authoritative weights by name. Norm weights and biases stay resident as they are.

`QuantizedFrozenLayers` is the `preinfer.visit.VisitHook` of `--frozen-dtype`: at its first visit every layer
outside the block is quantized; each visit restores its block's layers and quantizes them again when it ends.
`masters_forward(layers)` runs quantized layers from their masters (one layer's weights on the device at a time),
as pre-inference does so that its stores stay exact.

A `FrozenLinear` computes `x @ W^T (+ bias)` with W dequantized to x's dtype in forward and again in backward
(one decoded weight at a time, freed after its matmul): backward keeps only a reference to the codes, and the
frozen weight gets no gradient (the input does). Element error of W:

- `bf16`: round to nearest bfloat16, |w - w'| <= 2^-8 |w| (exact when the master is bfloat16 already).
- `int8`: symmetric per output row ("per channel"): scale = absmax(row) / 127 in float32, code = round(w / scale)
  in [-127, 127]; |w - w'| <= scale / 2 = absmax(row) / 254.
- `nf4`: torchao's NF4 (QLoRA): blocks of 64 consecutive elements, each scaled by its absmax and rounded to the
  nearest of 16 normal-float levels (largest gap 0.3038, so |w - w'| <= 0.152 absmax(block)); the blocks' absmaxes
  are themselves int8-quantized in scaler blocks of 256 (the largest divisor of the block count up to 256 when 256
  does not divide it), which adds at most 1/254 of the largest centred absmax of the scaler block. Needs every
  weight's element count divisible by 64.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.memory.quantized import FROZEN_DTYPES, NF4_BLOCK, nf4_scaler_block
from preinfer.partition import Block
from preinfer.precision import host_copy
from preinfer.staged import StagedModel
from preinfer.torchao_extra import torchao_module


def encode(weight: torch.Tensor, dtype: str) -> tuple[torch.Tensor, ...]:
    """The codes of `weight` (2-D, on its device) in frozen dtype `dtype`."""
    if dtype == "bf16":
        return (weight.to(torch.bfloat16, copy=True),)
    if dtype == "int8":
        scale = (weight.float().abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        return torch.round(weight.float() / scale).clamp_(-127, 127).to(torch.int8), scale
    nf4 = torchao_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "frozen dtype nf4")
    return (nf4.to_nf4(weight.contiguous(), NF4_BLOCK, nf4_scaler_block(weight.numel())),)


def decode(codes: Sequence[torch.Tensor], dtype: str, out: torch.dtype) -> torch.Tensor:
    """The weight `encode` coded, in dtype `out`."""
    if dtype == "bf16":
        return codes[0].to(out)
    if dtype == "int8":
        return (codes[0].float() * codes[1]).to(out)
    return codes[0].get_original_weight().to(out)


class _DequantizedLinear(torch.autograd.Function):
    """x @ W^T with W decoded from codes in forward and again in backward. Backward keeps a reference to the codes
    (resident buffers, never changed in place while they are held), not a saved copy: they are no activation, and
    saved-tensor hooks (the memory meter's, recomputation's) see nothing of them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: str, *codes: torch.Tensor) -> torch.Tensor:
        ctx.dtype, ctx.codes = dtype, codes
        return x @ decode(codes, dtype, x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ decode(ctx.codes, ctx.dtype, grad.dtype), None, *(None for _ in ctx.codes)


class FrozenLinear(nn.Module):
    """A frozen `nn.Linear`'s stand-in: its codes on the device (non-persistent buffers) are what forward and
    backward read; its weight is the linear's own Parameter pointing at the host master (what a state dict holds),
    its bias the linear's own Parameter."""

    def __init__(self, linear: nn.Linear, master: torch.Tensor, codes: tuple[torch.Tensor, ...], dtype: str):
        super().__init__()
        self.dtype, self.in_features, self.out_features = dtype, linear.in_features, linear.out_features
        object.__setattr__(self, "linear", linear)  # the module it stands in for, not a submodule of its own
        self.master = master
        linear.weight.data = master
        self.weight, self.bias = linear.weight, linear.bias
        self.names = tuple(f"code{i}" for i in range(len(codes)))
        for name, code in zip(self.names, codes):
            self.register_buffer(name, code, persistent=False)

    def codes(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantizedLinear.apply(x, self.dtype, *self.codes())
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}"


class FrozenWeights:
    """The `nn.Linear` weights of `layers` with host masters, each layer held quantized or restored (see the
    module's docstring). Every layer starts restored, as it was given."""

    def __init__(self, layers: Sequence[nn.Module], dtype: str, device: torch.device | str):
        if dtype not in FROZEN_DTYPES:
            raise UsageError(f"frozen dtype '{dtype}' is not one of {', '.join(FROZEN_DTYPES)}")
        self.dtype, self.device = dtype, torch.device(device)
        if dtype == "nf4":
            torchao_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "frozen dtype nf4")
        self.layers = list(layers)
        self.linears = [_linears(layer) for layer in self.layers]
        if not any(self.linears):
            raise UsageError(f"frozen dtype {dtype} holds nn.Linear weights; these layers have none: use "
                             f"--frozen-dtype auto")
        self._masters = [{path: self._host_master(linear.weight) for path, linear in found.items()}
                         for found in self.linears]
        if dtype == "nf4":
            _check_nf4(self._masters)
        self.quantized: set[int] = set()

    def quantize(self, indices: Iterable[int]) -> None:
        """Hold layers `indices` as codes built from their masters (a restored layer's weight, trained during its
        visit, becomes its master first); an already quantized layer stays as it is."""
        for index in indices:
            if index in self.quantized:
                continue
            self._sync_master(index)
            for path, linear in self.linears[index].items():
                master = self._masters[index][path]
                codes = encode(master.to(self.device, non_blocking=True), self.dtype)
                _set_child(self.layers[index], path, FrozenLinear(linear, master, codes, self.dtype))
            self.quantized.add(index)

    def restore(self, indices: Iterable[int]) -> None:
        """Put layers `indices` back as their `nn.Linear`s with the masters on the device, bit for bit."""
        for index in indices:
            if index not in self.quantized:
                continue
            for path, linear in self.linears[index].items():
                linear.weight.data = self._on_device(self._masters[index][path])
                _set_child(self.layers[index], path, linear)
            self.quantized.discard(index)

    def masters(self) -> dict[str, torch.Tensor]:
        """The authoritative weights, as host tensors named `"{index}.{path}.weight"` (with the prefix of the
        layers' container, the model's own state-dict names); a restored layer's device weight is copied into its
        master first."""
        for index in range(len(self.layers)):
            self._sync_master(index)
        return {f"{index}.{path}.weight": master
                for index, found in enumerate(self._masters) for path, master in found.items()}

    def _host_master(self, weight: torch.Tensor) -> torch.Tensor:
        """The master of `weight`: its own storage when it is in host memory already (on the CPU), else a host
        copy (pinned for CUDA)."""
        return host_copy(weight, pin=self.device.type == "cuda")

    def _on_device(self, master: torch.Tensor) -> torch.Tensor:
        """The weight a restored linear trains: the master itself on the CPU, else its copy on the device."""
        return master if self.device.type == "cpu" else master.to(self.device, copy=True)

    def _sync_master(self, index: int) -> None:
        if index not in self.quantized:
            for path, linear in self.linears[index].items():
                master = self._masters[index][path]
                if linear.weight.data_ptr() != master.data_ptr():
                    master.copy_(linear.weight.detach())


class QuantizedFrozenLayers:
    """The visit hook of `--frozen-dtype` (see the module's docstring) over the decoder layers of `staged` that
    hold weights (a suffix model's prefix below its store, on the meta device, is not held)."""

    def __init__(self, staged: StagedModel, dtype: str, device: torch.device | str):
        held = [i for i, layer in enumerate(staged.layers) if not any(p.is_meta for p in layer.parameters())]
        self.weights = FrozenWeights([staged.layers[i] for i in held], dtype, device)
        self.local = {layer: index for index, layer in enumerate(held)}

    def activate(self, block: Block) -> list[nn.Parameter]:
        """The block's layers restored from their masters, every other held layer quantized; no extra parameters."""
        inside = self._held(block)
        self.weights.restore(inside)
        self.weights.quantize(index for index in self.local.values() if index not in inside)
        return []

    def after_step(self) -> None:
        """Nothing: the block's weights become masters when its visit ends."""

    def deactivate(self, block: Block) -> None:
        """The block's trained weights become its masters, and its layers are quantized from them."""
        self.weights.quantize(self._held(block))

    def _held(self, block: Block) -> list[int]:
        return [self.local[layer] for layer in range(block.start, block.stop) if layer in self.local]


def frozen_weight_hooks(staged: StagedModel, config: Config) -> list[QuantizedFrozenLayers]:
    """The run's visit hooks for `[model] frozen_dtype`: none for auto (every weight resident as it is)."""
    dtype = config.model.frozen_dtype
    return [] if dtype == "auto" else [QuantizedFrozenLayers(staged, dtype, config.run.device)]


@contextmanager
def masters_forward(layers: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, each of `layers` that holds quantized linears runs from their masters: its `nn.Linear`s are put
    back with the masters on the device just before its forward and the codes just after, so one layer's
    weights at a time are on the device."""
    handles = []
    for layer in layers:
        frozen = {path: m for path, m in layer.named_modules() if isinstance(m, FrozenLinear)}
        if frozen:
            handles.append(layer.register_forward_pre_hook(lambda module, args, f=frozen: _run_masters(module, f)))
            handles.append(layer.register_forward_hook(lambda module, args, out, f=frozen: _run_codes(module, f)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _run_masters(layer: nn.Module, frozen: dict[str, FrozenLinear]) -> None:
    for path, module in frozen.items():
        module.weight.data = module.master.to(module.codes()[0].device)
        _set_child(layer, path, module.linear)


def _run_codes(layer: nn.Module, frozen: dict[str, FrozenLinear]) -> None:
    for path, module in frozen.items():
        module.weight.data = module.master
        _set_child(layer, path, module)


def _linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {path: module for path, module in layer.named_modules() if path and isinstance(module, nn.Linear)}


def _check_nf4(masters: list[dict[str, torch.Tensor]]) -> None:
    for index, found in enumerate(masters):
        for path, master in found.items():
            if master.numel() % NF4_BLOCK:
                raise UsageError(f"frozen dtype nf4 needs weights whose element count is divisible by {NF4_BLOCK}; "
                                 f"layer {index} {path} has {master.numel()}: use int8 or bf16")


def _set_child(layer: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at `path` inside `layer`."""
    parent, _, name = path.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, name, module)
