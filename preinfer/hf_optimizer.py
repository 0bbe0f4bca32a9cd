"""The optimizer and scheduler `preinfer.hf.BlockCoordinateDescent` hands a `transformers.Trainer`: `BlockOptimizer`
(the active block's `preinfer.visit_optimizer.VisitOptimizer`, opened anew at each visit boundary, with the run's
position in its state) and `VisitSchedule` (each step's rate from the visit's step)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from preinfer.config import Config, Naming, config_from_dict
from preinfer.config.resume import refused_changes
from preinfer.errors import CheckpointError, UsageError
from preinfer.memory.meter import MemoryMeter
from preinfer.partition import Block, Partition
from preinfer.precision import Precision
from preinfer.staged import StagedModel
from preinfer.visit import VisitHook, activate_hooks, checkpointed, freeze, unfreeze
from preinfer.visit_optimizer import VisitOptimizer, VisitOptimizers

POSITION = ("sweep", "visit", "visit_step", "global_step")
STATE_KEYS = {"position", "order", "optimizer", "kept", "masters", "loss_scaler", "steps_per_visit", "config"}
# states saved before the config was, and before the visit length was
OLDER_STATE_KEYS = (STATE_KEYS - {"config"}, STATE_KEYS - {"config", "steps_per_visit"})


class BlockOptimizer:
    """The optimizer `Trainer` steps: the active block's `VisitOptimizer`, opened anew at each visit boundary."""

    def __init__(self, staged: StagedModel, partition: Partition, config: Config, naming: Naming,
                 order: Callable[[int], list[int]], precision: Precision, meter: MemoryMeter | None = None,
                 hooks: Callable[[Callable[[], int]], Sequence[VisitHook]] = lambda step: ()):
        """`naming`: how the config's keys are named (by the arguments that set them); `hooks`: the visit hooks
        (landscape expansion), made from a callable giving the run's global step."""
        optim, self.config, self.naming = config.optim, config, naming
        self.staged, self.partition, self.steps_per_visit = staged, partition, config.stop.steps_per_visit
        self.order, self.precision, self.meter = order, precision, meter
        self.metered = False  # the meter tracks the current step (the callback sets it)
        self.visit_memory: list[dict[str, int]] = []  # with a meter: each finished visit's peaks, as bcd reports them
        device = next(staged.model.parameters()).device.type  # the scale itself goes where the loss is
        self.optimizers = VisitOptimizers(optim, precision, device, len(partition))
        self.scaler = self.optimizers.scaler
        self.sweep = self.visit = self.visit_step = self.global_step = 0
        self.hooks = tuple(hooks(lambda: self.global_step))
        self.extras = 0  # how many of the open visit's tensors the hooks gave
        self._current: VisitOptimizer | None = None
        self.closed = False
        self._activate()

    @property
    def current(self) -> VisitOptimizer:
        """The visit's optimizer and masters."""
        if self.closed:
            raise UsageError("this BlockCoordinateDescent was replaced by one made later on the same model: pass "
                             "the newer one's optimizers and callback to the Trainer")
        return self._current

    @property
    def block(self) -> Block:
        """The block the current visit trains."""
        return self.partition.blocks[self.order(self.sweep)[self.visit]]

    @property
    def active(self):
        """The visit's `ActiveBlock` (its masters)."""
        return self.current.active

    @property
    def grad_clip(self) -> float:
        """The gradient norm the optimizer clips to (0: none); the callback sets it from `max_grad_norm`."""
        return self.optimizers.optim.grad_clip

    @grad_clip.setter
    def grad_clip(self, value: float) -> None:
        self.optimizers.optim = dataclasses.replace(self.optimizers.optim, grad_clip=value)
        self.current.grad_clip = value

    @property
    def param_groups(self) -> list[dict]:
        return self.current.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.current.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.current.optimizer.defaults

    def _activate(self, masters: Sequence[torch.Tensor] | None = None, state: dict | None = None) -> None:
        """Unfreeze the current block, activate the hooks (with their checkpointed values, the last of `masters`)
        and open the visit's optimizer, with `state` or the block's kept state."""
        block = self.block
        unfreeze(self.staged, block)
        extras = activate_hooks(self.hooks, block, masters)
        self.extras = len(extras)
        expected = (len(block.params) if self.precision.mixed else 0) + self.extras
        if masters is not None and len(masters) != expected:
            raise UsageError(f"the optimizer state carries {len(masters)} master tensors where this visit steps "
                             f"{expected}: resume with the expand and expand_rank the checkpoint was trained with")
        self._current = self.optimizers.open(block.index, [*block.params, *extras], self.steps_per_visit,
                                             masters if self.precision.mixed else None, state, self.extras)

    def _deactivate(self) -> None:
        """Freeze the block again; free its masters, gradients and (unless kept) optimizer state; end the hooks'
        visit (merge the low-rank factors)."""
        self.optimizers.close(self.block.index, self.current)
        freeze(self.block)
        for hook in reversed(self.hooks):
            hook.deactivate(self.block)
        self._current = None

    def close(self) -> None:
        """Leave the model: the active block frozen, its masters' hooks removed; this optimizer steps no more."""
        if not self.closed:
            self._deactivate()
            self.closed = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.current.optimizer.zero_grad(set_to_none=set_to_none)
        for param in self.block.params:
            param.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Step the active block (`VisitOptimizer.step`: under fp16-mixed unscaled, and only if its gradients are
        finite; clipped in fp32), then count the step and move to the next visit at the visit's last step."""
        if closure is not None:
            raise UsageError("BlockOptimizer.step takes no closure")
        self.current.step()
        for hook in self.hooks:
            hook.after_step()
        if self.metered:  # gradients, masters and optimizer state all present
            self.meter.sample(self.current.optimizer)
        self.zero_grad()
        self.visit_step += 1
        self.global_step += 1
        if self.visit_step == self.steps_per_visit:
            self._next_visit()

    def _next_visit(self) -> None:
        self._deactivate()
        if self.meter is not None:
            self.visit_memory.append(self.optimizers.with_host_bytes(self.meter.report()))
            self.meter.reset()
        self.visit, self.visit_step = self.visit + 1, 0
        if self.visit == len(self.order(self.sweep)):
            self.sweep, self.visit = self.sweep + 1, 0
        self._activate()

    def state_dict(self) -> dict:
        """The position, the visit length, the sweep's order, the optimizer state (active and kept), the masters
        (`preinfer.visit.checkpointed`: under fp32 the hooks' tensors only) and the loss scaler: tensors and plain
        Python types only."""
        return {
            "position": {key: getattr(self, key) for key in POSITION},
            "steps_per_visit": self.steps_per_visit,
            "order": self.order(self.sweep),
            "optimizer": self.current.state_dict(),
            "kept": {str(index): state for index, state in self.optimizers.kept.items()},
            "masters": [m.detach().clone() for m in checkpointed(self.current, self.extras)],
            "loss_scaler": self.scaler.state_dict() if self.scaler.enabled else None,
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved position: the block of that visit, with its optimizer state and masters. A visit
        length or optimizer setting (lr, betas, momentum, weight decay) other than the checkpoint's is refused:
        the run would not continue as it was trained."""
        if not isinstance(state, dict) or set(state) not in (STATE_KEYS, *OLDER_STATE_KEYS):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"optimizer state: expected BlockOptimizer's keys {sorted(STATE_KEYS)}, got {found}")
        position = state["position"]
        if not isinstance(position, dict) or set(position) != set(POSITION) or not all(
                isinstance(v, int) and v >= 0 for v in position.values()):
            raise CheckpointError(f"optimizer state: position {position!r:.80}: expected non-negative integers "
                                  f"{', '.join(POSITION)}")
        if "config" in state:
            self._check_config(state["config"])
        self._check_visit_length(state.get("steps_per_visit"), position["visit_step"])
        order = self.order(position["sweep"])
        if state["order"] != order or position["visit"] >= len(order):
            raise CheckpointError(f"optimizer state: the checkpoint trained blocks in the order {state['order']} "
                                  f"(visit {position['visit']}), this run's order is {order}: resume with the same "
                                  f"blocks, order, fixed_order, start_block and seed")
        self._deactivate()
        for key in POSITION:
            setattr(self, key, position[key])
        self.optimizers.kept = {int(index): kept for index, kept in state["kept"].items()}
        if self.scaler.enabled and state["loss_scaler"] is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        self._activate(state["masters"], state["optimizer"])

    def _check_config(self, saved: dict) -> None:
        """Refuse arguments other than those the checkpoint was trained with (`refused_changes`, the check of
        `preinfer bcd --resume`), each named by its argument."""
        changed = refused_changes(config_from_dict(saved, "the optimizer state's config"), self.config)
        if changed:
            keys = [key.split(".") for key in changed]
            raise UsageError("; ".join(
                f"{self.naming.key(*key)}={after!r}: the checkpoint was trained with {self.naming.key(*key)}={before!r}"
                for key, (before, after) in zip(keys, changed.values()))
                + "; resume with the arguments it was trained with (none of them is resumable)")

    def _check_visit_length(self, saved: int | None, visit_step: int) -> None:
        """Refuse a `steps_per_visit` other than the checkpoint's (older checkpoints do not say theirs: one shorter
        than the saved visit step is refused)."""
        if saved is not None and saved != self.steps_per_visit:
            raise UsageError(f"steps_per_visit={self.steps_per_visit}: the checkpoint's visits are {saved} steps "
                             f"long; resume with steps_per_visit={saved} (a visit's length is not resumable)")
        if saved is None and visit_step >= self.steps_per_visit:
            raise UsageError(f"steps_per_visit={self.steps_per_visit}: the checkpoint is at step {visit_step + 1} "
                             f"of its visit; resume with the steps_per_visit it was trained with")


class VisitSchedule:
    """The learning-rate scheduler `Trainer` steps: each step's rate is the visit's `LrSchedule` at the
    optimizer's visit step (every visit warms up and decays on its own)."""

    def __init__(self, optimizer: BlockOptimizer):
        self.optimizer = optimizer
        self._last_lr: list[float] = []
        self.step()

    def step(self) -> None:
        """Set the next step's rate (after the optimizer stepped, and possibly switched blocks)."""
        self.optimizer.current.set_rate(self.optimizer.visit_step)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        """Nothing: the rate follows the optimizer's position, which the optimizer's state holds."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.step()
