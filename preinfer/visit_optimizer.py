"""The optimizer lifecycle of BCD, one for `preinfer.trainer.Trainer` and `preinfer.hf.BlockOptimizer` alike.

`VisitOptimizers` lasts the run: the optimizer configuration, the resolved precision, the loss scaler (fp16-mixed)
and, with `keep_state`, each block's optimizer state between its visits. `open` starts a visit: the tensors it
steps (fp32 masters of the block's weights under mixed precision, restored from a checkpoint when it resumes
mid-visit), their optimizer at its initial rates with the block's kept (or checkpointed) state, and the visit's
learning-rate schedule (`LrSchedule`, from the visit's step). `VisitOptimizer.step` is one optimizer step: unscale
(fp16-mixed), clip the fp32 gradients of what the optimizer steps, step unless a gradient is not finite, cast the
masters into the 16-bit weights. `close` ends the visit: the masters and their gradients are freed, the state kept
or dropped.

Kept state (`keep_state`) lives in host memory between visits (`on_host`: CPU tensors, pinned where CUDA is; the
8-bit optimizers' codes stay 8-bit), and is copied back onto the device when its block's next visit opens, so the
device holds the active block's state only. It is the state of the block's own tensors: a hook's tensors
(expansion's factors, drawn anew at each visit) start with fresh moments at every visit, mid-visit checkpoints
carry theirs. The step count continues from the kept state: Adam's bias correction
does not restart at a block's next visit (its moments are not cold). A checkpoint saves the kept states and a
resume brings them back, bit for bit.

The fused step (`fused_step`): each tensor's step runs in backward, as soon as its gradient of the step's last
micro-batch is complete (`ActiveBlock.watch`), and the gradient is freed at once, so a step's gradients are never
all resident (torchtune's optimizer in backward). The optimizer is the same one, stepping one tensor at a time
(`preinfer.optim.step_tensor`), so the weights equal the unfused step's. Gradient accumulation works (the earlier
micro-batches accumulate, the last one steps); under data parallelism each tensor steps once the reducer has
summed its bucket (`preinfer.grad_buckets`, still in backward); an expert's slice steps once backward has
completed its fused gradient (`preinfer.moe.ExpertGranular`). What needs every gradient of a step before the first
tensor steps is refused: global-norm clipping and fp16-mixed's loss scaling (`Config.validate`), and a pipeline's
replicas, whose stages sum their gradients after the whole step (at the stage's join). On a pipeline a stage tells
its block which micro-batch's backward is the step's last (`pipelines.pipeline_parallel.visit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from preinfer.block_lr import parse_block_lr
from preinfer.config import OptimConfig
from preinfer.errors import UsageError
from preinfer.memory.meter import tensor_bytes
from preinfer.optim import LrSchedule, build_optimizer, resolved_lr, step_tensor
from preinfer.precision import ActiveBlock, LossScaler, Precision, host_copy

# The optimizer settings a saved state must share with the run resuming it (torch's load_state_dict would
# silently bring back the saved ones).
RESUMED_SETTINGS = ("initial_lr", "betas", "momentum", "weight_decay")


def clip_norm(tensors: list[torch.Tensor], max_norm: float) -> None:
    """Clip the gradient norm of `tensors` (fp32: the visit's masters) to `max_norm`."""
    torch.nn.utils.clip_grad_norm_(tensors, max_norm)


class VisitOptimizer:
    """One visit's optimizer: its masters (`active`), the optimizer stepping them, its schedule and the run's loss
    scaler."""

    def __init__(self, params: list[nn.Parameter], optim: OptimConfig, precision: Precision, scaler: LossScaler,
                 steps: int | None, state: dict | None = None, masters: Sequence[torch.Tensor] | None = None,
                 extras: int = 0):
        """`extras`: how many of the last `params` are a hook's, made anew each visit (expansion factors): a kept
        state holds the block's own tensors only, and the extras start fresh."""
        self.active = ActiveBlock(list(params), precision.mixed, list(masters) if masters else None)
        self.own = len(params) - extras
        # none: an optimizer over nothing, for a pipeline stage without part of the block
        self.optimizer = build_optimizer(param_groups(self.active) or [{"params": []}], optim)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = group["lr"]
        if state is not None and self.active.masters:
            check_settings(state, self.optimizer)
            self.optimizer.load_state_dict(with_fresh_extras(state, self.optimizer.state_dict(), self.own))
        self.schedule = LrSchedule.for_visit(optim, steps, self.initial_lr)
        self.scaler, self.grad_clip, self.fused = scaler, optim.grad_clip, optim.fused_step
        if self.fused and self.active.masters:
            self.active.watch(self._step_one)

    @property
    def initial_lr(self) -> float:
        return self.optimizer.param_groups[0]["initial_lr"]

    @property
    def lr(self) -> float:
        """The rate of the current step."""
        return self.optimizer.param_groups[0]["lr"]

    def set_rate(self, visit_step: int) -> None:
        """The rate of step `visit_step` of the visit (0 first)."""
        factor = self.schedule.factor(visit_step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward runs from (scaled under fp16-mixed)."""
        return self.scaler.scale_loss(loss)

    @torch.no_grad()
    def _step_one(self, index: int) -> None:
        """The fused step of tensor `index`, in backward once its gradient is complete: step it, free its
        gradient, cast its master down."""
        master = self.active.masters[index]
        step_tensor(self.optimizer, master)
        master.grad = None
        self.active.cast_down(index)

    @torch.no_grad()
    def step(self, clip: Callable[[list[torch.Tensor], float], None] = clip_norm) -> bool:
        """Unscale the gradients (fp16-mixed), clip their norm with `clip` (the fp32 gradients of the tensors the
        optimizer steps) when `grad_clip` is set, step unless a gradient is not finite, and cast the masters
        down; True if it stepped. With the fused step every tensor stepped in backward: nothing is left to do."""
        if self.fused:
            return True
        self.scaler.unscale_(self.optimizer)
        if self.grad_clip > 0:
            clip(self.active.masters, self.grad_clip)
        stepped = self.scaler.step(self.optimizer)
        if stepped:
            self.active.cast_down()
        return stepped

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def own_state(self) -> dict:
        """The state of the block's own tensors (the first `own`), as a kept state holds it between visits."""
        state = self.state_dict()
        first = state["param_groups"][0]
        return {"state": {i: entries for i, entries in state["state"].items() if i < self.own},
                "param_groups": [{**first, "params": [i for i in first["params"] if i < self.own]}]}


def with_fresh_extras(saved: dict, fresh: dict, own: int) -> dict:
    """`saved` as the state of an optimizer whose state is `fresh`: a kept state covers the block's `own` tensors,
    which lead the first group, and the hooks' tensors after them start fresh (the first group's settings are the
    saved ones); any other state (a mid-visit checkpoint's covers every tensor) is `saved` itself."""
    count = sum(len(group["params"]) for group in saved["param_groups"])
    if count != own or own == sum(len(group["params"]) for group in fresh["param_groups"]):
        return saved
    first, *rest = fresh["param_groups"]
    return {"state": saved["state"], "param_groups": [{**saved["param_groups"][0], "params": first["params"]}, *rest]}


def param_groups(active: ActiveBlock) -> list[dict]:
    """The optimizer's parameter groups: every tensor at the run's rate, except those whose parameter carries a
    `visit_lr` of its own (a hook's, e.g. `preinfer.expansion`'s factors), in a group per such rate after it."""
    rates = [getattr(param, "visit_lr", None) for param in active.params]
    groups = [{"params": [m for m, rate in zip(active.masters, rates) if rate is None]}]
    for rate in dict.fromkeys(rate for rate in rates if rate is not None):
        groups.append({"params": [m for m, r in zip(active.masters, rates) if r == rate], "lr": rate})
    return [group for group in groups if group["params"]]


def check_settings(state: dict, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a saved optimizer state whose settings (rate, betas, momentum, weight decay) are not the run's."""
    saved, current = state.get("param_groups") or [{}], optimizer.param_groups[0]
    for key in RESUMED_SETTINGS:
        if key in saved[0] and key in current and _plain(saved[0][key]) != _plain(current[key]):
            name = "lr" if key == "initial_lr" else key
            raise UsageError(f"{name}={_plain(current[key])}: the optimizer state being resumed was trained with "
                             f"{name}={_plain(saved[0][key])}; resume with the same {name} (it is not resumable)")


def _plain(value: object) -> object:
    return tuple(value) if isinstance(value, (list, tuple)) else value


class VisitOptimizers:
    """A run's optimizer lifecycle: one `VisitOptimizer` per visit, the kept states between visits, the loss
    scaler of the whole run."""

    def __init__(self, optim: OptimConfig, precision: Precision, device_type: str, blocks: int = 1):
        """`blocks`: how many the partition has (for `block_lr`'s factors)."""
        self.optim, self.precision = optim, precision
        self.scaler = LossScaler(device_type, enabled=precision.loss_scaling)
        self._kept: dict[int, dict] = {}
        self.factors = parse_block_lr(optim.block_lr).factors(blocks) if optim.block_lr else None

    @property
    def kept(self) -> dict[int, dict]:
        """Block -> its optimizer state in host memory (keep_state, or a checkpoint's)."""
        return self._kept

    @kept.setter
    def kept(self, states: dict[int, dict]) -> None:
        self._kept = {block: on_host(state) for block, state in states.items()}

    def host_bytes(self) -> int:
        """Bytes of the kept states' tensors (all in host memory)."""
        return sum(tensor_bytes(value) for state in self._kept.values() for entries in state["state"].values()
                   for value in entries.values() if torch.is_tensor(value))

    def with_host_bytes(self, report: dict[str, int]) -> dict[str, int]:
        """A visit's memory `report` with `host_optimizer`, the kept states' bytes in host memory (keep_state)."""
        return {**report, "host_optimizer": self.host_bytes()} if self.optim.keep_state else report

    def open(self, block: int, params: list[nn.Parameter], steps: int | None,
             masters: Sequence[torch.Tensor] | None = None, state: dict | None = None,
             extras: int = 0) -> VisitOptimizer:
        """The optimizer of a visit of block `block` stepping `params` (the last `extras` of them a hook's) for at
        most `steps` steps (None: open ended), with `state` or the block's kept state, and `masters` from a
        mid-visit checkpoint."""
        saved = state if state is not None else self.kept.get(block)
        return VisitOptimizer(params, self.visit_config(block), self.precision, self.scaler, steps, saved, masters,
                              extras)

    def visit_config(self, block: int) -> OptimConfig:
        """The optimizer configuration of a visit of `block`: the run's, at the block's rate (`block_lr`)."""
        if self.factors is None:
            return self.optim
        return dataclasses.replace(self.optim, lr=resolved_lr(self.optim) * self.factors[block])

    def close(self, block: int, visit: VisitOptimizer) -> None:
        """End the visit: keep its state in host memory (keep_state) or drop it, free its device state, its
        masters' gradients and its hooks."""
        if self.optim.keep_state:
            self._kept[block] = on_host(visit.own_state())
        else:
            self._kept.pop(block, None)
        visit.optimizer.state.clear()
        visit.active.close()

    def states(self, block: int | None = None, visit: VisitOptimizer | None = None) -> dict[int, dict]:
        """The states a checkpoint saves: the kept ones, and mid-visit the active block's."""
        return self._kept if visit is None else {**self._kept, block: visit.state_dict()}


def on_host(state: dict) -> dict:
    """An optimizer state dict with every tensor in host memory (pinned where CUDA is, for the copy back)."""
    pin = torch.cuda.is_available()
    return {"state": {index: {key: host_copy(value, pin) if torch.is_tensor(value) else value
                              for key, value in entries.items()} for index, entries in state["state"].items()},
            "param_groups": state["param_groups"]}
