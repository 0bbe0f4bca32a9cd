"""The rules of the memory savers, torch-free (the config's rules read them): the fused step, the loss over the
head, frozen weights in fewer bits, frozen layers streamed from host memory and masters on disk."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from preinfer.liger_extra import liger_installed

Problem = tuple[str, str, str]  # (section, key, what was expected): as `preinfer.config.rules` reads them


def fused_step_problems(c: Any) -> Iterator[Problem]:
    """What the fused step cannot run with: what needs every gradient of a step before the first tensor steps."""
    if not c.optim.fused_step:
        return
    why = "false with {}: the fused step steps each tensor in backward, before {}"
    if c.optim.grad_clip > 0:
        yield "optim", "fused_step", why.format("{optim.grad_clip} > 0", "the global gradient norm is known")
    if c.run.precision == "fp16-mixed":
        yield "optim", "fused_step", why.format("{run.precision} fp16-mixed", "loss scaling checks every gradient")


def loss_problems(c: Any) -> Iterator[Problem]:
    """Liger's kernel where it runs (installed, a CUDA device), and offload only of recomputation's checkpoints."""
    r = c.run
    if r.loss == "liger" and not liger_installed():
        yield "run", "loss", "auto, chunked or plain: liger needs liger-kernel, which is not installed (pip install " \
                             "preinfer[liger])"
    elif r.loss == "liger" and not r.device.startswith("cuda"):
        yield "run", "loss", "auto, chunked or plain unless {run.device} is cuda (Liger's kernel runs on CUDA only)"
    if r.offload and not r.recompute:
        yield "run", "offload", "false unless {run.recompute} is true (it offloads recomputation's checkpoints)"


def frozen_dtype_problems(c: Any) -> Iterator[Problem]:
    """Frozen weights in fewer bits: in BCD."""
    frozen = c.model.frozen_dtype
    if frozen == "auto":
        return
    if c.run.mode == "full":
        yield "model", "frozen_dtype", f"auto with {{run.mode}} full (every weight trains: none is frozen to hold " \
                                       f"in {frozen})"


def stream_frozen_problems(c: Any) -> Iterator[Problem]:
    """Frozen layers streamed from host memory (`preinfer.stream_frozen`): BCD in one process."""
    if not c.model.stream_frozen:
        return
    why = "false with {}: frozen layers are streamed in one process's layer-major step"
    if c.run.mode == "full":
        yield "model", "stream_frozen", "false with {run.mode} full (every layer trains: none is frozen to stream)"
    elif c.run.pipeline > 1:
        yield "model", "stream_frozen", why.format("{run.pipeline} > 1")
    elif c.blocks.experts is not None:
        yield "model", "stream_frozen", why.format("{blocks.experts}")


def masters_problems(c: Any) -> Iterator[Problem]:
    """Masters on disk (`preinfer.mapped_masters`): one process training the model it maps, on an accelerator with
    its frozen layers streamed (the mapped masters stay in host memory, `preinfer.device_placement`)."""
    if c.model.masters != "disk":
        return
    if c.run.pipeline > 1:
        yield "model", "masters", "host with {run.pipeline} > 1: masters on disk are mapped and written by one process"
    elif c.run.device != "cpu" and not c.model.stream_frozen:
        yield "model", "masters", f"host with {{run.device}} {c.run.device} unless {{model.stream_frozen}} (on a " \
                                  f"GPU the mapped masters stay in host memory while the frozen layers stream)"
    elif c.store.path is not None:
        yield "model", "masters", "host with {store.path} (a cache's suffix is trained from its files in memory)"
