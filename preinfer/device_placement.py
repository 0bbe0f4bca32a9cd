"""Which of a run's tensors live in host memory, and so which its device holds from the start: the one decision
of where a loaded model goes (`host_tensors`; `pipelines.models.suffix.to_device` moves the rest).

- On a CPU device the device is the host: every tensor lives there, nothing moves.
- Resident (no `--stream-frozen`): the device holds the whole model.
- `--stream-frozen` on an accelerator: the held decoder layers' streamed tensors (`streamed_tensors`) stay in host
  memory where they were loaded (memory-mapped with `--masters disk`), never on the device whole. The device
  holds the rest from the start: the embedding, the head, the final norm and shared tables, and each layer's norms,
  biases and buffers (what the planner counts as the ends and the layers' resident bytes). A visit then brings the
  rest: its block's weights (`preinfer.frozen_weights`' restore of their masters, or the stream's fetch under frozen
  dtype auto) and at most two streamed frozen layers at a time (`preinfer.stream_frozen.LayerStream`).
"""

from __future__ import annotations

import torch
from torch import nn

from preinfer.config import Config
from preinfer.staged import StagedModel


def streamed_tensors(layer: nn.Module, codes: bool) -> list[torch.Tensor]:
    """The tensors of a decoder layer `--stream-frozen` keeps in host memory: with a frozen dtype (`codes`) its
    `nn.Linear` weights (the masters, whose codes the stream carries), else every parameter."""
    if codes:
        return [module.weight for module in layer.modules() if isinstance(module, nn.Linear)]
    return list(layer.parameters())


def host_tensors(staged: StagedModel, config: Config) -> set[int]:
    """The ids of the tensors of `staged` that live in host memory (see the module's docstring); every other
    tensor goes to `config.run.device` when the model is loaded."""
    if torch.device(config.run.device).type == "cpu":
        return {id(tensor) for tensor in (*staged.model.parameters(), *staged.model.buffers())}
    if not config.model.stream_frozen:
        return set()
    codes = config.model.frozen_dtype != "auto"
    held = [layer for layer in staged.layers if not any(p.is_meta for p in layer.parameters())]
    return {id(tensor) for layer in held for tensor in streamed_tensors(layer, codes)}
