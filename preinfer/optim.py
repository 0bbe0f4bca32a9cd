"""A visit's optimizer, its learning-rate schedule (warmup, decay) and its stopping rule."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from preinfer.config import DEFAULT_LR, DEFAULT_WEIGHT_DECAY, LR_DECAYS, OptimConfig, StopConfig
from preinfer.errors import UsageError


def build_optimizer(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD with momentum, Adam or AdamW over `params`, with the paper's defaults where cfg leaves them open."""
    name = cfg.name.lower()
    if name not in DEFAULT_LR:
        raise UsageError(f"--optimizer '{cfg.name}' is not one of {', '.join(DEFAULT_LR)}")
    lr = cfg.lr if cfg.lr is not None else DEFAULT_LR[name]
    wd = cfg.weight_decay if cfg.weight_decay is not None else DEFAULT_WEIGHT_DECAY[name]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=wd)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=tuple(cfg.betas), weight_decay=wd)


@dataclass(frozen=True)
class LrSchedule:
    """A visit's learning rate, step by step, as a fraction of the full rate: linear warmup over `warmup` steps
    (step 0 at 1/warmup), then `decay` over the rest of the visit's `steps`: "none", or "linear" or "cosine" to 0
    (the decay of transformers' get_linear_schedule_with_warmup and get_cosine_schedule_with_warmup)."""

    warmup: int = 0
    decay: str = "none"
    steps: int | None = None

    @classmethod
    def for_visit(cls, cfg: OptimConfig, steps: int | None) -> LrSchedule:
        """The schedule of a visit of at most `steps` steps (None: it ends on a plateau, not at a known step)."""
        if cfg.decay not in LR_DECAYS:
            raise UsageError(f"--lr-decay {cfg.decay!r} is not one of {', '.join(LR_DECAYS)}")
        if cfg.decay != "none" and steps is None:
            raise UsageError(f"--lr-decay {cfg.decay} needs each visit's length: --steps-per-visit or "
                             f"--epochs-per-visit (a visit that ends on a plateau has no known last step)")
        return cls(cfg.warmup_steps, cfg.decay, steps)

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay == "none":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return 1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


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
