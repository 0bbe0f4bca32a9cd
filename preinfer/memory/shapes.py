"""The sizes of a decoder-only LM that the memory model needs (`ModelShape`), from a size name, a preset, a model
directory or a Hugging Face config."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path

from preinfer.errors import UsageError


# Standard shapes for model sizes. Llama-shaped: Llama-2 7B and 13B; 1.5B and 20B scaled with the same ratios.
# GPT-2-shaped: GPT-2 XL for 1.5B; 4h MLP, 50257 tokens, 1024 positions, tied embedding for the rest.
SIZES = {
    "llama": {
        "1.5b": dict(hidden=2048, layers=28, heads=16, intermediate=5504),
        "7b": dict(hidden=4096, layers=32, heads=32, intermediate=11008),
        "13b": dict(hidden=5120, layers=40, heads=40, intermediate=13824),
        "20b": dict(hidden=6144, layers=44, heads=48, intermediate=16384),
        "llama3-8b": dict(hidden=4096, layers=32, heads=32, intermediate=14336, vocab=128256, kv_heads=8),
    },
    "gpt2": {
        "1.5b": dict(hidden=1600, layers=48, heads=25),
        "7b": dict(hidden=4096, layers=32, heads=32),
        "13b": dict(hidden=5120, layers=40, heads=40),
        "20b": dict(hidden=6144, layers=44, heads=48),
    },
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only LM that the memory model needs."""

    name: str
    arch: str  # "llama" or "gpt2"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    positions: int = 0  # learned position embeddings (GPT-2); 0 for rotary models
    tied: bool = False  # LM head shares the token embedding
    bias: bool = False  # linear layers have biases (GPT-2)
    dropout: float = 0.0  # GPT-2's dropout (embedding, attention, residual); Llama has none
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): which layers are sparse, and their experts.
    sparse: tuple[bool, ...] = ()  # per layer; () for a dense model
    experts: int = 0  # routed experts of a sparse layer, each a SwiGLU MLP of width expert_intermediate
    experts_per_token: int = 0  # top-k
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # a shared expert's width (Qwen2-MoE, with its 1-output gate); 0: none
    # Parameter counts measured on the framework's own model (built on the meta device), for families whose
    # layers the formulas below do not describe: per layer, and the embedding and head sides; () / 0: the formulas.
    counted_layers: tuple[int, ...] = ()
    counted_expert: int = 0  # parameters of one routed expert (its slice of every fused expert tensor)
    counted_embed: int = 0
    counted_head: int = 0

    def is_sparse(self, layer: int | None) -> bool:
        return layer is not None and bool(self.sparse) and self.sparse[layer]

    def layer_params(self, layer: int | None = None) -> int:
        """Parameters of decoder layer `layer` (None: a dense layer); a sparse layer counts every expert."""
        return self._layer_params(layer, self.experts)

    def active_layer_params(self, layer: int | None = None) -> int:
        """Parameters one token runs through in layer `layer`: a sparse layer's top-k experts, not all."""
        return self._layer_params(layer, self.experts_per_token)

    def _layer_params(self, layer: int | None, experts: int) -> int:
        if self.counted_layers:
            counted = self.counted_layers[layer or 0]
            return counted - (self.experts - experts) * self.counted_expert if self.is_sparse(layer) else counted
        h, a, kv, d, i = self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate
        if self.arch == "gpt2":  # c_attn (3h) + c_proj + c_fc + c_proj, biases, two LayerNorms (weight + bias)
            return h * 3 * h + 3 * h + h * h + h + 2 * h * i + i + h + 4 * h
        attn = h * a * d + 2 * h * kv * d + a * d * h + (a * d + 2 * kv * d if self.bias else 0)
        if not self.is_sparse(layer):
            return attn + 3 * h * i + 2 * h  # SwiGLU gate/up/down, two RMSNorm weights
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return attn + experts * 3 * h * self.expert_intermediate + self.experts * h + shared + 2 * h  # router E*h

    def span_params(self, start: int, stop: int, active: bool = False) -> int:
        """Parameters of layers [start, stop) (`active`: those one token runs through)."""
        count = self.active_layer_params if active else self.layer_params
        return sum(count(layer) for layer in range(start, stop))

    def mlp_width(self, layer: int) -> int:
        """Hidden units one token activates in the MLP of `layer` (top-k experts and a shared expert if sparse)."""
        if not self.is_sparse(layer):
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_intermediate

    def embed_params(self) -> int:
        """Parameters of the input side (token and position embeddings)."""
        if self.counted_layers:
            return self.counted_embed
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_params(self) -> int:
        """Parameters of the output side: final norm and (untied) LM head."""
        if self.counted_layers:
            return self.counted_head
        norm = 2 * self.hidden if self.arch == "gpt2" else self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def total_params(self) -> int:
        """All parameters (a tied weight once)."""
        return self.embed_params() + self.span_params(0, self.layers) + self.head_params()


def shape_from_config(config, name: str = "") -> ModelShape:
    """A ModelShape from a Hugging Face config: GPT-2 by formula; any other family `stage` accepts Llama-shaped for
    the activations, with its parameters counted on its own model built on the meta device."""
    if config.model_type == "gpt2":
        return ModelShape(
            name=name or "gpt2", arch="gpt2", vocab=config.vocab_size, hidden=config.n_embd, layers=config.n_layer,
            heads=config.n_head, kv_heads=config.n_head, head_dim=config.n_embd // config.n_head,
            intermediate=config.n_inner or 4 * config.n_embd, positions=config.n_positions,
            tied=bool(config.tie_word_embeddings), bias=True,
            dropout=max(config.attn_pdrop, config.resid_pdrop, config.embd_pdrop),
        )
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if not all(_declared(config, key) for key in needed):
        raise UsageError(f"'{name or config.model_type}': model type '{config.model_type}' has no hidden_size, num_hidden_layers, "
                         "num_attention_heads or vocab_size of its own: the planner prices attention layers only")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    intermediate = next((v for k in ("intermediate_size", "ffn_hidden_size", "n_inner")
                         if isinstance(v := getattr(config, k, None), int)), 4 * config.hidden_size)
    shape = ModelShape(
        name=name or config.model_type, arch="llama", vocab=config.vocab_size, hidden=config.hidden_size,
        layers=config.num_hidden_layers, heads=heads, kv_heads=1 if getattr(config, "multi_query", False) else kv_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=intermediate, tied=bool(getattr(config, "tie_word_embeddings", False)),
        bias=bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)),
        **_experts_from_config(config),
    )
    from preinfer.memory.counted import counted_parameters

    return replace(shape, **counted_parameters(config))


def _declared(config, key: str) -> bool:
    """Whether `config`'s family has the field `key` (its class declares it, or maps it to one of its own): a key
    written into another family's config.json (attention heads in a Mamba config) is no field of it."""
    cls = type(config)
    if not dataclasses.is_dataclass(cls):
        return hasattr(config, key)
    return key in {item.name for item in dataclasses.fields(cls)} or key in getattr(cls, "attribute_map", {})


def _experts_from_config(config) -> dict:
    """The ModelShape fields of a mixture-of-experts config (`num_experts` or Mixtral's `num_local_experts`;
    `decoder_sparse_step` and `mlp_only_layers` choose the sparse layers); {} for a dense one."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return {}
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return dict(
        sparse=tuple(i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers)),
        experts=experts, experts_per_token=config.num_experts_per_tok,
        expert_intermediate=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        shared_intermediate=getattr(config, "shared_expert_intermediate_size", None) or 0,
    )


def shape_for_size(size: str, arch: str = "llama") -> ModelShape:
    """The standard shape of a named size (`1.5b`, `7b`, `13b`, `20b`), Llama- or GPT-2-shaped."""
    if arch not in SIZES:
        raise UsageError(f"unknown --arch '{arch}'; use llama or gpt2")
    if size.lower() not in SIZES[arch]:
        raise UsageError(f"size '{size}' has no --arch {arch} shape; use one of {', '.join(SIZES[arch])}")
    dims = SIZES[arch][size.lower()]
    h, heads = dims["hidden"], dims["heads"]
    if arch == "gpt2":  # GPT-2 dropout 0.1 everywhere, as in the released configs
        return ModelShape(f"{size}-gpt2", "gpt2", 50257, h, dims["layers"], heads, heads, h // heads, 4 * h,
                          positions=1024, tied=True, bias=True, dropout=0.1)
    return ModelShape(f"{size}-llama", "llama", dims.get("vocab", 32000), h, dims["layers"], heads,
                      dims.get("kv_heads", heads), h // heads, dims["intermediate"])


def resolve_shape(spec: str, arch: str = "llama") -> ModelShape:
    """A shape from a size name, a preset, a model directory or a config.json file. Only a preset or a model's
    config loads torch and transformers."""
    if spec.lower() in SIZES["llama"]:
        return shape_for_size(spec, arch)
    from preinfer.model_config import check_stageable, config_refusals, local_config
    from preinfer.presets import PRESETS

    path = Path(spec)
    if path.is_file():
        from transformers import AutoConfig

        with config_refusals(f"cannot read a model config from '{spec}'"):
            config = AutoConfig.for_model(**json.loads(path.read_text()))
        check_stageable(config, spec)
        return shape_from_config(config, path.stem)
    if spec not in PRESETS and not path.is_dir():
        sizes = ", ".join(SIZES["llama"])
        raise UsageError(f"--model '{spec}' is not a size ({sizes}), a preset ({', '.join(PRESETS)}), "
                         "a model directory or a config.json")
    config = local_config(spec)
    if spec not in PRESETS:
        check_stageable(config, spec)
    return shape_from_config(config, path.name if path.is_dir() else spec)
