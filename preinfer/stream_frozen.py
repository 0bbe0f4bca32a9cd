"""Frozen decoder layers streamed from host memory (`--stream-frozen`): on the device only while they compute.

`LayerStream` holds which layers are streamed (every held layer but the active block's) and which of them are on
the device now. What a streamed layer keeps in host memory:

- with a frozen dtype (`preinfer.frozen_weights`): the codes of its frozen weights (their masters are host memory
  already); the layer's norms and biases stay resident;
- with frozen dtype auto: every parameter of the layer, in its resident dtype.

On CUDA the host copies are pinned (but a parameter memory-mapped with `--masters disk`, which is its own host
copy: `pin`); a layer loaded in host memory (`preinfer.device_placement`) starts evicted. `fetch` allocates the
layer's device storage and copies it on a side stream (the compute stream waits for that copy only where it uses
the layer: `use`), and `evict` frees it. A tensor keeps its identity across the two: a code tensor's storage is
resized to nothing and back, so autograd's references to it (the backward through a frozen weight) see the
refilled codes; a parameter points at its host copy while evicted (state dicts, checkpoints and exports read it
there, and a write there is the one a later `fetch` copies) and at its refilled device tensor while fetched
(autograd saved the parameter, which then reads the device again).
Everything runs where the device is the host too, the copies then no-ops (`copies=False`), so the CPU runs the
same bookkeeping: what is on the device, and its peak (`peak`: at most two layers in a step, the one computing
and the one being copied).

Outside the layer-major step (`preinfer.layer_major`, which places and frees the layers itself: `holding`), forward
hooks stream each layer as it runs: fetched (and the next prefetched) before its forward, evicted after it where
nothing keeps it for backward (evaluation, pre-inference). A module marked by the stream (`streamed_by` on its
weights) is counted by the memory meter as the stream's `peak`, not as resident parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.frozen_weights import FrozenWeight
from preinfer.partition import Block
from preinfer.staged import StagedModel


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind `t` (a tensor subclass's inner tensors, recursively)."""
    if hasattr(t, "__tensor_flatten__"):
        return [leaf for name in t.__tensor_flatten__()[0] for leaf in _leaves(getattr(t, name))]
    return [t]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class LayerStream:
    """Which of `layers` live in host memory between uses, and the copies that bring them to `device` and back
    (see the module's docstring). `copies`: move the bytes (default: where the device is not the host)."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device | str, codes: bool,
                 copies: bool | None = None, pin: bool = True):
        """`pin`: a parameter loaded in host memory gets a pinned copy there (else it is its own host copy: a
        memory-mapped master, which a pinned copy would read whole into memory)."""
        self.layers, self.device, self.codes, self.pin = list(layers), torch.device(device), codes, pin
        self.copies = self.device.type != "cpu" if copies is None else copies
        self.side = torch.cuda.Stream(self.device) if self.copies and self.device.type == "cuda" else None
        self.streamed: set[int] = set()
        self.resident: dict[int, list] = {}  # streamed layer on the device -> [its copy's event or None, bytes]
        self.placing = False  # the layer-major step fetches and evicts the layers itself
        self.bytes = self.peak = self.fetches = 0
        for index, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._before(index))
            layer.register_forward_hook(self._after(index))

    def stream(self, indices: Sequence[int]) -> None:
        """Stream layers `indices` and evict them; every other layer on the device, unmarked. The peak starts
        again."""
        for index in list(self.resident):
            self.evict(index)
        self.streamed = set(indices)
        for index in range(len(self.layers)):
            if index in self.streamed:
                self.evict(index)
                continue
            self._wait(self._fill(index))
            for weight in self._weights(index):
                weight.__dict__.pop("streamed_by", None)
        self.peak = self.bytes

    def use(self, index: int, then: int | None = None) -> None:
        """Layer `index` on the device for the compute stream's next work, and layer `then` copied meanwhile."""
        self.fetch(index)
        if index in self.resident:
            self._wait(self.resident[index][0])
            self.resident[index][0] = None
        if then is not None and 0 <= then < len(self.layers):
            self.fetch(then)

    def fetch(self, index: int) -> None:
        """Start copying streamed layer `index` to the device (nothing if it is there or not streamed)."""
        if index not in self.streamed or index in self.resident:
            return
        size = self.layer_bytes(index)
        self.resident[index] = [self._fill(index), size]
        self.bytes += size
        self.peak = max(self.peak, self.bytes)
        self.fetches += 1

    def evict(self, index: int) -> None:
        """Free layer `index` from the device (its host copies made first where it has none, and brought up to
        date where it was written on the device), and mark its weights as streamed; nothing if it is not streamed."""
        if index not in self.streamed:
            return
        for weight in self._weights(index):
            weight.__dict__["streamed_by"] = self
        if index in self.resident:
            self._wait(self.resident[index][0])  # a copy still in flight writes what is about to be freed
        if self.copies and self.codes:
            self._codes_to_host(self._tensors(index))
        elif self.copies:
            for param in self._tensors(index):
                self._param_to_host(param)
        if index in self.resident:
            self.bytes -= self.resident.pop(index)[1]

    def layer_bytes(self, index: int) -> int:
        """Bytes streamed layer `index` holds on the device when fetched."""
        return sum(_nbytes(t) for t in self._tensors(index))

    @contextmanager
    def holding(self) -> Iterator[None]:
        """The enclosed code fetches and evicts the layers itself (the forward hooks leave them be)."""
        self.placing = True
        try:
            yield
        finally:
            self.placing = False

    def _weights(self, index: int) -> list[torch.Tensor]:
        """The streamed tensors' owners: the layer's frozen weights (codes), or all its parameters (auto)."""
        layer = self.layers[index]
        if self.codes:
            return [m.weight for m in layer.modules() if isinstance(getattr(m, "weight", None), FrozenWeight)]
        return list(layer.parameters())

    def _tensors(self, index: int) -> list[torch.Tensor]:
        if self.codes:
            return [leaf for weight in self._weights(index) for code in weight.codes for leaf in _leaves(code)]
        return self._weights(index)

    def _codes_to_host(self, codes: list[torch.Tensor]) -> None:
        """Code tensors' storages freed, their bytes kept in host copies (codes are never written in place, so a
        copy once made stays right), all copied before any is freed (codes may share a storage)."""
        codes = [code for code in codes if not code.__dict__.get("stream_out")]
        for code in codes:
            if "stream_host" not in code.__dict__:
                code.__dict__["stream_host"] = self._host_like(code).copy_(code)
                code.__dict__["stream_nbytes"] = code.untyped_storage().nbytes()
        for code in codes:
            code.__dict__["stream_out"] = True
            code.untyped_storage().resize_(0)  # on the compute stream, which allocated it: reused in its order

    def _param_to_host(self, param: nn.Parameter) -> None:
        """`param` pointed at its host copy (up to date with what it held on the device, or the host tensor that
        replaced its device one: a trained block mapped from its new file), the device's freed."""
        state = param.__dict__.get("stream_state")
        if state is None:
            state = param.__dict__["stream_state"] = self._first_state(param)
        device, host, version = state
        current = param.data
        if current.data_ptr() == host.data_ptr():
            return
        if current.data_ptr() != device.data_ptr():  # replaced while fetched (masters on disk: the block's new file)
            state[1] = host = current
        elif version is not None and param._version != version:  # written on the device: the host copy follows
            host.copy_(current)
        param.data = host
        device.untyped_storage().resize_(0)

    def _first_state(self, param: nn.Parameter) -> list:
        """[device tensor, host copy, version written on the device] of a parameter first evicted: one on the
        device gets a host copy; one loaded in host memory (the placement left it there) gets a device tensor
        with no storage, and points at its host copy at once (itself, or a pinned copy with `pin`)."""
        if param.device.type == self.device.type:
            return [param.data, self._host_like(param).copy_(param.data), None]
        device = torch.empty(param.shape, dtype=param.dtype, device=self.device)
        device.untyped_storage().resize_(0)
        if self.pin:
            param.data = self._host_like(param).copy_(param.data)
        return [device, param.data, None]

    def _fill(self, index: int) -> torch.cuda.Event | None:
        """Allocate layer `index`'s streamed tensors on the device (on the compute stream) and copy them there (on
        the side stream, once the compute stream is done with the memory it may reuse); the copy's event."""
        if not self.copies:
            return None
        pending = []
        for tensor in self._tensors(index):
            if isinstance(tensor, nn.Parameter):
                state = tensor.__dict__.get("stream_state")
                if state is not None and tensor.data.data_ptr() == state[1].data_ptr():
                    state[0].untyped_storage().resize_(_nbytes(state[0]))
                    pending.append((state[0], state[1]))
                    tensor.data = state[0]
                    state[2] = tensor._version
            elif tensor.__dict__.get("stream_out"):
                if tensor.untyped_storage().nbytes() == 0:  # (codes sharing one storage: allocated once)
                    tensor.untyped_storage().resize_(tensor.__dict__["stream_nbytes"])
                tensor.__dict__["stream_out"] = False
                pending.append((tensor.data, tensor.__dict__["stream_host"]))
        if self.side is None:
            for device, host in pending:
                device.copy_(host)
            return None
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            for device, host in pending:
                device.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.device.type == "cuda")

    def _before(self, index: int):
        def hook(module, args):
            if not self.placing:
                self.use(index, index + 1)
        return hook

    def _after(self, index: int):
        def hook(module, args, output):
            if not self.placing and not torch.is_grad_enabled():
                self.evict(index)
        return hook


class StreamedFrozenLayers:
    """The visit hook of `--stream-frozen`: every held layer outside the active block is streamed (`LayerStream`);
    the block's layers stay on the device for its visit. After the frozen-dtype hook in a run's hooks, so that the
    codes it builds are the ones streamed."""

    def __init__(self, staged: StagedModel, config: Config):
        self.held = [i for i, layer in enumerate(staged.layers) if not any(p.is_meta for p in layer.parameters())]
        self.stream = LayerStream(staged.layers, config.run.device, config.model.frozen_dtype != "auto",
                                  pin=config.model.masters == "host")
        self.stream.stream(self.held)

    def activate(self, block: Block) -> list[nn.Parameter]:
        """The block's layers on the device, every other held layer streamed; no extra parameters."""
        self.stream.stream([i for i in self.held if not block.start <= i < block.stop])
        return []

    def after_step(self) -> None:
        """Nothing: the step freed what it fetched."""

    def deactivate(self, block: Block) -> None:
        """Every held layer streamed (the block's trained weights go to host memory)."""
        self.stream.stream(self.held)


def stream_frozen_hooks(staged: StagedModel, config: Config, seams) -> list[StreamedFrozenLayers]:
    """The run's visit hook for `[model] stream_frozen` (none without it); the step's seams run its steps
    layer-major."""
    if not config.model.stream_frozen:
        return []
    if seams.world_size > 1:
        raise UsageError("--stream-frozen runs in one process; drop it under torchrun")
    hook = StreamedFrozenLayers(staged, config)
    seams.stream = hook.stream
    return [hook]
