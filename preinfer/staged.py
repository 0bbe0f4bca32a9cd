"""Staged models: any supported causal LM seen as `embed -> layers -> head`, resumable at every layer boundary.

`stage(model)` picks an adapter by structure. Boundary k is the point just before layer k; boundary 0 is the
embedding output. Rotary tables and causal masks are recomputed inside `run` from the state's side tensors.
With `recompute`, each layer run with autograd keeps only its input for backward and runs again there
(activation checkpointing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from preinfer.errors import BoundaryStateError, UnsupportedModelError
from preinfer.moe import expert_tensors, use_row_invariant_experts
from preinfer.boundary_state import BoundaryState

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Unit:
    """A named group of modules that a partition assigns whole to one block: `embed`, `layer.i` or `head`."""

    name: str
    modules: tuple[nn.Module, ...]

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]


class StagedModel(ABC):
    """A view of a causal LM as embedding, a list of layers and a head, with boundary states in between."""

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
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # one row, as the framework's
        return BoundaryState.right_padded(self._embed(input_ids, positions), attention_mask, labels)

    def run(self, state: BoundaryState, start: int, stop: int, recompute: bool = False) -> BoundaryState:
        """Run layers `[start, stop)` on a state at boundary `start`; returns the state at boundary `stop`.

        `recompute`: under autograd, each layer saves only its input and is run again during backward."""
        if not 0 <= start <= stop <= self.num_layers:
            raise BoundaryStateError(f"layer range [{start}, {stop}) is outside [0, {self.num_layers}]")
        if start == stop:
            return state
        layer = _recomputed if recompute and torch.is_grad_enabled() else _direct
        hidden = self._run(state, start, stop, layer)
        return BoundaryState(hidden, state.attention_mask, state.position_ids, state.labels)

    def logits(self, state: BoundaryState) -> torch.Tensor:
        """Next-token logits `[B, T, V]` of a state at boundary `num_layers`."""
        return self._head(state.hidden)

    def loss(self, state: BoundaryState) -> torch.Tensor:
        """Mean next-token cross entropy over the supervised (label != -100) positions of a final state."""
        if state.labels is None:
            raise BoundaryStateError("this boundary state carries no labels; pass labels to embed()")
        return causal_lm_loss(self.logits(state), state.labels)

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
    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _run(self, state: BoundaryState, start: int, stop: int, layer: LayerCall) -> torch.Tensor:
        """Layers `[start, stop)`, each applied as `layer(module, hidden, **kwargs)`."""

    @abstractmethod
    def _head(self, hidden: torch.Tensor) -> torch.Tensor: ...


LayerCall = Callable[..., torch.Tensor]


def _direct(module: nn.Module, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
    return module(hidden, **kwargs)


def _recomputed(module: nn.Module, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
    """`module(hidden, **kwargs)` keeping only `hidden` for backward, where the layer runs again (with the same
    random state, so dropout masks repeat). A layer whose input carries no graph (the first of an active block
    above the embedding) gets one, so that its parameters' gradients flow through the recomputation."""
    if not hidden.requires_grad:
        hidden = hidden.detach().requires_grad_()
    return checkpoint(partial(module, **kwargs), hidden, use_reentrant=True)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of position t's logits against label t+1 over the labels that are not -100."""
    shifted = logits[:, :-1].flatten(0, 1).float()
    targets = labels[:, 1:].flatten()
    return F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def supervised_tokens(labels: torch.Tensor) -> int:
    """How many positions `causal_lm_loss` averages over."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _causal_mask(config, hidden: torch.Tensor, state: BoundaryState, sliding: bool):
    """The framework's own mask (causal, padding, and sliding window where the layer uses one) in the form the
    config's attention implementation takes: eager an additive float [B, 1, T, T] mask; sdpa a boolean one, or
    None when no position is padded (the kernel's own causal flag then, as in the framework's forward)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make(
        config=config,
        inputs_embeds=hidden,
        attention_mask=state.attention_mask,
        cache=None,
        position_ids=state.position_ids,
    )


class LlamaFamily(StagedModel):
    """Causal LMs shaped like Llama: `model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`,
    `lm_head` (Llama, Mistral, Qwen2, Qwen3 and kin; grouped-query attention included), and their
    mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), whose experts run batch-invariantly
    (`preinfer.moe.ROW_INVARIANT`)."""

    def __init__(self, model: nn.Module):
        super().__init__(model, model.model.layers)
        self.config = model.config
        use_row_invariant_experts(model)
        self.layer_kinds = [self._layer_kind(i) for i in range(self.num_layers)]

    def _layer_kind(self, index: int) -> str:
        kinds = getattr(self.config, "layer_types", None)
        if kinds is not None:
            return kinds[index]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def embed_modules(self) -> tuple[nn.Module, ...]:
        return (self.model.model.embed_tokens,)

    def head_modules(self) -> tuple[nn.Module, ...]:
        return (self.model.model.norm, self.model.lm_head)

    def shared_modules(self) -> tuple[nn.Module, ...]:
        return (self.model.model.rotary_emb,)

    def rebuild_shared_modules(self) -> None:
        rotary = self.model.model.rotary_emb
        self.model.model.rotary_emb = type(rotary)(config=self.config)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def _run(self, state: BoundaryState, start: int, stop: int, layer: LayerCall) -> torch.Tensor:
        hidden = state.hidden
        masks = {
            kind: _causal_mask(self.config, hidden, state, sliding=kind == "sliding_attention")
            for kind in set(self.layer_kinds[start:stop])
        }
        rotary = self.model.model.rotary_emb(hidden, position_ids=state.shared_positions())
        for index in range(start, stop):
            hidden = layer(
                self.layers[index],
                hidden,
                attention_mask=masks[self.layer_kinds[index]],
                position_ids=state.position_ids,
                position_embeddings=rotary,
            )
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))


class GPT2(StagedModel):
    """Hugging Face `GPT2LMHeadModel`: `transformer.wte`, `transformer.wpe`, `transformer.h`, `transformer.ln_f`,
    `lm_head` (tied to `wte` by default)."""

    def __init__(self, model: nn.Module):
        super().__init__(model, model.transformer.h)
        self.config = model.config

    def embed_modules(self) -> tuple[nn.Module, ...]:
        return (self.model.transformer.wte, self.model.transformer.wpe)

    def head_modules(self) -> tuple[nn.Module, ...]:
        return (self.model.transformer.ln_f, self.model.lm_head)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        transformer = self.model.transformer
        return transformer.drop(transformer.wte(input_ids) + transformer.wpe(position_ids))

    def _run(self, state: BoundaryState, start: int, stop: int, layer: LayerCall) -> torch.Tensor:
        hidden = state.hidden
        mask = _causal_mask(self.config, hidden, state, sliding=False)
        for index in range(start, stop):
            hidden = layer(self.layers[index], hidden, attention_mask=mask, position_ids=state.position_ids)
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.transformer.ln_f(hidden))


class SequentialLM(StagedModel):
    """A plain `nn.Sequential(embedding, layer, ..., layer, head)`: each layer maps `[B, T, H] -> [B, T, H]`
    on its own (any causality is the layers' business), the head maps hidden states to logits."""

    def __init__(self, model: nn.Sequential):
        super().__init__(model, list(model)[1:-1])

    def embed_modules(self) -> tuple[nn.Module, ...]:
        return (self.model[0],)

    def head_modules(self) -> tuple[nn.Module, ...]:
        return (self.model[-1],)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model[0](input_ids)

    def _run(self, state: BoundaryState, start: int, stop: int, layer: LayerCall) -> torch.Tensor:
        hidden = state.hidden
        for module in self.layers[start:stop]:
            hidden = layer(module, hidden)
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model[-1](hidden)


def _has(obj: object, *paths: str) -> bool:
    """Whether every dotted attribute path exists on `obj`."""
    for path in paths:
        target = obj
        for name in path.split("."):
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
    return True


EXPECTED_STRUCTURES = (
    "a Llama-family causal LM (model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head), "
    "a GPT-2 LM (transformer.wte, transformer.wpe, transformer.h, transformer.ln_f, lm_head), "
    "or nn.Sequential(nn.Embedding, layers..., head)"
)


def stage(model: nn.Module) -> StagedModel:
    """The staged view of `model`, chosen by structure; raises UnsupportedModelError for anything else."""
    if _has(model, "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"):
        return LlamaFamily(model)
    if _has(model, "transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"):
        return GPT2(model)
    if isinstance(model, nn.Sequential) and len(model) >= 3 and isinstance(model[0], nn.Embedding):
        return SequentialLM(model)
    raise UnsupportedModelError(f"cannot stage a {type(model).__name__}: expected {EXPECTED_STRUCTURES}")
