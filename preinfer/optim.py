"""A visit's optimizer, its learning-rate schedule (warmup, decay) and its stopping rule."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers import get_scheduler

from preinfer.config import DEFAULT_LR, DEFAULT_WEIGHT_DECAY, OptimConfig, StopConfig
from preinfer.config.choices import LOW_BIT_OPTIMIZERS
from preinfer.errors import UsageError
from preinfer.low_bit import low_bit_adam


def build_optimizer(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD with momentum, Adam or AdamW (or their 8-bit kin, `preinfer.low_bit`) over `params`, with the paper's
    defaults where cfg leaves them open."""
    name = cfg.name.lower()
    if name not in DEFAULT_LR:
        raise UsageError(f"--optimizer '{cfg.name}' is not one of {', '.join(DEFAULT_LR)}")
    lr = resolved_lr(cfg)
    wd = cfg.weight_decay if cfg.weight_decay is not None else DEFAULT_WEIGHT_DECAY[name]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=wd)
    if name in LOW_BIT_OPTIMIZERS:
        return low_bit_adam(params, name, lr, tuple(cfg.betas), wd)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=tuple(cfg.betas), weight_decay=wd)


def step_tensor(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> None:
    """`optimizer`'s step of `tensor` alone (the fused step, in backward): `step_param` where the optimizer has
    one (`preinfer.low_bit`), else its own step over groups that hold only `tensor` for the call."""
    group = next(g for g in optimizer.param_groups if any(p is tensor for p in g["params"]))
    if hasattr(optimizer, "step_param"):
        optimizer.step_param(tensor, group)
        return
    held = [g["params"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"] = [tensor] if g is group else []
    try:
        optimizer.step()
    finally:
        for g, params in zip(optimizer.param_groups, held):
            g["params"] = params


def resolved_lr(cfg: OptimConfig) -> float:
    """The run's rate: `lr`, or the optimizer's default."""
    return cfg.lr if cfg.lr is not None else DEFAULT_LR[cfg.name.lower()]


@dataclass(frozen=True)
class LrSchedule:
    """A visit's learning rate, step by step, as a fraction of the full rate: `transformers.get_scheduler`'s
    schedule `decay` ("none" is its constant_with_warmup) over the visit's `steps`, built per visit, except that
    our linear warmup starts at 1/warmup where transformers' starts at 0 (a documented choice: no step of a
    visit trains at rate 0); after warmup every value is transformers'."""

    warmup: int = 0
    decay: str = "none"
    steps: int | None = None
    lr: float = 1.0  # the visit's full rate (a schedule such as polynomial's end rate is absolute)
    after_warmup: Callable[[int], float] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.after_warmup is None:
            object.__setattr__(self, "after_warmup", transformers_factor(self.decay, self.warmup, self.steps, self.lr))

    @classmethod
    def for_visit(cls, cfg: OptimConfig, steps: int | None, lr: float = 1.0) -> LrSchedule:
        """The schedule of a visit of at most `steps` steps (None: it ends on a plateau, not at a known step: its
        decay has no end and its warmup is in steps, the config's rules, `preinfer.config.rules.rule_problems`)."""
        return cls(warmup_steps(cfg, steps), cfg.decay, steps, lr)

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return self.after_warmup(step)


def warmup_steps(cfg: OptimConfig, steps: int | None) -> int:
    """--warmup-steps, or --warmup-ratio of the visit's steps rounded up (as transformers' TrainingArguments)."""
    return math.ceil(cfg.warmup_ratio * steps) if cfg.warmup_ratio else cfg.warmup_steps


def transformers_factor(decay: str, warmup: int, steps: int | None, lr: float) -> Callable[[int], float]:
    """transformers' schedule `decay` ("none": constant_with_warmup) as a function of the step: its LambdaLR's
    lambda, built over a stand-in optimizer at rate `lr` (the trainer sets the rates of its own)."""
    name = "constant_with_warmup" if decay == "none" else decay
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    return get_scheduler(name, stand_in, num_warmup_steps=warmup, num_training_steps=steps).lr_lambdas[0]


@dataclass
class StopRule:
    """Ends a visit at a step budget, an epoch budget or a plateau of the smoothed loss, whichever comes first."""

    max_steps: int | None
    patience: int | None
    min_delta: float
    smoothing: float
    smoothed: float | None = None
    best: float = math.inf
    since_best: int = 0
    steps: int = 0

    @classmethod
    def for_visit(cls, cfg: StopConfig, steps_per_epoch: int) -> StopRule:
        budget = step_budget(cfg, steps_per_epoch)
        if budget is None and cfg.patience is None:
            raise UsageError("a visit needs a stopping rule: --steps-per-visit, --epochs-per-visit or --patience")
        return cls(budget, cfg.patience, cfg.min_delta, cfg.smoothing)

    def update(self, loss: float) -> str | None:
        """Record one step's loss; returns why the visit ends ('steps', 'plateau') or None to go on."""
        self.steps += 1
        self.smoothed = loss if self.smoothed is None else self.smoothing * self.smoothed + (1 - self.smoothing) * loss
        if self.smoothed < self.best - self.min_delta:
            self.best, self.since_best = self.smoothed, 0
        else:
            self.since_best += 1
        if self.max_steps is not None and self.steps >= self.max_steps:
            return "steps"
        if self.patience is not None and self.since_best >= self.patience:
            return "plateau"
        return None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def step_budget(cfg: StopConfig, steps_per_epoch: int) -> int | None:
    """The most steps a visit takes (--steps-per-visit, --epochs-per-visit: at least one step); None: no budget."""
    epochs = None if cfg.epochs_per_visit is None else max(1, math.ceil(cfg.epochs_per_visit * steps_per_epoch))
    budgets = [b for b in (cfg.steps_per_visit, epochs) if b]
    return min(budgets) if budgets else None
