"""Live BCD steps of a preset measured by the memory meter, for the planner's agreement tests."""

from collections.abc import Callable

import torch

from preinfer.low_bit import low_bit_adam
from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.meter import MemoryMeter
from preinfer.staged import StagedModel


def visit_optimizer(params: list[torch.nn.Parameter], name: str) -> torch.optim.Optimizer:
    """The optimizer `name` (sgd with momentum, adam, or an 8-bit one) over `params`, at 1e-3."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return low_bit_adam(params, name, 1e-3, (0.9, 0.999), 0.0)


def metered_peak(staged: StagedModel, span: LayerSpan, optimizer: torch.optim.Optimizer, seq: int, batch: int,
                 after_step: Callable[[], None] = lambda: None) -> int:
    """The meter's tracked_peak over two live steps of the block `span` (its parameters already the only ones that
    require grad) on random tokens: sampled after backward and after each step, `after_step` run between."""
    model = staged.model
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    meter = MemoryMeter(model, steps_per_visit=None)
    for _ in range(2):
        with meter.track():
            with torch.set_grad_enabled(span.embed):
                state = staged.run(staged.embed(ids, labels=ids), 0, span.start)
            staged.loss(staged.run(state, span.start, staged.num_layers)).backward()
        meter.sample(optimizer)
        optimizer.step()
        after_step()
        meter.sample(optimizer)
        optimizer.zero_grad()
    return meter.report()["tracked_peak"]
