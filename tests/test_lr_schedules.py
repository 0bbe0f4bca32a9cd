"""Learning-rate schedules: transformers' by name (get_scheduler), built per visit, our warmup start kept."""

import pytest
import torch
from transformers import get_scheduler

from preinfer.config import LR_DECAYS, OptimConfig, load_config
from preinfer.errors import UsageError
from preinfer.optim import LrSchedule


def transformers_rates(name: str, warmup: int, steps: int, lr: float) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("decay", [d for d in LR_DECAYS if d != "none"])
def test_every_schedule_after_warmup_is_transformers_one_of_that_name(decay):
    lr, warmup, steps = 3e-4, 3, 11
    schedule = LrSchedule.for_visit(OptimConfig(lr=lr, warmup_steps=warmup, decay=decay), steps, lr)
    ours = [lr * schedule.factor(step) for step in range(steps)]
    theirs = transformers_rates(decay, warmup, steps, lr)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12, abs=1e-18)
    assert ours[:warmup] == pytest.approx([lr / 3, 2 * lr / 3, lr])  # our warmup starts at 1/warmup, not 0


def test_none_is_a_constant_rate_after_warmup():
    schedule = LrSchedule.for_visit(OptimConfig(warmup_steps=2), None)
    assert [schedule.factor(s) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_warmup_ratio_is_the_visit_s_share_rounded_up_as_transformers_training_arguments():
    schedule = LrSchedule.for_visit(OptimConfig(warmup_ratio=0.25, decay="linear"), 10)
    assert schedule.warmup == 3  # ceil(2.5)
    assert [schedule.factor(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_warmup_ratio_needs_a_visit_length_and_excludes_warmup_steps():
    with pytest.raises(UsageError, match=r"--warmup-ratio 0.1 \(\[optim\] warmup_ratio\): expected 0 when a visit "
                                         r"ends on a plateau"):  # the config's rule, once
        load_config(overrides={"optim": {"warmup_ratio": 0.1}, "stop": {"patience": 3}})
    with pytest.raises(UsageError, match=r"--warmup-ratio 0.1 \(\[optim\] warmup_ratio\): expected 0 when"):
        load_config(overrides={"optim": {"warmup_ratio": 0.1, "warmup_steps": 2}})
    with pytest.raises(UsageError, match=r"--warmup-ratio 1.0 .*expected a number in \[0, 1\)"):
        load_config(overrides={"optim": {"warmup_ratio": 1.0}})


def test_a_schedule_with_an_end_needs_a_visit_length():
    with pytest.raises(UsageError, match=r"polynomial \(\[optim\] decay\): expected one of none, "
                                         r"constant_with_warmup, inverse_sqrt when a visit ends on a plateau"):
        load_config(overrides={"optim": {"decay": "polynomial"}, "stop": {"patience": 3}})
    assert LrSchedule.for_visit(OptimConfig(decay="inverse_sqrt", warmup_steps=4), None).factor(8) == \
        pytest.approx(transformers_rates("inverse_sqrt", 4, 9, 1.0)[8])
