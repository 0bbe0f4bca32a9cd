"""Memory meter: peak bytes of parameters, gradients, optimizer state and saved activations of one model.

How the peaks are measured (and why `tracked_peak` is coherent with the planner in `preinfer.memory`):

- parameters: every parameter of the model (trainable or frozen), once per tensor, at every `sample()`; a tensor
  subclass counts the tensors it holds (`__tensor_flatten__`): a frozen weight held in fewer bits
  (`preinfer.frozen_weights.FrozenWeight`) its codes, not its own storage, which is its host master (the planner's
  `host`, not on the device).
- gradients: every `.grad` present in the model or on the optimizer's tensors, at every `sample()` (call it after
  `backward()`, where the gradients of one step are all present, and after `optimizer.step()`).
- masters: under mixed precision the optimizer steps fp32 copies of the active block's weights; every tensor the
  optimizer steps that is not a parameter of the model is counted here, at every `sample()`. Under bf16-mixed:
  parameters = 2 bytes x all parameters; masters + gradients + Adam state = 16 bytes x the active block's
  parameters (plus Adam's 4-byte step counter per tensor).
- frozen layers streamed from host memory (`--stream-frozen`, `preinfer.stream_frozen`): their weights are not
  counted as parameters; `frozen_device` is the peak of their bytes on the device during the visit (at most two
  layers: the one computing and the next being copied), the stream's own count, which `tracked_peak` adds.
- optimizer state: every tensor in `optimizer.state`, at every `sample()` after `optimizer.step()`.
- saved activations: inside `track()`, every tensor autograd saves for backward is seen by a
  `saved_tensors_hooks` pack hook, and released when autograd lets go of it (after its node ran in backward, or
  when the graph is dropped). Each distinct storage held is counted once (its full size, since a saved view keeps
  its whole storage alive); storages of model parameters (and views of them) are skipped because they are
  counted as parameters, and so are those of any other parameter (a visit's own, such as landscape
  expansion's factors, counted where the optimizer steps them). The step's activation peak is the maximum of the bytes held: the end of forward, or,
  with recomputation, a moment in backward when a layer's recomputed tensors join the checkpointed inputs.
  One `track()` covers one step (forward + backward); each starts at 0.
- sampled steps: tracking costs a Python call per saved tensor (several percent of a small model's step), and
  every step of a visit saves tensors of the same shapes, so the trainer tracks only the first
  `steps_per_visit` steps after each `reset()` (one per visit; 2 by default: the first step also creates the
  optimizer state) and asks `due()` before each step. `steps_per_visit=None` tracks every step.
- `tracked_peak`: the maximum over `sample()` calls of parameters + masters + gradients + optimizer state present
  at that call + the activation peak of the latest tracked step. It is the footprint of a step whose gradients from the
  previous step and whose optimizer state are still resident while the next forward saves its activations: an
  upper bound of the true peak of a framework that frees activations as backward proceeds, and exactly the sum
  the planner models (weights + gradients + optimizer state + activations).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (numel x element size), not of the storage behind it; a tensor subclass that
    holds others (torchao's NF4 weights, 8-bit optimizer moments) is the sum of the tensors it holds."""
    if hasattr(t, "__tensor_flatten__"):
        return sum(tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """Identity of a tensor's storage (device, data pointer), or None for tensors without one (a wrapper subclass
    such as torchao's NF4 weight)."""
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind a tensor (what a saved view keeps alive)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor_bytes(t)


def rss_peak_bytes() -> int:
    """Peak resident set size of this process in bytes (VmHWM on Linux, getrusage elsewhere)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cuda_peak_bytes() -> int:
    """`torch.cuda.max_memory_allocated()` where CUDA is initialised, else 0."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return 0


class _Held:
    """A tensor autograd saved, as the meter's pack hook hands it over: tells the meter when autograd lets go."""

    __slots__ = ("tensor", "key", "release")

    def __init__(self, tensor: torch.Tensor, key: tuple[str, int], release: Callable[[tuple[str, int]], None]):
        self.tensor, self.key, self.release = tensor, key, release

    def __del__(self) -> None:
        self.release(self.key)


def _unpack(saved: torch.Tensor | _Held) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Held) else saved


class MemoryMeter:
    """Peak bytes of parameters, gradients, optimizer state and saved activations of one model."""

    STEPS_PER_VISIT = 2

    def __init__(self, model: torch.nn.Module, steps_per_visit: int | None = STEPS_PER_VISIT):
        self.model, self.steps_per_visit = model, steps_per_visit
        self.reset()

    def reset(self) -> None:
        """Forget every peak (the process RSS peak cannot be reset; the CUDA peak is reset where present)."""
        self._grads = self._masters = self._optimizer = self._activations = self._tracked = self._params = 0
        self._step_activations = self._sampled = 0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def due(self) -> bool:
        """Whether the next step is one to track and sample: one of the first `steps_per_visit` since `reset()`."""
        return self.steps_per_visit is None or self._sampled < self.steps_per_visit

    def param_bytes(self) -> int:
        """Bytes of every parameter of the model as held on its device (`tensor_bytes`: a frozen weight's codes;
        tied parameters once; the meta-device prefix of a suffix-only model has no storage and is not counted;
        a streamed layer's weights are `frozen_device_bytes`, not these)."""
        return sum(tensor_bytes(p) for p in self.model.parameters() if not p.is_meta and not _streamed(p))

    def frozen_device_bytes(self) -> int:
        """The peak bytes of streamed frozen layers on the device (`--stream-frozen`: the stream that marked the
        model's weights, `preinfer.stream_frozen`), since its visit began; 0 without streaming."""
        streams = {id(s): s for s in map(_streamed, self.model.parameters()) if s is not None}
        return sum(stream.peak for stream in streams.values())

    def grad_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Bytes of every `.grad` present now in the model or on the tensors `optimizer` steps (each once)."""
        tensors = {id(p): p for p in [*self.model.parameters(), *_stepped(optimizer)]}
        return sum(tensor_bytes(p.grad) for p in tensors.values() if p.grad is not None)

    def master_bytes(self, optimizer: torch.optim.Optimizer | None) -> int:
        """Bytes of the tensors `optimizer` steps that are not parameters of the model (mixed precision's fp32
        masters)."""
        model = {id(p) for p in self.model.parameters()}
        return sum(tensor_bytes(t) for t in {id(t): t for t in _stepped(optimizer)}.values() if id(t) not in model)

    @staticmethod
    def optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
        """Bytes of every tensor in `optimizer.state` (moments, step counters kept as tensors)."""
        if optimizer is None:
            return 0
        return sum(
            tensor_bytes(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count the tensors held for backward during one step (forward + backward) and keep their peak."""
        param_keys = {_storage_key(p) for p in self.model.parameters()}
        held: dict[tuple[str, int], list[int]] = {}  # storage -> [saved tensors holding it, its bytes]
        current = 0
        self._step_activations = 0

        def release(key: tuple[str, int]) -> None:
            nonlocal current
            entry = held[key]
            entry[0] -= 1
            if entry[0] == 0:
                current -= entry[1]
                del held[key]

        def pack(t: torch.Tensor) -> torch.Tensor | _Held:
            nonlocal current
            key = _storage_key(t)
            if key is None or key in param_keys or t.numel() == 0 or _parameter(t):
                return t
            if key not in held:
                held[key] = [0, _storage_bytes(t)]
                current += held[key][1]
                self._step_activations = max(self._step_activations, current)
                self._activations = max(self._activations, current)
            held[key][0] += 1
            return _Held(t, key, release)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def sample(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Update the peaks of gradient and optimizer-state bytes and of the tracked total."""
        self._sampled += 1
        grads, masters, state = self.grad_bytes(optimizer), self.master_bytes(optimizer), self.optimizer_bytes(optimizer)
        self._grads = max(self._grads, grads)
        self._masters = max(self._masters, masters)
        self._optimizer = max(self._optimizer, state)
        params = self.param_bytes()
        self._params = max(self._params, params)
        total = params + self.frozen_device_bytes() + masters + grads + state + self._step_activations
        self._tracked = max(self._tracked, total)

    def report(self) -> dict[str, int]:
        """Peak bytes by component, the tracked total, the process RSS peak and the CUDA peak."""
        return {
            "params": self._params or self.param_bytes(),  # the largest sampled (a visit's block on the device)
            "frozen_device": self.frozen_device_bytes(),
            "masters": self._masters,
            "grads": self._grads,
            "optimizer": self._optimizer,
            "activations": self._activations,
            "tracked_peak": self._tracked,
            "rss_peak": rss_peak_bytes(),
            "cuda_peak": cuda_peak_bytes(),
        }


def _streamed(p: torch.Tensor):
    """The stream that holds `p` in host memory between its uses (`streamed_by`), or None."""
    return p.__dict__.get("streamed_by")


def _parameter(t: torch.Tensor) -> bool:
    """Whether `t` is a parameter (of the model or not), or a view of one."""
    return isinstance(t if t._base is None else t._base, torch.nn.Parameter)


def _stepped(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors `optimizer` updates (none without an optimizer)."""
    return [] if optimizer is None else [t for group in optimizer.param_groups for t in group["params"]]
