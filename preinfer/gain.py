"""The gain stopping rule (`--stop gain`): a visit ends when another block would lower the loss faster.

The active block's rate is its recent loss decrease per second: over the last 2W steps (W = `--gain-window`), the
mean loss of the older W steps minus the mean loss of the newer W, over the difference of their mean end times
(seconds since the visit began). Its initial rate is the first such rate of the visit (at step 2W).

Another block b is predicted to lower the loss at

    predicted_b = (score_b / score_active) * initial_rate * H / (H + switch_b)

its scores measured at the sweep's start (`preinfer.importance`): a block with a larger gradient per parameter is
taken to gain proportionally faster than the active block did at its own start. `switch_b` is the seconds before b
could start training (making its store, or running its prefix live, as the run's visit sources estimate it), spread
over H, the seconds a visit lasts: the active visit's seconds per step so far times its step budget (its seconds so
far when it has no budget). The visit ends at the first step whose rate is below the best prediction; the
predictions, rates and switch costs are logged in the visit's record. Times come from the trainer's clock, which
tests replace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GainRule:
    """The gain rule of one visit; `ratios` and `switch_s` by the other blocks' indices (as strings: JSON keys)."""

    window: int
    ratios: dict[str, float]  # other block -> its score over the active block's, at the sweep's start
    switch_s: dict[str, float]  # other block -> seconds before it could start training
    budget: int | None  # the visit's step budget; None: none
    seconds: float = 0.0  # the visit's seconds so far (the sum of its steps' clock differences)
    steps: int = 0
    history: list[list[float]] = field(default_factory=list)  # [seconds, loss] of the last 2 * window steps
    initial_rate: float | None = None
    rate: float | None = None
    predicted: dict[str, float] = field(default_factory=dict)
    last_clock: float | None = None  # the clock at the last step (or the visit's start); not carried by a resume

    def begin(self, now: float) -> None:
        """The visit starts (or resumes) at clock `now`."""
        self.last_clock = now

    def update(self, loss: float, now: float) -> bool:
        """Record one step's loss, ended at clock `now`; True when the visit should end."""
        self.seconds += now - (self.last_clock if self.last_clock is not None else now)
        self.last_clock = now
        self.steps += 1
        self.history = (self.history + [[self.seconds, loss]])[-2 * self.window:]
        if len(self.history) < 2 * self.window:
            return False
        older, newer = self.history[:self.window], self.history[self.window:]
        elapsed = _mean(t for t, _ in newer) - _mean(t for t, _ in older)
        self.rate = (_mean(l for _, l in older) - _mean(l for _, l in newer)) / max(elapsed, 1e-12)
        if self.initial_rate is None:
            self.initial_rate = self.rate
        horizon = self.horizon_s
        self.predicted = {b: ratio * max(self.initial_rate, 0.0) * _share(horizon, self.switch_s[b])
                          for b, ratio in self.ratios.items()}
        return bool(self.predicted) and self.rate < max(self.predicted.values())

    @property
    def horizon_s(self) -> float:
        """The seconds a visit lasts: seconds per step so far times the step budget (or the seconds so far)."""
        if self.budget is None or self.steps == 0:
            return self.seconds
        return self.seconds / self.steps * self.budget

    @property
    def best(self) -> str | None:
        """The other block with the best predicted rate."""
        return max(self.predicted, key=lambda b: (self.predicted[b], -int(b)), default=None)

    def report(self) -> dict:
        """What the visit's record logs."""
        return {"window": self.window, "rate": self.rate, "initial_rate": self.initial_rate,
                "horizon_s": self.horizon_s, "ratios": self.ratios, "switch_s": self.switch_s,
                "predicted": self.predicted, "best": self.best}

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "last_clock"}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def _share(horizon: float, switch: float) -> float:
    """The share of a visit's seconds spent training: H / (H + switch); 1 when both are 0."""
    return horizon / (horizon + switch) if horizon + switch > 0 else 1.0


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
