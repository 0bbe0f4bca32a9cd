"""Frozen linear weights held in fewer bits for their forward and the backward through them, masters kept exact.

`FrozenWeights(layers, dtype, device)` takes the decoder layers whose `nn.Linear` submodules it manages (the
embedding and the LM head stay in their resident dtype). It copies every such weight to host memory (CPU tensors,
pinned when the device is CUDA): these masters are the authoritative weights. `quantize(indices)` swaps each
managed `nn.Linear` of those layers for a `FrozenLinear` holding codes built from the master, and frees the
weight's device storage; `restore(indices)` puts the original `nn.Linear` (the same module and Parameter objects)
back with the master copied onto the device bit for bit, for a block's visit. Quantizing a restored layer first
copies its device weight (trained during the visit) into its master, then builds the codes from the master: codes
are never built from codes. `masters()` gives the authoritative weights for a checkpoint or an export (codes are
never saved). Norm weights and biases stay resident as they are.

A `FrozenLinear` computes `x @ W^T (+ bias)` with W dequantized to x's dtype in forward and again in backward: only
the codes are saved for backward, and the frozen weight gets no gradient (the input does). Element error of W:

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

from collections.abc import Sequence

import torch
from torch import nn

from preinfer.errors import UsageError
from preinfer.memory.quantized import FROZEN_DTYPES, NF4_BLOCK, nf4_scaler_block
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
    """x @ W^T with W decoded from codes in forward and again in backward; only the codes are saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: str, *codes: torch.Tensor) -> torch.Tensor:
        ctx.dtype = dtype
        ctx.save_for_backward(*codes)
        return x @ decode(codes, dtype, x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ decode(ctx.saved_tensors, ctx.dtype, grad.dtype), None, *(None for _ in ctx.saved_tensors)


class FrozenLinear(nn.Module):
    """A frozen `nn.Linear`'s stand-in: its weight as codes (non-persistent buffers, so never in a state dict),
    its bias the linear's own Parameter."""

    def __init__(self, linear: nn.Linear, codes: tuple[torch.Tensor, ...], dtype: str):
        super().__init__()
        self.dtype, self.in_features, self.out_features = dtype, linear.in_features, linear.out_features
        self.bias = linear.bias
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
            raise UsageError(f"frozen dtype {dtype} holds nn.Linear weights; these layers have none")
        pin = self.device.type == "cuda"
        self._masters = [{path: _host_copy(linear.weight, pin) for path, linear in found.items()}
                         for found in self.linears]
        if dtype == "nf4":
            _check_nf4(self._masters)
        self.quantized: set[int] = set()

    def quantize(self, indices: Sequence[int]) -> None:
        """Hold layers `indices` as codes built from their masters (a restored layer's weight, trained during its
        visit, becomes its master first); an already quantized layer stays as it is."""
        for index in indices:
            if index in self.quantized:
                continue
            self._sync_master(index)
            for path, linear in self.linears[index].items():
                codes = encode(self._masters[index][path].to(self.device, non_blocking=True), self.dtype)
                _set_child(self.layers[index], path, FrozenLinear(linear, codes, self.dtype))
                linear.weight.data = torch.empty(0, dtype=linear.weight.dtype, device=self.device)
            self.quantized.add(index)

    def restore(self, indices: Sequence[int]) -> None:
        """Put layers `indices` back as their `nn.Linear`s with the masters on the device, bit for bit."""
        for index in indices:
            if index not in self.quantized:
                continue
            for path, linear in self.linears[index].items():
                linear.weight.data = self._masters[index][path].to(self.device, copy=True)
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

    def _sync_master(self, index: int) -> None:
        if index not in self.quantized:
            for path, linear in self.linears[index].items():
                self._masters[index][path].copy_(linear.weight.detach())


def _linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {path: module for path, module in layer.named_modules() if path and isinstance(module, nn.Linear)}


def _host_copy(weight: torch.Tensor, pin: bool) -> torch.Tensor:
    host = weight.detach().to("cpu", copy=True)
    return host.pin_memory() if pin else host


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
