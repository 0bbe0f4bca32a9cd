"""8-bit Adam and AdamW (`adam8bit`, `adamw8bit`): torchao's blockwise-quantized moments (Dettmers et al., 8-bit
optimizers), stepped eagerly, with a state dict of plain tensors that a checkpoint saves and resumes bit for bit.

Each moment of a tensor with at least 4096 elements and a multiple of 256 is held as uint8 codes (1 byte per
element) of torchao's dynamic quantization map (256 float32 values per moment), with one float32 absmax scale per
block of 256 elements; smaller tensors (norm weights) keep float32 moments, as in torchao. The step is torchao's
`single_param_adam` run eagerly, not through `torch.compile`: no compiler toolchain is needed (CPU, CUDA, ROCm), the
first step does not wait for a compilation, and the result does not depend on what a compiler fused. Eagerly, its
re-quantization of a moment holds int64 codes and their lookups, about 13 times the float32 tensor at once (5 GiB
for a 49152 x 2048 embedding), so a quantized tensor steps in chunks of CHUNK elements, each whole 256-blocks:
views of the weight, its gradient and each moment's codes and scales, so the result is the one-call step's, bit for
bit, at a chunk's temporaries. Learning rates
stay plain floats, so a schedule sets `group["lr"]` as for torch's Adam. `state_dict()` splits each quantized moment
into `<key>.codes`, `<key>.scale`, `<key>.qmap` tensors and a `<key>.signed` flag (safetensors and JSON hold those;
the tensor subclass they hold would not be), and `load_state_dict` puts it back together.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from preinfer.config.choices import LOW_BIT_OPTIMIZERS
from preinfer.errors import UsageError
from preinfer.torchao_extra import torchao_module

PARTS = ("codes", "scale", "qmap")
CHUNK = 1 << 22  # elements of a quantized tensor stepped at once (module docstring): ~200 MiB of temporaries


def low_bit_adam(params: Iterable, name: str, lr: float, betas: tuple[float, float],
                 weight_decay: float) -> torch.optim.Optimizer:
    """torchao's Adam8bit (`adam8bit`) or AdamW8bit (`adamw8bit`) over `params`, stepped eagerly (module docstring)."""
    if name not in LOW_BIT_OPTIMIZERS:
        raise UsageError(f"--optimizer '{name}' is not one of {', '.join(LOW_BIT_OPTIMIZERS)}")
    return _eager_class(name)(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def plain_state(state_dict: dict) -> dict:
    """An optimizer state dict with every quantized moment split into plain tensors and a flag."""
    state = {index: _split(entries) for index, entries in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def quantized_state(state_dict: dict) -> dict:
    """`plain_state`'s inverse: each split moment put back together as torchao's `OptimState8bit`."""
    subclass = torchao_module("torchao.optim.subclass_8bit", "an 8-bit optimizer state").OptimState8bit
    state = {index: _join(entries, subclass) for index, entries in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _split(entries: dict) -> dict:
    out = {}
    for key, value in entries.items():
        if type(value).__name__ == "OptimState8bit":
            out.update({f"{key}.{part}": getattr(value, part) for part in PARTS})
            out[f"{key}.signed"] = bool(value.signed)
        else:
            out[key] = value
    return out


def _join(entries: dict, subclass: type) -> dict:
    out = {key: value for key, value in entries.items() if key.rpartition(".")[2] not in (*PARTS, "signed")}
    for key in {k.rpartition(".")[0] for k in entries if k.endswith(".signed")}:
        codes, scale, qmap = (entries[f"{key}.{part}"] for part in PARTS)
        out[key] = subclass(codes, scale, qmap, bool(entries[f"{key}.signed"]), dtype=torch.float32)
    return out


def _chunks(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> list:
    """(weight, gradient, moment, moment) views of at most CHUNK elements each, on whole blocks of the moments'
    quantization; the tensors themselves where the moments are plain or the tensor is small or not contiguous."""
    quantized = type(exp_avg).__name__ == "OptimState8bit"
    if not quantized or weight.numel() <= CHUNK or not (weight.is_contiguous() and grad.is_contiguous()):
        return [(weight, grad, exp_avg, exp_avg_sq)]
    block = exp_avg.block_size
    step = CHUNK - CHUNK % block
    flat = weight.view(-1), grad.view(-1)
    return [(flat[0][lo:lo + step], flat[1][lo:lo + step], _state_view(exp_avg, lo, lo + step),
             _state_view(exp_avg_sq, lo, lo + step)) for lo in range(0, weight.numel(), step)]


def _state_view(state: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements lo:hi of an 8-bit moment (lo on a block boundary), sharing its codes and scales."""
    hi = min(hi, state.numel())
    block = state.block_size
    return type(state)(state.codes.view(-1)[lo:hi], state.scale[lo // block:-(-hi // block)], state.qmap,
                       state.signed, dtype=state.dtype)


@functools.cache
def _eager_class(name: str) -> type:
    """torchao's class for `name` with an eager step, float learning rates and a plain state dict."""
    adam = torchao_module("torchao.optim.adam", f"--optimizer {name}")
    base = adam.AdamW8bit if name == "adamw8bit" else adam.Adam8bit

    class Eager(base):
        __doc__ = f"torchao's {base.__name__}, stepped eagerly, with a plain state dict (preinfer.low_bit)."

        def add_param_group(self, param_group: dict) -> None:
            torch.optim.Optimizer.add_param_group(self, param_group)  # the rate stays a float

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self.step_param(param, group)
            return loss

        @torch.no_grad()
        def step_param(self, param: torch.Tensor, group: dict) -> None:
            """One parameter's step (all of `step` for one tensor; a fused step calls it from a gradient hook)."""
            if param.grad.is_sparse or group["amsgrad"]:
                raise UsageError(f"--optimizer {name} takes dense gradients and no amsgrad")
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._new_buffer(param, True)
                state["exp_avg_sq"] = self._new_buffer(param, False)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            for weight, grad, exp_avg, exp_avg_sq in _chunks(param.detach(), param.grad, state["exp_avg"],
                                                             state["exp_avg_sq"]):
                adam.single_param_adam(weight, grad, state["step"], exp_avg, exp_avg_sq, None, group["lr"], beta1,
                                       beta2, group["weight_decay"], group["eps"], self.is_adamw, False)

        def state_dict(self) -> dict:
            return plain_state(super().state_dict())

        def load_state_dict(self, state_dict: dict) -> None:
            super().load_state_dict(quantized_state(state_dict))

    Eager.__name__ = Eager.__qualname__ = base.__name__
    return Eager
