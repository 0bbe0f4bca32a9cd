"""Frozen linear weights held in fewer bits for their forward and the backward through them, masters kept exact.

In the manner of torchao's `quantize_`: the module tree stays as it is, and a frozen `nn.Linear`'s weight is a
tensor subclass, `FrozenWeight`, a Parameter over the exact master's storage with the codes beside it. `F.linear` on
it runs from the codes; everything else (state dicts, checkpoints, exports, fingerprints, `torch.equal`) reads the
master; an in-place write (expansion's merge, `--expand sgd`'s step, a checkpoint's load) writes the master and
builds the codes from it again, so codes are never built from codes. Nothing outside this module asks whether a
weight is quantized: the memory meter counts what a tensor holds (`__tensor_flatten__`: the codes), the
fingerprint adds how it is held (the frozen dtype).

The two verbs are `FrozenWeights(layers, dtype, device).quantize(indices)` and `.restore(indices)`, on any decoder
layers (a process's whole model, or the layers a pipeline stage holds). Every managed weight (the `nn.Linear`
submodules of the layers; the embedding and the LM head stay in their resident dtype) has a master in host memory:
these are the authoritative weights. A weight loaded on an accelerator gets a host copy as its master (pinned
when the device is CUDA); a weight in host memory (on the CPU, or left there by `--stream-frozen`'s placement,
`preinfer.device_placement`) is its own master, never a second copy, so that a model loaded at W bytes stays at W
bytes plus its codes. `quantize` sets each such linear's weight to a `FrozenWeight` with codes built from the
master on the device, and points the layer's own weight Parameter at its host master (its device storage freed);
`restore` puts that Parameter back (the same object, which the block's optimizer steps) with the master copied onto
the device bit for bit (on the CPU: the master itself, trained in place), for a block's visit. Quantizing a
restored layer first copies its device weight (trained during the visit) into its master unless they are one
storage. `masters()` gives the authoritative weights by name. Norm weights and biases stay resident as they are.

`QuantizedFrozenLayers` is the `preinfer.visit.VisitHook` of `--frozen-dtype`: when it is made every held layer is
quantized; each visit restores its block's layers and quantizes them again when it ends. Pre-inference, evaluation
and live visits all run the model as it is held, so a store is the codes' prefix's (the stores-on run equals the
live one) and its fingerprint names the frozen dtype.

`F.linear` on a `FrozenWeight` computes `x @ W^T (+ bias)` with W dequantized to x's dtype in forward and again in
backward (one decoded weight at a time, freed after its matmul): backward keeps only a reference to the codes, and
the input gets its gradient; the frozen weight gets one only where it requires it (`--expand sgd`). Element error
of W:

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

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
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


# The in-place operators a Python statement on a tensor calls (`w[...] = v`, `w += v`): writes, as `copy_` is.
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


class _DequantizedLinear(torch.autograd.Function):
    """x @ W^T with W decoded from the frozen weight's codes in forward and again in backward. Backward keeps a
    reference to the codes of the forward (never changed in place: a write gives the weight new codes), not a saved
    copy: they are no activation, and saved-tensor hooks (the memory meter's, recomputation's) see nothing of them.
    Where the weight requires a gradient (`--expand sgd`), the input is saved and W's gradient, grad^T x, goes to
    the weight in its master's dtype and on its master's device."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: FrozenWeight) -> torch.Tensor:
        ctx.dtype, ctx.codes, ctx.master = weight.frozen_dtype, weight.codes, (weight.device, weight.dtype)
        if weight.requires_grad:
            ctx.save_for_backward(x)
        return x @ decode(ctx.codes, ctx.dtype, x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad @ decode(ctx.codes, ctx.dtype, grad.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            (x,) = ctx.saved_tensors
            grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(*ctx.master)
        return grad_x, grad_w


class FrozenWeight(nn.Parameter):
    """A frozen linear weight held as codes: a Parameter over its exact master's storage (host memory), with the
    codes built from that master on `device`. `F.linear` on it runs from the codes (`_DequantizedLinear`); every
    other operation is the master's own (state dicts, checkpoints, exports and fingerprints read the master), and
    an in-place write through it (`copy_`, `add_`, `w[...] = v`) writes the master and then builds the codes from
    it again (a write through `.data`, a plain tensor over the master, does not)."""

    def __new__(cls, master: torch.Tensor, frozen_dtype: str, device: torch.device) -> FrozenWeight:
        weight = super().__new__(cls, master, requires_grad=False)
        weight.frozen_dtype, weight.compute_device = frozen_dtype, device
        weight.encode()
        return weight

    @property
    def codes(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.code_names)

    def encode(self) -> None:
        """Build the codes from the master (never from codes)."""
        codes = encode(self.detach().to(self.compute_device, non_blocking=True), self.frozen_dtype)
        self.code_names = tuple(f"code{i}" for i in range(len(codes)))
        for name, code in zip(self.code_names, codes):
            setattr(self, name, code)

    def __tensor_flatten__(self) -> tuple[list[str], str]:
        """The tensors it holds on the device (its codes) and how (its frozen dtype); its own storage is the
        master, in host memory."""
        return list(self.code_names), self.frozen_dtype

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return _frozen_linear(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if _writes(func):
            for target in args[0] if isinstance(args[0], (list, tuple)) else args[:1]:
                if isinstance(target, FrozenWeight):
                    target.encode()
        return out


def _frozen_linear(input: torch.Tensor, weight: FrozenWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight, bias)` (its argument names) on a frozen weight."""
    y = _DequantizedLinear.apply(input, weight)
    return y if bias is None else y + bias


def _writes(func) -> bool:
    """Whether `func` writes its first argument in place (torch's trailing underscore, or an in-place operator)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__") and name != "requires_grad_") or name in _INPLACE_DUNDERS


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
        self.params = [{path: linear.weight for path, linear in found.items()} for found in self.linears]
        self._masters = [{path: self._host_master(param) for path, param in found.items()} for found in self.params]
        if dtype == "nf4":
            _check_nf4(self._masters)
        self.quantized: set[int] = set()

    def quantize(self, indices: Iterable[int], then: Callable[[int], None] | None = None) -> None:
        """Hold layers `indices` as codes built from their masters (a restored layer's weight, trained during its
        visit, becomes its master first); an already quantized layer stays as it is. `then(index)` follows each
        layer's quantization (`--stream-frozen` evicts its codes there, before the next layer's are built)."""
        for index in indices:
            if index in self.quantized:
                continue
            self._sync_master(index)
            for path, linear in self.linears[index].items():
                master = self._masters[index][path]
                self.params[index][path].data = master  # its device storage freed
                linear.weight = FrozenWeight(master, self.dtype, self.device)
            self.quantized.add(index)
            if then is not None:
                then(index)

    def restore(self, indices: Iterable[int]) -> None:
        """Put layers `indices` back with their own weight Parameters, the masters on the device bit for bit."""
        for index in indices:
            if index not in self.quantized:
                continue
            for path, linear in self.linears[index].items():
                param = self.params[index][path]
                param.data = self._on_device(self._masters[index][path])
                linear.weight = param
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
        """The master of `weight`: its own storage when it is in host memory already (on the CPU, or left there
        by `--stream-frozen`'s placement, memory-mapped with `--masters disk`), else a host copy (pinned for
        CUDA)."""
        return host_copy(weight, pin=weight.device.type == "cuda")

    def _on_device(self, master: torch.Tensor) -> torch.Tensor:
        """The weight a restored linear trains: the master itself on the CPU, else its copy on the device."""
        return master if self.device.type == "cpu" else master.to(self.device, copy=True)

    def _sync_master(self, index: int) -> None:
        """A restored layer's weights become its masters: a weight in host memory by its own storage (on the CPU;
        or its storage replaced at the visit's end, as masters on disk map a trained block from its new file),
        one on the device copied into its host master."""
        if index not in self.quantized:
            for path, param in self.params[index].items():
                master = self._masters[index][path]
                if param.data_ptr() == master.data_ptr():
                    continue
                if param.device.type == "cpu":
                    self._masters[index][path] = param.detach()
                else:
                    master.copy_(param.detach())


class QuantizedFrozenLayers:
    """The visit hook of `--frozen-dtype` (see the module's docstring) over the decoder layers of `staged` that
    hold weights (a suffix model's prefix below its store, or a pipeline stage's layers of other stages, on the
    meta device, is not held). Every held layer is quantized when the hook is made, so the model runs its codes
    between visits too (pre-inference, evaluation)."""

    def __init__(self, staged: StagedModel, dtype: str, device: torch.device | str,
                 placed: Callable[[int], None] | None = None):
        """`placed(layer)` follows the quantization of each held layer (by its index in `staged`)."""
        held = [i for i, layer in enumerate(staged.layers) if not any(p.is_meta for p in layer.parameters())]
        self.weights = FrozenWeights([staged.layers[i] for i in held], dtype, device)
        self.local = {layer: index for index, layer in enumerate(held)}
        self.weights.quantize(self.local.values(), None if placed is None else lambda index: placed(held[index]))

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


def frozen_weight_hooks(staged: StagedModel, config: Config,
                        placed: Callable[[int], None] | None = None) -> list[QuantizedFrozenLayers]:
    """The run's visit hooks for `[model] frozen_dtype`: none for auto (every weight resident as it is);
    `placed(layer)` after each layer's first quantization (`QuantizedFrozenLayers`)."""
    dtype = config.model.frozen_dtype
    return [] if dtype == "auto" else [QuantizedFrozenLayers(staged, dtype, config.run.device, placed)]


def _linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {path: module for path, module in layer.named_modules() if path and isinstance(module, nn.Linear)}


def _check_nf4(masters: list[dict[str, torch.Tensor]]) -> None:
    for index, found in enumerate(masters):
        for path, master in found.items():
            if master.numel() % NF4_BLOCK:
                raise UsageError(f"frozen dtype nf4 needs weights whose element count is divisible by {NF4_BLOCK}; "
                                 f"layer {index} {path} has {master.numel()}: use int8 or bf16")
