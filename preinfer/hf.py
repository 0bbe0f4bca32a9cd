"""BCD inside a Hugging Face `transformers.Trainer` (or TRL's trainers, which are Trainers).

    bcd = BlockCoordinateDescent(model, blocks=3, steps_per_visit=50, optimizer="adamw", lr=1e-4)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=bcd.optimizers,
                      callbacks=[bcd.callback])

The options are `preinfer bcd`'s, with its defaults: the blocks (`ufp`, `blocks` or `ranges`; `separate_ends`),
their order (`order`, `fixed_order`, `start_block`, `seed`), `steps_per_visit`, the optimizer (`optimizer`, `lr`,
`betas`, `momentum`, `weight_decay`, `keep_state`), each visit's schedule (`warmup_steps`, `decay`) and
`precision`. One visit trains one block for `steps_per_visit` optimizer steps (with gradient accumulation an
optimizer step is `gradient_accumulation_steps` micro-batches), then the next block of the order; the sweeps go
on until the Trainer's `max_steps`.

- `BlockOptimizer` steps the active block only: every other weight has `requires_grad=False` (no gradient, no
  optimizer state), and the optimizer, with its state, is rebuilt at each switch (`keep_state=True` keeps each
  block's state for its next visit). Its `state_dict` holds the position (sweep, visit, visit step, the sweep's
  order), the active block's optimizer state and, under mixed precision, its fp32 masters: only tensors and plain
  Python types, which `Trainer` saves with `torch.save` and loads with `torch.load(weights_only=True)`, so
  `trainer.train(resume_from_checkpoint=...)` continues the same visit at the same step.
- `VisitSchedule` sets each step's learning rate from the visit's step (`preinfer.optim.LrSchedule`: warmup from
  1/warmup, then none, linear or cosine decay to the visit's last step).
- `meter` (a `preinfer.memory.meter.MemoryMeter` of the model), if given, tracks the first steps of each visit as
  `preinfer bcd` does; each finished visit's peaks land in `optimizer.visit_memory`.
- `BlockCallback` checks the `TrainingArguments` when the Trainer is made: `fp16=True` / `bf16=True` (autocast
  over float32 weights) are refused in favour of `precision`. Under mixed precision it hands
  `max_grad_norm` to the optimizer, which clips the fp32 masters (the 16-bit weights hold no gradient there);
  under fp32 the Trainer's own clipping sees exactly the active block's gradients.

Precision (`preinfer.precision`): `precision="bf16-mixed"` / `"fp16-mixed"` casts every weight to 16 bits when
the object is made; the active block alone has fp32 masters, gradients and optimizer state, for its visit. Under
fp16-mixed the loss is scaled dynamically (`LossScaler`, which is `torch.amp.GradScaler` over the masters'
optimizer, applied through a gradient hook on the model's loss, so the loss the Trainer logs is the true one), the
masters' gradients are unscaled before clipping, and a step whose gradients are not finite is skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import TrainerCallback

from preinfer.block_order import parse_fixed_order, sweep_order
from preinfer.config import OptimConfig, config_from_arguments
from preinfer.config.choices import BlockOrder, LrDecay, Optimizer, Precision
from preinfer.errors import CheckpointError, UsageError
from preinfer.memory.meter import MemoryMeter
from preinfer.optim import LrSchedule, build_optimizer
from preinfer.partition import Block, Partition, make_partition, parse_ufp
from preinfer.precision import ActiveBlock, LossScaler, apply_precision
from preinfer.families import stage
from preinfer.staged import StagedModel
from preinfer.trainer import unfreeze

POSITION = ("sweep", "visit", "visit_step", "global_step")
# BlockCoordinateDescent's arguments that are config keys: argument -> "section.key".
ARGUMENTS = {"steps_per_visit": "stop.steps_per_visit", "ufp": "blocks.ufp", "blocks": "blocks.blocks",
             "ranges": "blocks.ranges", "separate_ends": "blocks.separate_ends", "order": "blocks.order",
             "fixed_order": "blocks.fixed_order", "start_block": "blocks.start_block", "seed": "run.seed",
             "optimizer": "optim.name", "lr": "optim.lr", "betas": "optim.betas", "momentum": "optim.momentum",
             "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps", "decay": "optim.decay",
             "keep_state": "optim.keep_state", "precision": "run.precision"}
STATE_KEYS = {"position", "order", "optimizer", "kept", "masters", "loss_scaler"}


class BlockOptimizer:
    """The optimizer `Trainer` steps: the active block's optimizer, rebuilt at each visit boundary."""

    def __init__(self, staged: StagedModel, partition: Partition, optim: OptimConfig, steps_per_visit: int,
                 order: Callable[[int], list[int]], precision: str, meter: MemoryMeter | None = None):
        self.staged, self.partition, self.optim, self.steps_per_visit = staged, partition, optim, steps_per_visit
        self.order, self.precision, self.meter = order, precision, meter
        self.metered = False  # the meter tracks the current step (the callback sets it)
        self.visit_memory: list[dict[str, int]] = []  # with a meter: each finished visit's peaks, as bcd reports them
        device = next(staged.model.parameters()).device.type  # the scale itself goes where the loss is
        self.scaler = LossScaler(device, enabled=precision == "fp16-mixed")
        self.grad_clip = optim.grad_clip
        self.sweep = self.visit = self.visit_step = self.global_step = 0
        self.kept: dict[int, dict] = {}  # keep_state: each block's optimizer state between its visits
        self.active: ActiveBlock | None = None
        self.inner: torch.optim.Optimizer | None = None
        self._activate()

    @property
    def block(self) -> Block:
        """The block the current visit trains."""
        return self.partition.blocks[self.order(self.sweep)[self.visit]]

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def _activate(self, masters: Sequence[torch.Tensor] | None = None, state: dict | None = None) -> None:
        """Unfreeze the current block, make its masters (mixed precision) and its optimizer, with `state` or the
        block's kept state."""
        block = self.block
        unfreeze(self.staged, block)
        self.active = ActiveBlock(list(block.params), self.precision != "fp32", list(masters) if masters else None)
        self.inner = build_optimizer(self.active.masters, self.optim)
        for group in self.inner.param_groups:
            group["initial_lr"] = group["lr"]
        saved = state if state is not None else self.kept.get(block.index)
        if saved is not None:
            self.inner.load_state_dict(saved)

    def _deactivate(self) -> None:
        """Freeze the block again; free its masters, gradients and (unless kept) optimizer state."""
        block = self.block
        if self.optim.keep_state:
            self.kept[block.index] = self.inner.state_dict()
        self.active.close()
        for param in block.params:
            param.requires_grad_(False)
            param.grad = None
        self.active = self.inner = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for param in self.block.params:
            param.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Step the active block (under fp16-mixed: unscaled, and only if its gradients are finite), then count
        the step and move to the next visit at the visit's last step."""
        if closure is not None:
            raise UsageError("BlockOptimizer.step takes no closure")
        self.scaler.unscale_(self.inner)
        if self.active.mixed and self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.active.masters, self.grad_clip)
        if self.scaler.step(self.inner):
            self.active.cast_down()
        if self.metered:  # gradients, masters and optimizer state all present
            self.meter.sample(self.inner)
        self.zero_grad()
        self.visit_step += 1
        self.global_step += 1
        if self.visit_step == self.steps_per_visit:
            self._next_visit()

    def _next_visit(self) -> None:
        if self.meter is not None:
            self.visit_memory.append(self.meter.report())
            self.meter.reset()
        self._deactivate()
        self.visit, self.visit_step = self.visit + 1, 0
        if self.visit == len(self.order(self.sweep)):
            self.sweep, self.visit = self.sweep + 1, 0
        self._activate()

    def state_dict(self) -> dict:
        """The position, the sweep's order, the optimizer state (active and kept), the masters and the loss
        scaler: tensors and plain Python types only."""
        return {
            "position": {key: getattr(self, key) for key in POSITION},
            "order": self.order(self.sweep),
            "optimizer": self.inner.state_dict(),
            "kept": {str(index): state for index, state in self.kept.items()},
            "masters": [m.detach().clone() for m in self.active.masters] if self.active.mixed else [],
            "loss_scaler": self.scaler.state_dict() if self.scaler.enabled else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved position: the block of that visit, with its optimizer state and masters."""
        if not isinstance(state, dict) or set(state) != STATE_KEYS:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"optimizer state: expected BlockOptimizer's keys {sorted(STATE_KEYS)}, got {found}")
        position = state["position"]
        if not isinstance(position, dict) or set(position) != set(POSITION) or not all(
                isinstance(v, int) and v >= 0 for v in position.values()):
            raise CheckpointError(f"optimizer state: position {position!r:.80}: expected non-negative integers "
                                  f"{', '.join(POSITION)}")
        order = self.order(position["sweep"])
        if state["order"] != order or position["visit"] >= len(order):
            raise CheckpointError(f"optimizer state: the checkpoint trained blocks in the order {state['order']} "
                                  f"(visit {position['visit']}), this run's order is {order}: resume with the same "
                                  f"blocks, order, fixed_order, start_block and seed")
        self._deactivate()
        for key in POSITION:
            setattr(self, key, position[key])
        self.kept = {int(index): kept for index, kept in state["kept"].items()}
        if self.scaler.enabled and state["loss_scaler"] is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        self._activate(state["masters"] or None, state["optimizer"])


class VisitSchedule:
    """The learning-rate scheduler `Trainer` steps: each step's rate is the visit's `LrSchedule` at the
    optimizer's visit step (every visit warms up and decays on its own)."""

    def __init__(self, optimizer: BlockOptimizer, schedule: LrSchedule):
        self.optimizer, self.schedule = optimizer, schedule
        self._last_lr: list[float] = []
        self.step()

    def step(self) -> None:
        """Set the next step's rate (after the optimizer stepped, and possibly switched blocks)."""
        factor = self.schedule.factor(self.optimizer.visit_step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        """Nothing: the rate follows the optimizer's position, which the optimizer's state holds."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.step()


class BlockCallback(TrainerCallback):
    """Checks the Trainer's arguments against BCD's precision when the Trainer is made; with a meter, tracks the
    forward and backward of the steps it says are due."""

    def __init__(self, optimizer: BlockOptimizer):
        self.optimizer = optimizer
        self._tracking = contextlib.ExitStack()

    def on_step_begin(self, args, state, control, **kwargs):
        meter = self.optimizer.meter
        self.optimizer.metered = meter is not None and meter.due()
        if self.optimizer.metered:
            self._tracking.enter_context(meter.track())
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._tracking.close()
        return control

    def on_init_end(self, args, state, control, **kwargs):
        for flag in ("fp16", "bf16"):
            if getattr(args, flag, False):
                raise UsageError(
                    f"TrainingArguments({flag}=True) autocasts float32 weights and keeps every weight's gradient "
                    f"and optimizer state in fp32; BCD keeps the weights in 16 bits with fp32 masters for the active "
                    f"block only: drop {flag}=True and pass precision='{flag}-mixed' to BlockCoordinateDescent")
        if self.optimizer.active.mixed:
            self.optimizer.grad_clip = args.max_grad_norm or 0.0
        return control


class BlockCoordinateDescent:
    """BCD for `transformers.Trainer`: `optimizers` (the optimizer and its scheduler) and `callback`, built from
    the model and `preinfer bcd`'s block and optimizer options (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        steps_per_visit: int,
        ufp: str | float | None = None,
        blocks: int | None = None,
        ranges: str | None = None,
        separate_ends: bool = False,
        order: BlockOrder = "ascending",
        fixed_order: str | None = None,
        start_block: int | None = None,
        seed: int = 0,
        optimizer: Optimizer = "adam",
        lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.9,
        weight_decay: float | None = None,
        warmup_steps: int = 0,
        decay: LrDecay = "none",
        keep_state: bool = False,
        precision: Precision = "auto",
        meter: MemoryMeter | None = None,
    ):
        if ufp is None and blocks is None and ranges is None:
            ufp = "1/3"
        config = config_from_arguments("BlockCoordinateDescent", ARGUMENTS, dict(
            steps_per_visit=steps_per_visit, ufp=None if ufp is None else str(ufp), blocks=blocks, ranges=ranges,
            separate_ends=separate_ends, order=order, fixed_order=fixed_order, start_block=start_block, seed=seed,
            optimizer=optimizer, lr=lr, betas=list(betas) if isinstance(betas, (list, tuple)) else betas,
            momentum=momentum, weight_decay=weight_decay, warmup_steps=warmup_steps, decay=decay,
            keep_state=keep_state, precision=precision))  # refused here, before the model is cast or staged
        b, optim = config.blocks, config.optim
        self.precision = apply_precision(model, config.run.precision)
        self.staged = stage(model)
        self.partition = make_partition(self.staged, ufp=None if b.ufp is None else parse_ufp(b.ufp),
                                        num_blocks=b.blocks, ranges=b.ranges, separate_ends=b.separate_ends)
        count = len(self.partition)
        fixed = parse_fixed_order(b.fixed_order, count) if b.fixed_order else None
        sweep_order(b.order, count, 0, seed, b.start_block, fixed)  # a bad order or start block is refused here

        def visits(sweep: int) -> list[int]:
            return sweep_order(b.order, count, sweep, seed, b.start_block, fixed)

        schedule = LrSchedule.for_visit(optim, steps_per_visit)
        self.optimizer = BlockOptimizer(self.staged, self.partition, optim, steps_per_visit, visits, self.precision,
                                        meter)
        self.scheduler = VisitSchedule(self.optimizer, schedule)
        self.callback = BlockCallback(self.optimizer)
        if self.optimizer.scaler.enabled:
            model.register_forward_hook(self._scale_loss)

    @property
    def optimizers(self) -> tuple[BlockOptimizer, VisitSchedule]:
        """What `Trainer(optimizers=...)` takes."""
        return self.optimizer, self.scheduler

    def _scale_loss(self, module: nn.Module, inputs: tuple, output) -> None:
        """fp16-mixed: scale the gradient flowing back from the training loss by the loss scale."""
        loss = getattr(output, "loss", None)
        if module.training and loss is not None and loss.requires_grad:
            loss.register_hook(self.optimizer.scaler.scale_loss)
