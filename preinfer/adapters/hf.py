"""The staged view of a Hugging Face causal LM that runs the model's own code around its decoder layers.

Nothing of the model-level forward is re-implemented. Each step calls the model's own `forward` with its decoder
layers replaced by stand-ins (`_Stand`) that record the arguments the forward passes to each layer:

- `embed`: the forward from the token ids up to layer 0; the hidden states layer 0 receives are the boundary-0
  state (embedding scale, position embeddings, dropout: whatever the model does before its layers).
- `run`: the forward on the state's hidden states, for the arguments of layers `[start, stop)` only (masks for
  each attention type, rotary tables for each layer type, position ids: as the model builds them); the real
  layers then run with those arguments.
- `logits`: the forward with the last stand-in returning the state's hidden states, so that the final norm, the
  LM head and any term after it (logit scale, soft-capping) are the model's own.

In the passes that do not compute the embedding, the embedding modules run on the meta device (no work, and
none of their tensors needed: a suffix or pipeline stage keeps them on meta) and give zeros; the random state is
restored afterwards, so a dropout the forward applies there draws nothing. Whether a family's forward splits
this way (each layer's output is the next layer's input and nothing else crosses the layers) is what
`preinfer.families` records per family, checked by tests/test_families.py against the model's own logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from preinfer.adapters.hf_head import linear_head, output_slot
from preinfer.boundary_state import BoundaryState
from preinfer.chunked_loss import LinearHead
from preinfer.errors import PreinferError, UnsupportedModelError
from preinfer.moe import use_row_invariant_experts
from preinfer.staged import LayerCall, StagedModel

ADAPTER_VERSION = 2
# Norms that transformers' forwards apply to the embedding before the layers (BART kin, TrOCR; BLOOM).
EMBEDDING_NORMS = frozenset({"layernorm_embedding", "word_embeddings_layernorm"})  # part of every prefix fingerprint: a change to what the adapter computes changes it


class _Stop(PreinferError):
    """Raised by the stand-in of the last layer a pass needs: the rest of the forward is not run (not a failure:
    the adapter catches it at once, and it never leaves this module)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("stop")
        self.hidden = hidden


class _Stand(nn.Module):
    """Stands in for decoder layer `index`: records the arguments the model's forward passes it, stops the forward
    at `stop`, and returns `output` (when set, from the last layer) or its input."""

    def __init__(self, layer: nn.Module, index: int, calls: dict, stop: int | None, output: torch.Tensor | None,
                 as_tuple: bool):
        super().__init__()
        self.__dict__["layer"] = layer  # not a submodule: its attributes only (a forward may read them)
        self.index, self.calls, self.stop, self.output, self.as_tuple = index, calls, stop, output, as_tuple

    def __getattr__(self, name: str):
        return getattr(self.__dict__["layer"], name)

    def forward(self, *args, **kwargs):
        hidden, args = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        if self.index in self.calls:
            raise UnsupportedModelError(f"the forward runs decoder layer {self.index} more than once")
        self.calls[self.index] = (args, kwargs)
        if self.index == self.stop:
            raise _Stop(hidden)
        out = hidden if self.output is None else self.output
        return (out,) if self.as_tuple else out


class _Capture(nn.Module):
    """Stands in for the output embeddings: stops the forward with their input (their attributes readable, as a
    forward may read their weight's dtype)."""

    def __init__(self, output: nn.Module):
        super().__init__()
        self.__dict__["output"] = output

    def __getattr__(self, name: str):
        return getattr(self.__dict__["output"], name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise _Stop(hidden)


class HFCausalLM(StagedModel):
    """A transformers causal LM of a family `preinfer.families` lists as exact: its decoder layers are the one
    `nn.ModuleList` of `num_hidden_layers` modules; the embedding modules are the input embeddings and the other
    embedding tables beside the layers, the head the LM head and the other parameterised modules beside the layers
    (final norms), the shared modules those holding buffers only (rotary tables)."""

    def __init__(self, model: nn.Module, family: str):
        owner, name = _layer_list(model)
        super().__init__(model, getattr(owner, name))
        self.family = family
        self.config = model.config
        self._owner, self._name = owner, name
        self._embed_slots, self._head_mods, self._shared_mods = _classify(model, owner, name)
        params = inspect.signature(model.forward).parameters
        self._extra = {k: False for k in ("use_cache", "output_router_logits") if k in params}
        self._as_tuple: bool | None = None
        use_row_invariant_experts(model)

    @property
    def identity(self) -> str:
        return f"hf/{self.family}/{ADAPTER_VERSION}"

    def embed_modules(self) -> tuple[nn.Module, ...]:
        return tuple(module for _, _, module in self._embed_slots)

    def head_modules(self) -> tuple[nn.Module, ...]:
        return self._head_mods

    def shared_modules(self) -> tuple[nn.Module, ...]:
        return self._shared_mods

    def rebuild_shared_modules(self) -> None:
        for module in self._shared_mods:
            fresh = type(module)(config=module.config)
            for name, buffer in fresh.named_buffers():
                _set_buffer(module, name, buffer)

    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        try:
            with self._standing_in({}, stop=0, as_tuple=False):
                self.model(input_ids=input_ids, attention_mask=attention_mask.long(), **self._extra)
        except _Stop as stop:
            return stop.hidden
        raise UnsupportedModelError(f"{self.family}: the forward never reached its first decoder layer")

    def _run(self, state: BoundaryState, start: int, stop: int, layer: LayerCall) -> torch.Tensor:
        calls: dict = {}
        as_tuple = self._tuple_layers(state.hidden)
        with torch.no_grad(), self._without_embedding(state.hidden), self._standing_in(calls, stop - 1, as_tuple):
            try:
                self._forward(state)
            except _Stop:
                pass
        hidden = state.hidden
        for index in range(start, stop):
            args, kwargs = calls[index]
            out = layer(self.layers[index], hidden, args, kwargs)
            hidden = out[0] if as_tuple and isinstance(out, tuple) else out
            if not isinstance(hidden, torch.Tensor):
                raise UnsupportedModelError(f"{self.family}: decoder layers return {type(out).__name__}, "
                                            "not hidden states")
        return hidden

    def _head(self, state: BoundaryState) -> torch.Tensor:
        as_tuple = self._tuple_layers(state.hidden)
        with self._without_embedding(state.hidden), self._standing_in({}, None, as_tuple, output=state.hidden):
            return self._forward(state).logits

    def linear_head(self) -> LinearHead | str:
        return linear_head(self.model, self.family)

    def head_features(self, state: BoundaryState) -> torch.Tensor:
        """The forward as in `_head`, stopped where it calls its output embeddings: their input."""
        as_tuple = self._tuple_layers(state.hidden)
        parent, name = output_slot(self.model)
        output = parent._modules[name]
        parent._modules[name] = _Capture(output)
        try:
            with self._without_embedding(state.hidden), self._standing_in({}, None, as_tuple, output=state.hidden):
                self._forward(state)
        except _Stop as stop:
            return stop.hidden
        finally:
            parent._modules[name] = output
        raise UnsupportedModelError(f"{self.family}: the forward never ran its output embeddings")

    def _forward(self, state: BoundaryState):
        """The model's forward on zeros shaped like the state's hidden states (a fresh tensor: some forwards scale
        their input in place), which only the stand-ins see."""
        dummy = torch.zeros_like(state.hidden, requires_grad=False)
        return self.model(inputs_embeds=dummy, attention_mask=state.attention_mask.long(), **self._extra)

    def _tuple_layers(self, like: torch.Tensor) -> bool:
        """Whether the forward takes each layer's hidden states as `output[0]` (layers that return tuples): found
        once, by the stand-in of layer 1 seeing what layer 0's stand-in returned as a 1-tuple."""
        if self._as_tuple is None:
            calls: dict = {}
            self._as_tuple = False
            if self.num_layers > 1:
                hidden = torch.zeros(1, 1, like.shape[-1], dtype=like.dtype, device=like.device)
                state = BoundaryState.right_padded(hidden, torch.ones(1, 1, device=like.device))
                with torch.no_grad(), self._without_embedding(hidden), self._standing_in(calls, 1, as_tuple=True):
                    try:
                        self._forward(state)
                    except _Stop as stop:
                        self._as_tuple = isinstance(stop.hidden, torch.Tensor)
                    except (TypeError, AttributeError, RuntimeError):
                        pass
        return self._as_tuple

    @contextmanager
    def _standing_in(self, calls: dict, stop: int | None, as_tuple: bool,
                     output: torch.Tensor | None = None) -> Iterator[None]:
        """The decoder layers replaced by stand-ins for the enclosed forward."""
        last = self.num_layers - 1
        stands = nn.ModuleList(_Stand(layer, i, calls, stop, output if i == last else None, as_tuple)
                               for i, layer in enumerate(self.layers))
        self._owner._modules[self._name] = stands
        try:
            yield
        finally:
            self._owner._modules[self._name] = self.layers

    @contextmanager
    def _without_embedding(self, like: torch.Tensor) -> Iterator[None]:
        """The embedding modules replaced by `_OnMeta` stand-ins for the enclosed forward; the random state as it
        was afterwards."""
        devices = [like.device] if like.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for parent, name, module in self._embed_slots:
                parent._modules[name] = _OnMeta(module, like.device)
            try:
                yield
            finally:
                for parent, name, module in self._embed_slots:
                    parent._modules[name] = module


class _OnMeta(nn.Module):
    """Stands in for an embedding module: runs it on the meta device (its tensors and inputs as meta tensors, so
    nothing is computed and none of its tensors need be resident) and gives zeros of its output's shape."""

    def __init__(self, module: nn.Module, device: torch.device):
        super().__init__()
        self.__dict__["real"], self.__dict__["device"] = module, device

    def __getattr__(self, name: str):
        return getattr(self.__dict__["real"], name)

    def forward(self, *args, **kwargs):
        real = self.__dict__["real"]
        tensors = {n: _meta(t) for n, t in [*real.named_parameters(), *real.named_buffers()]}
        output = torch.func.functional_call(real, tensors, tuple(map(_meta, args)),
                                            {k: _meta(v) for k, v in kwargs.items()})
        if not isinstance(output, torch.Tensor):
            raise UnsupportedModelError(f"{type(real).__name__} returns {type(output).__name__}, not a tensor")
        return torch.zeros(output.shape, dtype=output.dtype, device=self.__dict__["device"])


def _meta(value):
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


def _layer_list(model: nn.Module) -> tuple[nn.Module, str]:
    """(owner, attribute name) of the shallowest `nn.ModuleList` holding `num_hidden_layers` (or, for a decoder
    of an encoder-decoder family, `decoder_layers`) modules."""
    config = model.config.get_text_config()
    counts = {getattr(config, "num_hidden_layers", None), getattr(config, "decoder_layers", None)} - {None}
    found = sorted(
        (name.count("."), name) for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) in counts and name
    )
    if not found:
        raise UnsupportedModelError(f"{model.config.model_type}: no list of its decoder layers")
    path = found[0][1]
    owner_path, _, name = path.rpartition(".")
    return (model.get_submodule(owner_path) if owner_path else model), name


def _classify(model: nn.Module, owner: nn.Module, name: str):
    """(embedding slots as (parent, name, module), head, shared modules): the children of each module on the way
    from `model` down to `owner`, the layers' list and the path itself left out. A parameterised child is on the
    embedding side when it holds the input embeddings, is an embedding table or is one of `EMBEDDING_NORMS`; the
    others (final norms, the LM head) are the head. tests/test_families.py checks the split for every family."""
    inputs = model.get_input_embeddings()
    slots, head, shared = [], [], []
    path = _path(model, owner)
    on_path = {id(m) for m in path}
    for parent in path:
        for child_name, child in parent.named_children():
            if id(child) in on_path or (parent is owner and child_name == name):
                continue
            has_params = any(True for _ in child.parameters())
            embedding_side = isinstance(child, nn.Embedding) or child_name in EMBEDDING_NORMS
            if _holds(child, inputs) or (embedding_side and has_params):
                slots.append((parent, child_name, child))
            elif has_params:
                head.append(child)
            elif any(True for _ in child.buffers()):
                shared.append(child)
    if not any(_holds(module, inputs) for _, _, module in slots):
        raise UnsupportedModelError(f"{model.config.model_type}: its input embeddings are not beside its layers")
    output = model.get_output_embeddings()
    head = [m for m in head if m is not output] + ([output] if output is not None else [])
    return slots, tuple(head), tuple(shared)


def _holds(module: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in module.modules())


def _path(model: nn.Module, owner: nn.Module) -> list[nn.Module]:
    """The modules from `model` down to `owner`, both included."""
    for module_name, module in model.named_modules():
        if module is owner:
            parts = module_name.split(".") if module_name else []
            return [model] + [model.get_submodule(".".join(parts[:i + 1])) for i in range(len(parts))]
    return [model]


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_path, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner_path) if owner_path else module
    target._buffers[leaf] = value
