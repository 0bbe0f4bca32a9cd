"""Training precision: fp32, or mixed precision with fp32 masters for the active block only.

Under `bf16-mixed` / `fp16-mixed` every weight of the model is resident in 16 bits; forward and backward run in
that dtype (the loss casts the logits to fp32 before the softmax). The active block alone has fp32 master weights,
fp32 gradients and fp32 optimizer state, for its visit only: each 16-bit gradient is added into its master's fp32
gradient as soon as autograd has accumulated it (a post-accumulate-grad hook), the optimizer steps the masters,
and the masters are cast into the model's weights after every step. `fp16-mixed` adds dynamic loss scaling
(`torch.amp.GradScaler`, whose inf/NaN check and unscaling act on the masters' fp32 gradients).

A run's precision is resolved once (`resolve_precision`: `auto` follows the weights) into a `Precision`, which
the trainer, the pipeline's stages and `preinfer.hf` read (its resident dtype, whether it is mixed, whether it
scales the loss) instead of resolving the name again.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

import torch
from torch import nn

from preinfer.config.choices import RESIDENT_DTYPE_NAMES, RUN_PRECISIONS
from preinfer.errors import CheckpointError, UsageError

class _Precision(StrEnum):
    """A run's training precision, resolved once (`resolve_precision`) and read by everything after: the trainer,
    the pipeline's stages, `preinfer.hf`. A string enum, so that it is its name wherever a name is written (records,
    JSON, the memory planner's tables); its members are the config's vocabulary (`RUN_PRECISIONS`): `Precision`."""

    @property
    def resident_dtype(self) -> torch.dtype:
        """The dtype every weight of the model is held in."""
        return RESIDENT_DTYPES[self]

    @property
    def mixed(self) -> bool:
        """16-bit weights with fp32 masters for the active block."""
        return self is not Precision.FP32

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling (`LossScaler`)."""
        return self is Precision.FP16_MIXED

    def apply(self, model: nn.Module) -> nn.Module:
        """Cast the model's weights to this precision's resident dtype."""
        return cast_weights(model, self.resident_dtype)

    def describe(self, weights: torch.dtype) -> str:
        """The line a run starts with (`weights`: the dtype the model was loaded in)."""
        name = str(weights).removeprefix("torch.")
        if not self.mixed:
            return (f"precision: fp32 (weights, gradients and optimizer state in float32; the model's weights are "
                    f"{name})")
        low = str(self.resident_dtype).removeprefix("torch.")
        scaling = ", dynamic loss scaling" if self.loss_scaling else ""
        return (f"precision: {self.value} (every weight resident in {low}; fp32 masters, gradients and optimizer "
                f"state for the active block only{scaling}; the model's weights were {name})")


Precision = _Precision("Precision", {name.upper().replace("-", "_"): name for name in RUN_PRECISIONS},
                       module=__name__)
PRECISIONS = tuple(p.value for p in Precision)
RESIDENT_DTYPES = {precision: getattr(torch, RESIDENT_DTYPE_NAMES[precision]) for precision in Precision}
MIXED_FOR_DTYPE = {dtype: precision for precision, dtype in RESIDENT_DTYPES.items() if precision.mixed}


def resolve_precision(requested: str, weights: torch.dtype) -> Precision:
    """The precision a run trains in: `auto` follows the model's weights (bf16 -> bf16-mixed, fp16 ->
    fp16-mixed, anything else fp32)."""
    if requested == "auto":
        return MIXED_FOR_DTYPE.get(weights, Precision.FP32)
    if requested not in PRECISIONS:
        raise UsageError(f"--precision '{requested}' is not one of auto, {', '.join(PRECISIONS)}")
    return Precision(requested)


def apply_precision(model: nn.Module, requested: str) -> Precision:
    """Resolve `requested` against the model's weights and cast them to that precision's resident dtype."""
    precision = resolve_precision(requested, weights_dtype(model))
    precision.apply(model)
    return precision


def weights_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every floating-point parameter in place to `dtype` (the Parameter objects stay, so ties hold;
    buffers such as rotary tables keep their own dtype)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


class LossScaler:
    """fp16-mixed's dynamic loss scaling: `torch.amp.GradScaler` over the optimizer of the active block's fp32
    masters (from 2^16, halved on a step with non-finite gradients, which is skipped, doubled after
    `growth_interval` finite steps in a row: GradScaler's defaults), with the count of skipped steps. Disabled
    (`enabled=False`, every precision but fp16-mixed) it changes nothing: the loss is not scaled and every step
    runs. Its state is four plain numbers (`STATE_KEYS`), saved in a checkpoint as JSON.

    Where several processes hold parts of one step's gradients (a pipeline's stages, some holding none), `agree`
    is set: it sums a found-inf flag over them all, so that every process skips the same steps and keeps the same
    scale; the gradients are then unscaled and the scale updated here, by GradScaler's own rule."""

    STATE_KEYS = ("scale", "growth_interval", "good_steps", "skipped")

    def __init__(self, device: str = "cpu", enabled: bool = True, scale: float = 2.0**16,
                 growth_interval: int = 2000):
        self.grad_scaler = torch.amp.GradScaler(device, init_scale=scale, growth_interval=growth_interval,
                                                enabled=enabled)
        self.skipped = 0  # steps skipped so far in the run
        self.agree: Callable[[torch.Tensor], None] | None = None
        self.found_inf = torch.zeros(())  # with `agree`: whether the last unscaled gradients were not all finite

    @property
    def enabled(self) -> bool:
        return self.grad_scaler.is_enabled()

    @property
    def scale(self) -> float:
        """The factor the next step's loss is multiplied by."""
        return self.grad_scaler.get_scale()

    @scale.setter
    def scale(self, value: float) -> None:
        self.load_state_dict({**self.state_dict(), "scale": value})

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scale (unchanged when disabled); also a gradient hook's function."""
        return self.grad_scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and note whether all are finite (call it before
        clipping them)."""
        if self.agree is None:
            self.grad_scaler.unscale_(optimizer)
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        inverse = torch.tensor(1.0 / self.scale, dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            grad.mul_(inverse)
            self.found_inf = torch.maximum(self.found_inf, (~grad.isfinite()).any().float())
        self.agree(self.found_inf)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """GradScaler's step and update: the optimizer steps unless a gradient was not finite (the step is then
        skipped and counted, and the scale halves). True if it stepped, as a step post-hook tells (for an optimizer
        that is not fused, and `build_optimizer`'s never are, GradScaler calls `step()` only on finite gradients)."""
        if not self.enabled:  # fp32 and bf16: a plain step, no hook on the hot path
            optimizer.step()
            return True
        if self.agree is not None:
            return self._agreed_step(optimizer)
        stepped: list[bool] = []
        hook = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
        try:
            self.grad_scaler.step(optimizer)
        finally:
            hook.remove()
        self.grad_scaler.update()
        self.skipped += not stepped
        return bool(stepped)

    def _agreed_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The step unless the agreed found-inf is set, and GradScaler's update of the scale: halved on a skipped
        step, doubled after `growth_interval` finite steps in a row."""
        stepped = not bool(self.found_inf)
        if stepped:
            optimizer.step()
        state = self.state_dict()
        scale, good = state["scale"], state["good_steps"] + 1
        if not stepped:
            scale, good = scale * self.grad_scaler.get_backoff_factor(), 0
        elif good == state["growth_interval"]:
            scale, good = scale * self.grad_scaler.get_growth_factor(), 0
        self.load_state_dict({**state, "scale": scale, "good_steps": good, "skipped": self.skipped + (not stepped)})
        return stepped

    def state_dict(self) -> dict:
        """The scale, growth interval, finite steps since the last change of scale (GradScaler's growth tracker)
        and skipped steps."""
        state = self.grad_scaler.state_dict()
        return {"scale": state["scale"], "growth_interval": state["growth_interval"],
                "good_steps": state["_growth_tracker"], "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s numbers (also those of checkpoints written before GradScaler)."""
        if not isinstance(state, dict) or set(state) != set(self.STATE_KEYS) or not all(
                isinstance(state[k], (int, float)) and not isinstance(state[k], bool) for k in self.STATE_KEYS):
            raise CheckpointError(f"loss_scaler = {state!r:.80}: expected numbers {', '.join(self.STATE_KEYS)}")
        self.grad_scaler.load_state_dict({
            "scale": float(state["scale"]), "growth_interval": int(state["growth_interval"]),
            "_growth_tracker": int(state["good_steps"]), "growth_factor": self.grad_scaler.get_growth_factor(),
            "backoff_factor": self.grad_scaler.get_backoff_factor()})
        self.skipped = int(state["skipped"])


class ActiveBlock:
    """The tensors one visit's optimizer steps and their gradients: the block's own weights under fp32, fp32
    master copies of them under mixed precision. `on_grad_ready(i)` is called when tensor i's gradient of the
    step's last micro-batch is complete (the data-parallel reducer launches its buckets from it; the fused step
    steps tensor i, at once or once the reducer has summed it)."""

    def __init__(self, params: list[nn.Parameter], mixed: bool, masters: list[torch.Tensor] | None = None):
        self.params, self.mixed = params, mixed
        if not mixed:
            self.masters: list[torch.Tensor] = list(params)
        elif masters is not None:
            self.masters = [m.detach().to(p.device, torch.float32).clone() for m, p in zip(masters, params)]
        else:
            self.masters = [p.detach().float().clone() for p in params]
        self.on_grad_ready: Callable[[int], None] | None = None
        self.last_micro_batch = True
        self._hooks = []
        if mixed:
            self._install_hooks()

    def watch(self, on_grad_ready: Callable[[int], None]) -> Callable[[int], None] | None:
        """Call `on_grad_ready(i)` as each gradient of the last micro-batch completes (one watcher: the fused step,
        or the data-parallel reducer, which hands each summed gradient on to the fused step); returns the watcher
        it replaces (None: none)."""
        replaced, self.on_grad_ready = self.on_grad_ready, on_grad_ready
        if not self._hooks:
            self._install_hooks()
        return replaced

    def _install_hooks(self) -> None:
        for index, param in enumerate(self.params):
            self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(index)))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def accumulated(param: torch.Tensor) -> None:
            if self.mixed:
                grad, param.grad = param.grad, None
                self.add_grad(index, grad)
            elif self.last_micro_batch and self.on_grad_ready is not None:
                self.on_grad_ready(index)

        return accumulated

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        """Add one micro-batch's `grad` of tensor `index` into the gradient the optimizer steps (its fp32 master's
        under mixed precision), as backward accumulates it, and in the step's last micro-batch report it complete
        (for a tensor backward does not reach itself: an expert's slice of a fused gradient)."""
        master = self.masters[index]
        if master.grad is None:
            master.grad = grad.to(torch.float32, copy=True)
        else:
            master.grad.add_(grad)
        if self.last_micro_batch and self.on_grad_ready is not None:
            self.on_grad_ready(index)

    @torch.no_grad()
    def cast_down(self, index: int | None = None) -> None:
        """Copy the masters (or master `index` alone) into the model's resident weights (a cast to their dtype);
        nothing under fp32."""
        if self.mixed:
            pairs = zip(self.params, self.masters) if index is None else [(self.params[index], self.masters[index])]
            for param, master in pairs:
                param.copy_(master)

    def close(self) -> None:
        """Remove the hooks and free the masters' gradients (the masters go with this object)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for master in self.masters:
            master.grad = None


def host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """`tensor` in host memory (pinned with `pin`, for fast copies back to a CUDA device): itself when it is there
    already, else a copy."""
    if tensor.device.type == "cpu" and (not pin or tensor.is_pinned()):
        return tensor.detach()
    if not pin:
        return tensor.detach().cpu()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
