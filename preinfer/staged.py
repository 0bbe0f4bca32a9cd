"""Staged models: any supported causal LM seen as `embed -> layers -> head`, resumable at every layer boundary.

`preinfer.stage(model)` (in `preinfer.families`) picks the adapter. Boundary k is the point just before layer k; boundary 0 is the
embedding output. Rotary tables and causal masks are recomputed inside `run` from the state's side tensors.
With `recompute`, each layer run with autograd keeps only its input for backward and runs again there
(activation checkpointing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

from preinfer.chunked_loss import IGNORE_INDEX, LinearHead, chunked_loss_sum, liger_loss_sum, shifted_rows
from preinfer.config.choices import DEFAULT_LOSS_CHUNK
from preinfer.errors import BoundaryStateError, UnsupportedModelError
from preinfer.moe import expert_tensors
from preinfer.boundary_state import BoundaryState


@dataclass(frozen=True)
class Unit:
    """A named group of modules that a partition assigns whole to one block: `embed`, `layer.i` or `head`."""

    name: str
    modules: tuple[nn.Module, ...]

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]


class StagedModel(ABC):
    """A view of a causal LM as embedding, a list of layers and a head, with boundary states in between.

    `loss_sum` computes the loss as `use_loss` chose (`loss_kind`): `plain` from the whole logits, `chunked` in chunks of
    `loss_chunk` tokens (`preinfer.chunked_loss`), `liger` by Liger Kernel's fused linear cross entropy."""

    loss_kind = "plain"
    loss_chunk = DEFAULT_LOSS_CHUNK
    offload = False  # with recompute: each layer's kept input in host memory until backward (save_on_cpu)

    def __init__(self, model: nn.Module, layers: nn.ModuleList | list[nn.Module]):
        self.model = model
        self.layers = layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed_modules()[0].weight.shape[1]

    @property
    def attention(self) -> str:
        """The attention implementation the layers run (transformers' name: sdpa, eager), which the masks follow;
        "" for a model without a Hugging Face config."""
        return getattr(getattr(self.model, "config", None), "_attn_implementation", None) or ""

    @property
    def identity(self) -> str:
        """The adapter and family this view computes with, part of every prefix fingerprint."""
        return f"{type(self).__name__}/1"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype hidden states are computed in (the embedding's): what `auto` stores keep and what states
        read from a store are cast to."""
        modules = (*self.embed_modules(), *self.head_modules())
        return next(p for m in modules for p in m.parameters()).dtype

    def embed(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> BoundaryState:
        """The boundary-0 state of a right-padded batch (`attention_mask` None means no padding)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        return BoundaryState.right_padded(self._embed(input_ids, attention_mask), attention_mask, labels)

    def run(self, state: BoundaryState, start: int, stop: int, recompute: bool = False) -> BoundaryState:
        """Run layers `[start, stop)` on a state at boundary `start`; returns the state at boundary `stop`.

        `recompute`: under autograd, each layer saves only its input and is run again during backward (with
        `offload`, that input waits in host memory, pinned on CUDA)."""
        if not 0 <= start <= stop <= self.num_layers:
            raise BoundaryStateError(f"layer range [{start}, {stop}) is outside [0, {self.num_layers}]")
        if start == stop:
            return state
        recompute = recompute and torch.is_grad_enabled()
        layer = _recomputed if recompute else _direct
        kept = save_on_cpu(pin_memory=state.hidden.is_cuda) if recompute and self.offload else nullcontext()
        with kept:
            hidden = self._run(state, start, stop, layer)
        return BoundaryState(hidden, state.attention_mask, state.position_ids, state.labels)

    def layer_calls(self, state: BoundaryState, start: int, stop: int) -> list[LayerArgs]:
        """Each of layers `[start, stop)` with the arguments `run` passes it beside the hidden states (masks, rotary
        tables: `_run`'s own), for `run_layer` to apply one layer at a time."""
        calls: list[LayerArgs] = []

        def record(module: nn.Module, hidden: torch.Tensor, args: tuple = (), kwargs: dict | None = None):
            calls.append((module, args, kwargs or {}))
            return hidden

        self._run(state, start, stop, record)
        return calls

    @staticmethod
    def run_layer(call: LayerArgs, hidden: torch.Tensor, recompute: bool = False) -> torch.Tensor:
        """One layer of `layer_calls` on `hidden`, as `run` applies it (`recompute`: under autograd, keeping only
        its input)."""
        module, args, kwargs = call
        out = (_recomputed if recompute and torch.is_grad_enabled() else _direct)(module, hidden, args, kwargs)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, state: BoundaryState) -> torch.Tensor:
        """Next-token logits `[B, T, V]` of a state at boundary `num_layers`."""
        return self._head(state)

    def loss(self, state: BoundaryState) -> torch.Tensor:
        """Mean next-token cross entropy over the supervised (label != -100) positions of a final state."""
        return self.loss_sum(state) / max(supervised_tokens(state.labels), 1)

    def loss_sum(self, state: BoundaryState) -> torch.Tensor:
        """Summed next-token cross entropy over the supervised positions of a final state, as `use_loss` chose."""
        if state.labels is None:
            raise BoundaryStateError("this boundary state carries no labels; pass labels to embed()")
        return self.output_loss_sum(self.head_output(state), state.labels)

    def head_output(self, state: BoundaryState) -> torch.Tensor:
        """What the loss chosen by `use_loss` takes from a state at boundary `num_layers`: the logits `[B, T, V]`
        (plain), else the head's features `[B, T, H]` (a pipeline's last stage sends this to its loss)."""
        return self.logits(state) if self.loss_kind == "plain" else self.head_features(state)

    def output_loss_sum(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross entropy of `head_output`'s `output` against `labels`, as `use_loss` chose."""
        if self.loss_kind == "plain":
            return causal_lm_loss(output, labels, reduction="sum")
        features, targets = shifted_rows(output, labels)
        head = self.linear_head()
        if self.loss_kind == "liger" and torch.is_grad_enabled():  # its kernel takes the gradients in forward
            return liger_loss_sum(features, head, targets)
        return chunked_loss_sum(features, head, targets, self.loss_chunk)

    def use_loss(self, choice: str, chunk: int = DEFAULT_LOSS_CHUNK) -> str:
        """Compute the loss as `choice` says (auto: chunked where the head is a `LinearHead`, else plain; chunked,
        liger: refused with UnsupportedModelError where it is not); returns the loss chosen."""
        head = self.linear_head()
        if choice in ("chunked", "liger") and not isinstance(head, LinearHead):
            raise UnsupportedModelError(f"--loss {choice}: {self.identity} computes its loss from the whole logits "
                                        f"only: {head}; use --loss plain or auto")
        self.loss_kind = "plain" if choice == "plain" or not isinstance(head, LinearHead) else \
            "chunked" if choice == "auto" else choice
        self.loss_chunk = chunk
        return self.loss_kind

    def linear_head(self) -> LinearHead | str:
        """The head after its final norm as one linear map and its terms, or why it is not one."""
        return "its head is not one nn.Linear"

    def head_features(self, state: BoundaryState) -> torch.Tensor:
        """What the head's linear map receives (`[B, T, H]`, after the final norm) from a state at boundary
        `num_layers`: where `linear_head` is a `LinearHead`, its logits of these are the model's own."""
        raise UnsupportedModelError(f"{self.identity}: {self.linear_head()}")

    def units(self) -> list[Unit]:
        """The model's parts in input-to-output order: `embed`, `layer.0` ... `layer.{L-1}`, `head`."""
        layer_units = [Unit(f"layer.{i}", (layer,)) for i, layer in enumerate(self.layers)]
        return [Unit("embed", self.embed_modules()), *layer_units, Unit("head", self.head_modules())]

    def prefix_modules(self, boundary: int) -> list[nn.Module]:
        """Every module whose parameters or buffers the state at `boundary` depends on."""
        return [*self.embed_modules(), *self.layers[:boundary], *self.shared_modules()]

    def suffix_modules(self, boundary: int) -> list[nn.Module]:
        """Every module needed to go from the state at `boundary` to the loss (a tied embedding included)."""
        return [*self.layers[boundary:], *self.head_modules(), *self.shared_modules()]

    def stage_modules(self, start: int, stop: int, embed: bool, head: bool) -> list[nn.Module]:
        """Every module a pipeline stage of layers `[start, stop)` (with the embedding, the head) needs."""
        return [*(self.embed_modules() if embed else ()), *self.layers[start:stop],
                *(self.head_modules() if head else ()), *self.shared_modules()]

    def expert_shares(self) -> dict[int, float]:
        """id of each fused expert tensor -> the share of it one token runs through (empty for dense models)."""
        return expert_tensors(self.layers)

    def shared_modules(self) -> tuple[nn.Module, ...]:
        """Modules every layer uses (e.g. the rotary embedding), owned by no block."""
        return ()

    def rebuild_shared_modules(self) -> None:
        """Recompute shared modules from the config (after building on the meta device); their tensors are
        derived, not stored."""

    @abstractmethod
    def embed_modules(self) -> tuple[nn.Module, ...]: ...

    @abstractmethod
    def head_modules(self) -> tuple[nn.Module, ...]: ...

    @abstractmethod
    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The hidden states layer 0 receives (positions 0..T-1 in every row)."""

    @abstractmethod
    def _run(self, state: BoundaryState, start: int, stop: int, layer: LayerCall) -> torch.Tensor:
        """Layers `[start, stop)`, each applied as `layer(module, hidden, args, kwargs)`."""

    @abstractmethod
    def _head(self, state: BoundaryState) -> torch.Tensor: ...


LayerCall = Callable[..., torch.Tensor]
LayerArgs = tuple[nn.Module, tuple, dict]  # a decoder layer and the arguments it takes beside the hidden states


def _direct(module: nn.Module, hidden: torch.Tensor, args: tuple = (), kwargs: dict | None = None) -> torch.Tensor:
    return module(hidden, *args, **(kwargs or {}))


def _recomputed(module: nn.Module, hidden: torch.Tensor, args: tuple = (), kwargs: dict | None = None) -> torch.Tensor:
    """`module(hidden, *args, **kwargs)` keeping only `hidden` for backward, where the layer runs again (with the same
    random state, so dropout masks repeat). A layer whose input carries no graph (the first of an active block
    above the embedding) gets one, so that its parameters' gradients flow through the recomputation."""
    if not hidden.requires_grad:
        hidden = hidden.detach().requires_grad_()
    return checkpoint(partial(_direct, module, args=args, kwargs=kwargs), hidden, use_reentrant=True)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of position t's logits against label t+1 over the labels that are not -100."""
    shifted = logits[:, :-1].flatten(0, 1).float()
    targets = labels[:, 1:].flatten()
    return F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def supervised_tokens(labels: torch.Tensor) -> int:
    """How many positions `causal_lm_loss` averages over."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


class SequentialLM(StagedModel):
    """A plain `nn.Sequential(embedding, layer, ..., layer, head)`: each layer maps `[B, T, H] -> [B, T, H]`
    on its own (any causality is the layers' business), the head maps hidden states to logits."""

    def __init__(self, model: nn.Sequential):
        super().__init__(model, list(model)[1:-1])

    def embed_modules(self) -> tuple[nn.Module, ...]:
        return (self.model[0],)

    def head_modules(self) -> tuple[nn.Module, ...]:
        return (self.model[-1],)

    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model[0](input_ids)

    def _run(self, state: BoundaryState, start: int, stop: int, layer: LayerCall) -> torch.Tensor:
        hidden = state.hidden
        for module in self.layers[start:stop]:
            hidden = layer(module, hidden)
        return hidden

    def _head(self, state: BoundaryState) -> torch.Tensor:
        return self.model[-1](state.hidden)

    def linear_head(self) -> LinearHead | str:
        head = self.model[-1]
        return LinearHead(head.weight, head.bias) if type(head) is nn.Linear else super().linear_head()

    def head_features(self, state: BoundaryState) -> torch.Tensor:
        return state.hidden
