"""BCD inside a Hugging Face `transformers.Trainer` (or TRL's trainers, which are Trainers).

    bcd = BlockCoordinateDescent(model, blocks=3, steps_per_visit=50, optimizer="adamw", lr=1e-4)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=bcd.optimizers,
                      callbacks=[bcd.callback])

The options are `preinfer bcd`'s config keys (`ARGUMENTS`), with its defaults (an option not given is the config's
default; a comma-list option may be a list, `block_lr=[1, 0.5]`), judged by its rules on the run as it resolves
(`preinfer.config.resolved.check_resolved`: precision auto resolved from the model's weights): the blocks (`ufp`, `blocks` or `ranges`; `separate_ends`),
their order (`order`, `fixed_order`, `start_block`, `seed`), `steps_per_visit`, the optimizer (`optimizer`, `lr`,
`betas`, `momentum`, `weight_decay`, `keep_state`, `fused_step`, `block_lr`), each visit's schedule
(`warmup_steps`, `decay`), `precision` and landscape expansion over the suffix (`expand`, `expand_rank`,
`expand_lr`: `preinfer.expansion`'s hooks, activated before each visit's optimizer opens, after each of its steps
and at its end, as `preinfer bcd` runs them; a visit's low-rank factors are merged when it ends, and `close()` ends
the open one) and frozen weights in fewer bits (`frozen_dtype`: `preinfer.frozen_weights`' hook, as `preinfer bcd`
runs it: every layer outside the active block runs from codes, its master exact; the model's state dict, and so
every save, holds the masters), the hooks' tensors on the model's device. One visit trains one block for `steps_per_visit` optimizer steps (with
gradient accumulation an optimizer step is `gradient_accumulation_steps` micro-batches), then the next block of the
order; the sweeps go on until the Trainer's `max_steps`. The optimizer lifecycle is `preinfer bcd`'s own (`preinfer.visit_optimizer`).

- `BlockOptimizer` steps the active block only: every other weight has `requires_grad=False` (no gradient, no
  optimizer state), and the optimizer, with its state, is rebuilt at each switch (`keep_state=True` keeps each
  block's state for its next visit). Its `state_dict` holds the position (sweep, visit, visit step, the sweep's
  order), the visit length, the active block's optimizer state and, under mixed precision, its fp32 masters: only
  tensors and plain Python types, which `Trainer` saves with `torch.save` and loads with
  `torch.load(weights_only=True)`, so `trainer.train(resume_from_checkpoint=...)` continues the same visit at the
  same step. The state carries the config it was trained with: resuming with any other argument is refused in
  one line naming it (the check of `preinfer bcd --resume`, `preinfer.config.resume.refused_changes`).
- `VisitSchedule` sets each step's learning rate from the visit's step (`preinfer.optim.LrSchedule`).
- `meter` (a `preinfer.memory.meter.MemoryMeter` of the model), if given, tracks the first steps of each visit as
  `preinfer bcd` does; each finished visit's peaks land in `optimizer.visit_memory`.
- `BlockCallback` refuses `fp16=True` / `bf16=True` (autocast over float32 weights) in favour of `precision`, and
  while the Trainer trains it hands `max_grad_norm` to the optimizer, which clips the fp32 tensors it steps (the
  masters under mixed precision), as `preinfer bcd` does; the Trainer's own clipping is off meanwhile. With
  `fused_step=True` it refuses `max_grad_norm` > 0 and `gradient_accumulation_steps` > 1 (each tensor steps in
  backward, before the step's other gradients exist).
- A second `BlockCoordinateDescent` made on the same model replaces the first, whose optimizer steps no more.

Precision (`preinfer.precision`): mixed precision casts every weight to 16 bits when the object is made; the
active block alone has fp32 masters, gradients and optimizer state, for its visit. Under fp16-mixed the loss is
scaled dynamically (`LossScaler`, applied through a gradient hook on the model's loss, so the loss the Trainer
logs is the true one), and a step whose gradients are not finite is skipped.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from torch import nn
from transformers import TrainerCallback

from preinfer.block_order import parse_fixed_order, sweep_order
from preinfer.config import ArgumentNaming, config_from_arguments
from preinfer.config.resolved import check_resolved
from preinfer.errors import UsageError
from preinfer.expansion import expansion_hooks, widest_rank
from preinfer.frozen_weights import frozen_weight_hooks
from preinfer.hf_optimizer import BlockOptimizer, VisitSchedule
from preinfer.memory.meter import MemoryMeter
from preinfer.families import stage
from preinfer.moe import sparse_blocks
from preinfer.partition import make_partition, parse_ufp
from preinfer.precision import resolve_precision, weights_dtype

# BlockCoordinateDescent's arguments that are config keys: argument -> "section.key".
ARGUMENTS = {"steps_per_visit": "stop.steps_per_visit", "ufp": "blocks.ufp", "blocks": "blocks.blocks",
             "ranges": "blocks.ranges", "separate_ends": "blocks.separate_ends", "order": "blocks.order",
             "fixed_order": "blocks.fixed_order", "start_block": "blocks.start_block", "seed": "run.seed",
             "optimizer": "optim.name", "lr": "optim.lr", "betas": "optim.betas", "momentum": "optim.momentum",
             "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps", "decay": "optim.decay",
             "keep_state": "optim.keep_state", "precision": "run.precision", "fused_step": "optim.fused_step",
             "block_lr": "optim.block_lr", "expand": "blocks.expand", "expand_rank": "blocks.expand_rank",
             "expand_lr": "blocks.expand_lr", "frozen_dtype": "model.frozen_dtype"}
NAMING = ArgumentNaming("BlockCoordinateDescent", {key: argument for argument, key in ARGUMENTS.items()})
_BCD_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its BlockCoordinateDescent


class BlockCallback(TrainerCallback):
    """Checks the Trainer's arguments against BCD's precision when the Trainer is made; takes the Trainer's
    clipping over while it trains (the optimizer clips the fp32 tensors it steps, as `preinfer bcd` does; the
    Trainer's `max_grad_norm` is 0 meanwhile, so nothing is clipped twice); with a meter, tracks the forward and
    backward of the steps it says are due."""

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
        if self.optimizer.optimizers.optim.fused_step:
            refuse_for_fused_step(args)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        self.optimizer.grad_clip, args.max_grad_norm = args.max_grad_norm or 0.0, 0.0
        return control

    def on_train_end(self, args, state, control, **kwargs):
        args.max_grad_norm = self.optimizer.grad_clip  # the arguments as they were given
        return control


def refuse_for_fused_step(args) -> None:
    """Refuse the Trainer's arguments that need every gradient of a step before the first tensor steps."""
    why = "fused_step=True steps each tensor in backward, before"
    if args.gradient_accumulation_steps > 1:
        raise UsageError(f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps}): {why} "
                         f"the Trainer's micro-batches are all through; pass gradient_accumulation_steps=1 or drop "
                         f"fused_step")
    if args.max_grad_norm:
        raise UsageError(f"TrainingArguments(max_grad_norm={args.max_grad_norm}): {why} the global gradient norm is "
                         f"known; pass max_grad_norm=0 or drop fused_step")


class BlockCoordinateDescent:
    """BCD for `transformers.Trainer`: `optimizers` (the optimizer and its scheduler) and `callback`, built from
    the model and `preinfer bcd`'s block and optimizer options (see the module's docstring)."""

    def __init__(self, model: nn.Module, *, meter: MemoryMeter | None = None, **options: Any):
        """`options`: the config keys of `ARGUMENTS` by their argument names (`steps_per_visit` is required); an
        option not given keeps the config's default (`preinfer.config.sections`), so these are `preinfer bcd`'s."""
        if "steps_per_visit" not in options:
            raise UsageError("BlockCoordinateDescent needs steps_per_visit=N: the optimizer steps of one visit (the "
                             "Trainer's max_steps ends the run)")
        config = config_from_arguments("BlockCoordinateDescent", ARGUMENTS, options)  # refused before the model
        # is cast or staged
        config.run.device = str(next(model.parameters()).device)  # where the hooks put codes and factors
        b, seed = config.blocks, config.run.seed
        self.precision = resolve_precision(config.run.precision, weights_dtype(model))
        self.staged = stage(model)
        self.partition = make_partition(self.staged, ufp=None if b.ufp is None else parse_ufp(b.ufp),
                                        num_blocks=b.blocks, ranges=b.ranges, separate_ends=b.separate_ends)
        check_resolved(config, self.precision, NAMING, len(self.partition),  # the rules judge the resolved run
                       sparse=bool(sparse_blocks(self.staged.layers)), widest=widest_rank(self.staged))
        previous = _BCD_OF.get(model)
        if previous is not None:  # one BCD at a time holds a model's hooks and masters: the newer one
            previous.close()
        self.precision.apply(model)
        count = len(self.partition)
        fixed = parse_fixed_order(b.fixed_order, count) if b.fixed_order else None
        sweep_order(b.order, count, 0, seed, b.start_block, fixed)  # a bad order or start block is refused here

        def visits(sweep: int) -> list[int]:
            return sweep_order(b.order, count, sweep, seed, b.start_block, fixed)

        self.optimizer = BlockOptimizer(self.staged, self.partition, config, NAMING, visits, self.precision, meter,
                                        lambda step: [*frozen_weight_hooks(self.staged, config),
                                                      *expansion_hooks(self.staged, config, step)])
        self.scheduler = VisitSchedule(self.optimizer)
        self.callback = BlockCallback(self.optimizer)
        self.hooks = [model.register_forward_hook(self._scale_loss)] if self.optimizer.scaler.enabled else []
        _BCD_OF[model] = self

    def close(self) -> None:
        """Let go of the model (a newer BlockCoordinateDescent on it does this): the open visit ends (its low-rank
        factors merged), no hook or master of this one stays, and its optimizer steps no more."""
        for hook in self.hooks:
            hook.remove()
        self.optimizer.close()

    @property
    def optimizers(self) -> tuple[BlockOptimizer, VisitSchedule]:
        """What `Trainer(optimizers=...)` takes."""
        return self.optimizer, self.scheduler

    def _scale_loss(self, module: nn.Module, inputs: tuple, output) -> None:
        """fp16-mixed: scale the gradient flowing back from the training loss by the loss scale."""
        loss = getattr(output, "loss", None)
        if module.training and loss is not None and loss.requires_grad:
            loss.register_hook(self.optimizer.scaler.scale_loss)
