"""Analytic memory and cost model of full-parameter Adam and BCD-Adam (live and from a pre-inference store).

Every formula lives here, with its assumption beside it. Byte counts are per GPU and per micro-batch step.

Activations count what PyTorch's eager autograd saves for backward in the Hugging Face Llama and GPT-2 layers
(eager attention), tensor by tensor, as `preinfer.meter.MemoryMeter` measures it. A tensor saved by a linear layer
for its weight gradient exists only when that layer trains; a tensor saved for the input gradient exists only
when its input requires grad. Notation: b micro-batch, s sequence length, h hidden size, a heads, d head dim,
i MLP width, V vocabulary, c bytes of one activation element (4 in float32, 2 in bf16).

Llama layer (RMSNorm, rotary attention, SwiGLU MLP), float32, trainable layer whose input requires grad:
    norm 1: input x (pow), rsqrt (b*s), normalised x, output (q/k/v input)   3*bsh + bs
    attention: q, repeated k, repeated v (b*s*a*d each), softmax output      3*bsad + b*a*s^2
    o_proj input                                                              bsad
    norm 2: residual sum, rsqrt, normalised, output (gate/up input)          3*bsh + bs
    MLP: gate output (SiLU input), SiLU output, up output, down input        4*bsi
  = 6*bsh + 4*bsad + 4*bsi + b*a*s^2 + 2*bs elements, i.e. 10*bsh + 4*bsi + b*a*s^2 (+2 bs) when a*d = h.
  A frozen layer in the gradient path (above the active block) keeps x, rsqrt, q, k, v, probabilities, the
  residual sum, rsqrt, gate, SiLU and up outputs: 5*bsh + 3*bsi + b*a*s^2 + 2*bs. The first trainable layer
  above a frozen prefix (or a store) drops x and its rsqrt: 9*bsh + 4*bsi + b*a*s^2 + bs.
GPT-2 layers are counted the same way (LayerNorm keeps input, mean, rstd; q, k, v are copied contiguous for
the batched matmuls; tanh-GELU keeps four 4h tensors); dropout masks are counted at 1 byte (CUDA's fused
dropout), while PyTorch's CPU path keeps c-byte float masks. Without dropout this matches the meter exactly.
Compare with Korthikanti et al. (2022), s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit with dropout: their
GPT layer has a 4h GELU MLP and 1-byte dropout masks; a Llama layer has no dropout and a SwiGLU MLP of width
i ~ 2.7h. For Llama-2 7B at s=1024, b=1 in float32 this module gives 15.6 GB of activations = 0.58 W, so full
Adam is 4.58 W (4.04 W with recomputation); Korthikanti's count doubled for float32 gives 0.74 W (4.74 W), the
reference paper's figure is 4.7 W (4 W with recomputation).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from preinfer.errors import UsageError
from preinfer.partition import balanced_ranges

GB = 10**9  # GPU memory is sold in decimal gigabytes (a "24 GB" RTX 4090 has 24e9 bytes, about 22.4 GiB)
GIB = 2**30

# Fraction of a GPU's memory a training process can fill with tensors: the CUDA context (~0.5 GB), cuBLAS
# workspaces and the caching allocator's fragmentation take the rest (assumption: about 10%).
USABLE_FRACTION = 0.9

# GPU table: memory, dense peak TFLOPS in bf16 (tensor cores, fp32 accumulate) and in float32 (no TF32, PyTorch's
# default for float32 matmuls), and $/hour from the reference paper's cloud prices (None where it gives none).
GPUS: dict[str, dict] = {
    "4090": dict(mem_gb=24, tflops_bf16=165.2, tflops_fp32=82.6, price=0.29),  # RTX 4090 (Ada), fp32-accumulate rate
    "v100": dict(mem_gb=32, tflops_bf16=125.0, tflops_fp32=15.7, price=None),  # V100 SXM2: fp16 tensor cores (no bf16)
    "a100-40": dict(mem_gb=40, tflops_bf16=312.0, tflops_fp32=19.5, price=1.20),  # A100 SXM4 40 GB
    "a100-80": dict(mem_gb=80, tflops_bf16=312.0, tflops_fp32=19.5, price=1.20),  # A100 SXM4 80 GB
    "a800": dict(mem_gb=80, tflops_bf16=312.0, tflops_fp32=19.5, price=0.69),  # A800: A100 silicon, slower NVLink
    "dcu": dict(mem_gb=64, tflops_bf16=100.0, tflops_fp32=25.0, price=None),  # Hygon DCU K100 class, approximate
}

# Bytes per parameter: (weight, gradient, float32 master copy, optimizer moments m + v), and activation bytes c.
# Adam's per-tensor `step` counters (4 bytes per parameter tensor) are neglected.
DTYPES: dict[str, dict] = {
    "float32": dict(weight=4, grad=4, master=0, moments=8, act=4),  # 4 W in all
    # bf16 weights for every resident parameter; the trainable ones also have an fp32 master, an fp32 gradient
    # (each bf16 gradient is added into it as autograd produces it) and fp32 moments: 2 + 16 bytes, as the
    # trainer's meter measures and as BAdam counts it (2M + 16M/D GB)
    "bf16-mixed": dict(weight=2, grad=4, master=4, moments=8, act=2),
    "bf16": dict(weight=2, grad=2, master=0, moments=4, act=2),  # pure bf16, moments in bf16 too
}

# Store dtypes of boundary states: bytes per stored element. The lossy 8-bit encodings (float8_e4m3, float8_e5m2,
# int8) add a float32 scale per token (storage.bytes_per_token is the same count; a test holds them equal).
STORE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1, "float8_e5m2": 1, "int8": 1}
LOSSY_SCALE_BYTES = 4

# Store compression: Blosc zstd level 1 + byte shuffle compresses bf16 activations 1.46x (measured on GPT-2
# activations, see DESIGN.md). The 8-bit codes of the lossy dtypes keep less redundancy: on a trained small-llama
# (docs/results.md, the lower of boundaries 2 and 4) float8_e4m3 1.10x, float8_e5m2 1.30x, int8 none. float32 and
# float16 are assumed uncompressed.
COMPRESSION = {"bfloat16": 1.46, "float32": 1.0, "float16": 1.0, "float8_e4m3": 1.1, "float8_e5m2": 1.3, "int8": 1.0}

# Standard shapes for model sizes. Llama-shaped: Llama-2 7B and 13B; 1.5B and 20B scaled with the same ratios.
# GPT-2-shaped: GPT-2 XL for 1.5B; 4h MLP, 50257 tokens, 1024 positions, tied embedding for the rest.
SIZES = {
    "llama": {
        "1.5b": dict(hidden=2048, layers=28, heads=16, intermediate=5504),
        "7b": dict(hidden=4096, layers=32, heads=32, intermediate=11008),
        "13b": dict(hidden=5120, layers=40, heads=40, intermediate=13824),
        "20b": dict(hidden=6144, layers=44, heads=48, intermediate=16384),
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

    def is_sparse(self, layer: int | None) -> bool:
        return layer is not None and bool(self.sparse) and self.sparse[layer]

    def layer_params(self, layer: int | None = None) -> int:
        """Parameters of decoder layer `layer` (None: a dense layer); a sparse layer counts every expert."""
        return self._layer_params(layer, self.experts)

    def active_layer_params(self, layer: int | None = None) -> int:
        """Parameters one token runs through in layer `layer`: a sparse layer's top-k experts, not all."""
        return self._layer_params(layer, self.experts_per_token)

    def _layer_params(self, layer: int | None, experts: int) -> int:
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
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_params(self) -> int:
        """Parameters of the output side: final norm and (untied) LM head."""
        norm = 2 * self.hidden if self.arch == "gpt2" else self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def total_params(self) -> int:
        """All parameters (a tied weight once)."""
        return self.embed_params() + self.span_params(0, self.layers) + self.head_params()


def shape_from_config(config, name: str = "") -> ModelShape:
    """A ModelShape from a Hugging Face config (GPT-2, or Llama-shaped: Llama, Mistral, Qwen2)."""
    if config.model_type == "gpt2":
        return ModelShape(
            name=name or "gpt2", arch="gpt2", vocab=config.vocab_size, hidden=config.n_embd, layers=config.n_layer,
            heads=config.n_head, kv_heads=config.n_head, head_dim=config.n_embd // config.n_head,
            intermediate=config.n_inner or 4 * config.n_embd, positions=config.n_positions,
            tied=bool(config.tie_word_embeddings), bias=True,
            dropout=max(config.attn_pdrop, config.resid_pdrop, config.embd_pdrop),
        )
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if not all(hasattr(config, key) for key in needed):
        raise UsageError(f"model type '{config.model_type}' is neither GPT-2- nor Llama-shaped")
    heads = config.num_attention_heads
    return ModelShape(
        name=name or config.model_type, arch="llama", vocab=config.vocab_size, hidden=config.hidden_size,
        layers=config.num_hidden_layers, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
        bias=bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)),
        **_experts_from_config(config),
    )


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
    dims = SIZES[arch][size.lower()]
    h, heads = dims["hidden"], dims["heads"]
    if arch == "gpt2":  # GPT-2 dropout 0.1 everywhere, as in the released configs
        return ModelShape(f"{size}-gpt2", "gpt2", 50257, h, dims["layers"], heads, heads, h // heads, 4 * h,
                          positions=1024, tied=True, bias=True, dropout=0.1)
    return ModelShape(f"{size}-llama", "llama", 32000, h, dims["layers"], heads, heads, h // heads,
                      dims["intermediate"])


def resolve_shape(spec: str, arch: str = "llama") -> ModelShape:
    """A shape from a size name, a preset, a model directory or a config.json file. Only a preset or a model's
    config loads torch and transformers."""
    if spec.lower() in SIZES["llama"]:
        return shape_for_size(spec, arch)
    from preinfer.presets import PRESETS, check_stageable, local_config

    path = Path(spec)
    if path.is_file():
        from transformers import AutoConfig

        try:
            config_dict = json.loads(path.read_text())
            config = AutoConfig.for_model(**config_dict)
        except (OSError, ValueError, KeyError) as err:
            raise UsageError(f"cannot read a model config from '{spec}': {err}") from err
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


# ---------------------------------------------------------------------------------------------------------------
# Activations saved for backward (elements -> bytes), by the rules in the module docstring.


def _llama_layer_acts(m: ModelShape, b: int, s: int, c: int, trainable: bool, input_grad: bool,
                      index: int | None = None) -> int:
    """Bytes Llama layer `index` saves for backward. A sparse (MoE) layer counts its MLP at the width one token
    activates (`mlp_width`), plus the router's float32 probabilities and each routed copy of a token's input
    (kept for the experts' weight gradients): an estimate, not checked against the meter."""
    bsh, bsad, probs = b * s * m.hidden, b * s * m.heads * m.head_dim, b * m.heads * s * s
    bsi = b * s * m.mlp_width(index)
    routing = b * s * m.experts * 4 + (b * s * m.experts_per_token * m.hidden * c if trainable else 0)
    f32 = 4  # RMSNorm upcasts its input to float32 and keeps that copy and rsqrt in float32
    total = (bsh + b * s) * f32 if input_grad else 0  # norm 1: input (pow), rsqrt
    if trainable:  # weight gradients: both norms' normalised x and outputs, o_proj input, down_proj input
        total += 4 * bsh * c + bsad * c + bsi * c
    total += 3 * bsad * c + probs * c  # q, repeated k, repeated v; softmax output (the matmul's input)
    if c != f32:
        total += probs * f32  # softmax runs with dtype=float32 and keeps that output, then a 16-bit copy
    total += (bsh + b * s) * f32  # norm 2: residual sum (pow), rsqrt
    total += routing if m.is_sparse(index) else 0
    return total + 3 * bsi * c  # gate output (SiLU input), SiLU output, up output


def _gpt2_layer_acts(m: ModelShape, b: int, s: int, c: int, trainable: bool, input_grad: bool,
                     index: int | None = None) -> int:
    """Bytes one GPT-2 layer saves for backward (dropout masks: 1 byte each, CUDA's fused dropout)."""
    bsh, bsi, probs = b * s * m.hidden, b * s * m.intermediate, b * m.heads * s * s
    layer_norm = bsh * c + 2 * b * s * 4  # input, mean and rstd in float32 (for input and weight gradients)
    total = 2 * layer_norm  # ln_1 (its input or its weight needs grad), ln_2 (residual sum)
    if trainable:  # weight gradients: c_attn, attention c_proj, c_fc, MLP c_proj inputs
        total += 3 * bsh * c + bsi * c
    total += 3 * bsh * c + probs * c  # contiguous q, k, v copies for the batched matmuls; softmax output
    if m.dropout > 0:  # CUDA keeps a 1-byte mask; PyTorch's CPU path keeps a c-byte float mask instead
        total += probs * (1 + c) + 2 * bsh  # attention dropout mask and output; two residual dropout masks
    return total + 4 * bsi * c  # tanh-GELU as elementwise ops: x (pow), tanh output, 0.5*x, 1 + tanh


def layer_activation_bytes(m: ModelShape, b: int, s: int, c: int, trainable: bool, input_grad: bool,
                           index: int | None = None) -> int:
    """Bytes decoder layer `index` saves for backward (0 when neither it nor anything below it trains)."""
    if not trainable and not input_grad:
        return 0
    layer = _gpt2_layer_acts if m.arch == "gpt2" else _llama_layer_acts
    return layer(m, b, s, c, trainable, input_grad, index)


def input_side_bytes(m: ModelShape, b: int, s: int, embed_trains: bool, any_layer_in_path: bool, c: int) -> int:
    """Bytes the embedding (and Llama's rotary tables) save for backward."""
    total = 8 * b * s if embed_trains else 0  # embedding backward keeps the int64 token ids
    if m.arch == "gpt2" and embed_trains:
        total += 8 * s + (b * s * m.hidden if m.dropout > 0 else 0)  # int64 position ids (batch 1); dropout mask
    if m.arch == "llama" and any_layer_in_path:
        total += 2 * s * m.head_dim * c  # rotary cos and sin, positions shared across the batch, once per step
    return total


def output_side_bytes(m: ModelShape, b: int, s: int, c: int, head_trains: bool, input_grad: bool,
                      tied_trains: bool) -> int:
    """Bytes the final norm, the LM head and the cross-entropy loss save for backward."""
    bs, bsh = b * s, b * s * m.hidden
    if not (head_trains or input_grad or tied_trains):
        return 0
    if m.arch == "gpt2":
        total = bsh * c + 2 * bs * 4  # ln_f: input, mean, rstd
        total += bsh * c if (tied_trains if m.tied else head_trains) else 0  # LM head input, for its weight grad
    else:
        total = (bsh + bs) * 4 if input_grad else 0  # final RMSNorm: float32 input, rsqrt
        total += 2 * bsh * c if head_trains else 0  # normalised input (norm weight grad), output (lm_head grad)
    return total + bs * m.vocab * 4 + 8 * bs + 4  # float32 log-softmax output (logits upcast), int64 targets


# ---------------------------------------------------------------------------------------------------------------
# Blocks, steps and per-GPU memory.


@dataclass(frozen=True)
class Block:
    """A run of consecutive layers trained together; the first block owns the embedding, the last the head."""

    start: int
    stop: int
    embed: bool
    head: bool


def partition(m: ModelShape, blocks: int) -> list[Block]:
    """`blocks` contiguous blocks of layers balanced by parameter count, the embedding joining the first and the
    head the last: the same blocks `preinfer bcd` trains (`preinfer.partition.balanced_ranges`)."""
    if not 1 <= blocks <= m.layers:
        raise UsageError(f"number of blocks must be between 1 and the model's {m.layers} layers, got {blocks}")
    sizes = [m.layer_params(layer) for layer in range(m.layers)]
    sizes[0] += m.embed_params()
    sizes[-1] += m.head_params()
    ranges = _balanced_ranges(tuple(sizes), blocks)
    return [Block(lo, hi, k == 0, k == blocks - 1) for k, (lo, hi) in enumerate(ranges)]


@functools.lru_cache(maxsize=4096)
def _balanced_ranges(sizes: tuple[int, ...], blocks: int) -> tuple[tuple[int, int], ...]:
    """`balanced_ranges`, remembered: the automatic choice asks for the same split at every pipeline degree."""
    return tuple(balanced_ranges(list(sizes), blocks))


def blocks_for_ufp(ufp: float, layers: int) -> int:
    """Number of blocks for an unfrozen parameter fraction: ceil(1/UFP) (1/3 -> 3), at most one per layer."""
    if not 0 < ufp <= 1:
        raise UsageError(f"UFP must be in (0, 1], got {ufp:g}")
    return min(layers, math.ceil(1 / ufp - 1e-9))


def block_params(m: ModelShape, block: Block) -> int:
    """Parameters of one block (a tied LM head belongs to the embedding's block)."""
    return (m.span_params(block.start, block.stop) + (m.embed_params() if block.embed else 0)
            + (m.head_params() if block.head else 0))


@dataclass(frozen=True)
class StepActs:
    """Saved-activation bytes of one step: per layer, and of the input and output sides."""

    layers: tuple[int, ...]
    input_side: int
    output_side: int
    recomputed: tuple[int, ...] = ()  # with recomputation: each layer's full set, held while it runs again

    def total(self, start: int = 0, stop: int | None = None, inputs: bool = True, outputs: bool = True) -> int:
        """Peak bytes of layers [start, stop), plus the input and output sides where asked.

        With recomputation the peak is the largest of: the end of forward (every layer's input and the output
        side held), and each layer's recomputation in backward (the output side and the inputs of the layers
        above it already freed; its own input and its full set held)."""
        layers = self.layers[start:stop]
        recomputed = self.recomputed[start:stop] or (0,) * len(layers)
        held, peak = (self.input_side if inputs else 0), 0
        for layer_input, full in zip(layers, recomputed):
            held += layer_input
            peak = max(peak, held + full)
        return max(peak, held + (self.output_side if outputs else 0))


@functools.lru_cache(maxsize=4096)
def step_activations(m: ModelShape, b: int, s: int, c: int, active: Block | None, recompute: bool) -> StepActs:
    """Activations saved in one step with `active` training (None: every parameter trains, full Adam).

    Layers below the active block run without grad (or are not resident, from a store): they save nothing.
    Recomputation (activation checkpointing of every layer in the gradient path) keeps each layer's 16/32-bit
    input and, during backward, one layer's full saved set at a time.
    """
    train = range(m.layers) if active is None else range(active.start, active.stop)
    embed_trains = active is None or active.embed
    head_trains = active is None or active.head
    input_grad, per_layer = embed_trains, []
    for layer in range(m.layers):
        per_layer.append(layer_activation_bytes(m, b, s, c, layer in train, input_grad, layer))
        input_grad = input_grad or layer in train
    recomputed = ()
    if recompute:
        recomputed = tuple(per_layer)
        per_layer = [b * s * m.hidden * c if full_bytes else 0 for full_bytes in recomputed]
    tied_trains = m.tied and embed_trains
    return StepActs(
        tuple(per_layer),
        input_side_bytes(m, b, s, embed_trains, input_grad, c),
        output_side_bytes(m, b, s, c, head_trains, input_grad, tied_trains),
        recomputed,
    )


@dataclass
class Memory:
    """Bytes per GPU of one configuration, by component, and whether it fits."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    total: int = 0
    fits: bool = False
    note: str = ""

    def finish(self, capacity: int) -> Memory:
        """Fill in the total and whether it fits `capacity` bytes."""
        self.total = self.weights + self.grads + self.optimizer + self.activations
        self.fits = self.total <= capacity
        return self


@dataclass(frozen=True)
class Settings:
    """The inputs of a plan other than the model shape."""

    seq_len: int = 1024
    micro_batch: int = 1
    dtype: str = "float32"
    recompute: bool = False
    gpu: str = "4090"
    gpu_mem_gb: float | None = None  # overrides the GPU table's memory
    blocks: int = 3
    tokens: int | None = None
    bandwidth_gbps: float = 25.0  # 2 x 25 Gbps links in the paper's clusters; one link assumed
    price_per_hour: float | None = None  # overrides the paper's price for the GPU
    mfu: float = 0.4  # model-FLOPs utilisation: fraction of peak FLOPs a training step achieves (assumption)
    compression: float | None = None  # store codec ratio; None: COMPRESSION of the store dtype
    store_dtype: str | None = None  # one of STORE_DTYPES; None: float32 when training in float32, else bfloat16
    pipeline: int | None = None  # pipeline degree for the traffic comparison; None: the plan's own (at least 2)
    epochs_per_visit: float = 1.0  # epochs each visit trains over the dataset (one caching pass serves them all)
    budget_bytes: int | None = None  # bytes the run may fill, given directly (--memory-budget); overrides the GPU's

    def capacity(self) -> int:
        """Bytes a training process can fill on one GPU (the memory budget where one is given)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        gb = self.gpu_mem_gb if self.gpu_mem_gb is not None else GPUS[self.gpu]["mem_gb"]
        return int(gb * GB * USABLE_FRACTION)


def _component_bytes(settings: Settings, resident: int, trainable: int) -> tuple[int, int, int]:
    """Weights, gradient and optimizer-state bytes of `resident` and `trainable` parameter counts."""
    d = DTYPES[settings.dtype]
    return resident * d["weight"], trainable * d["grad"], trainable * (d["master"] + d["moments"])


def full_memory(m: ModelShape, settings: Settings, recompute: bool) -> Memory:
    """Full-parameter Adam on one GPU."""
    n = m.total_params()
    acts = step_activations(m, settings.micro_batch, settings.seq_len, DTYPES[settings.dtype]["act"], None, recompute)
    return Memory(*_component_bytes(settings, n, n), acts.total()).finish(settings.capacity())


def bcd_memory(m: ModelShape, settings: Settings, blocks: list[Block], k: int, store: bool) -> Memory:
    """BCD-Adam on one GPU while block k trains: live (whole model resident) or from a store (suffix only).

    From a store, only the suffix (layers >= the block's first layer, and the head) is resident; a tied GPT-2
    head keeps the token embedding resident too, since it is the head's weight.
    """
    block = blocks[k]
    resident = m.total_params()
    if store:
        resident = m.span_params(block.start, m.layers) + m.head_params()
        resident += m.vocab * m.hidden if (m.tied and not block.embed) else 0
        resident += m.embed_params() if block.embed else 0
    c = DTYPES[settings.dtype]["act"]
    acts = step_activations(m, settings.micro_batch, settings.seq_len, c, block, settings.recompute)
    memory = Memory(*_component_bytes(settings, resident, block_params(m, block)), acts.total())
    memory.note = f"block {k} (layers {block.start}-{block.stop - 1})"
    return memory.finish(settings.capacity())


def worst_bcd(m: ModelShape, settings: Settings, blocks: list[Block], store: bool) -> Memory:
    """The visit with the largest footprint (from a store: blocks above the first; block 0 has no prefix)."""
    candidates = range(1 if store and len(blocks) > 1 else 0, len(blocks))
    return max((bcd_memory(m, settings, blocks, k, store) for k in candidates), key=lambda mem: mem.total)


def pipeline_peak(m: ModelShape, settings: Settings, blocks: list[Block] | None, degree: int) -> int:
    """Largest per-GPU bytes with `degree` pipeline stages (layers split evenly; None: full Adam).

    1F1B schedule: stage j keeps the activations of (degree - j) micro-batches in flight."""
    stages = partition(m, degree)
    visits = [None] if blocks is None else blocks
    return max(stage_bytes(m, settings, stage, active, degree - j)
               for active in visits for j, stage in enumerate(stages))


def stage_bytes(m: ModelShape, settings: Settings, stage: Block, active: Block | None, in_flight: int) -> int:
    """Bytes one pipeline stage holds while `active` trains (None: full Adam): its layers' weights, gradients and
    optimizer state for the part of the active block it holds, and the activations of `in_flight` micro-batches
    (none below the active block, which runs forward only)."""
    c = DTYPES[settings.dtype]["act"]
    acts = step_activations(m, settings.micro_batch, settings.seq_len, c, active, settings.recompute)
    params = block_params(m, stage)
    params += m.vocab * m.hidden if m.tied and stage.head and not stage.embed else 0  # its copy of the tied weight
    if active is None:
        trainable = params
    else:
        lo, hi = max(stage.start, active.start), min(stage.stop, active.stop)
        trainable = m.span_params(lo, max(lo, hi)) + (m.embed_params() if stage.embed and active.embed else 0)
        trainable += m.head_params() if stage.head and active.head else 0
    stage_acts = acts.total(stage.start, stage.stop, inputs=stage.embed, outputs=stage.head) * in_flight
    return sum(_component_bytes(settings, params, trainable)) + stage_acts


def fewest_blocks(m: ModelShape, settings: Settings, degree: int = 1) -> tuple[int, int] | None:
    """The fewest blocks (largest UFP) whose worst live visit fits `settings.capacity()` per GPU with `degree`
    pipeline stages, and that peak in bytes; None when even one layer per block does not fit."""
    capacity = settings.capacity()
    for n in range(1, m.layers + 1):
        blocks = partition(m, n)
        peak = worst_bcd(m, settings, blocks, store=False).total if degree == 1 else \
            pipeline_peak(m, settings, blocks, degree)
        if peak <= capacity:
            return n, peak
    return None


def auto_choice(m: ModelShape, settings: Settings) -> dict:
    """The fewest blocks (largest UFP) whose worst live visit fits one GPU, else the smallest pipeline degree."""
    for degree in range(1, m.layers + 1):
        found = fewest_blocks(m, settings, degree)
        if found is not None:
            return dict(blocks=found[0], ufp=1 / found[0], pipeline_degree=degree, per_gpu_bytes=found[1])
    return dict(blocks=None, ufp=None, pipeline_degree=None, per_gpu_bytes=None)


def full_pipeline_degree(m: ModelShape, settings: Settings) -> int | None:
    """The smallest pipeline degree at which full-parameter Adam fits (None if not even one layer per GPU)."""
    capacity = settings.capacity()
    return next((p for p in range(1, m.layers + 1) if pipeline_peak(m, settings, None, p) <= capacity), None)


# ---------------------------------------------------------------------------------------------------------------
# Store size, pre-inference traffic and cost.


def store_dtype(settings: Settings) -> str:
    """Storage dtype of boundary states: the chosen one, else float32 when training in float32, else bfloat16."""
    if settings.store_dtype is not None:
        return settings.store_dtype
    return "float32" if settings.dtype == "float32" else "bfloat16"


def store_bytes_per_token(m: ModelShape, settings: Settings) -> float:
    """On-disk bytes of one token's hidden state at a boundary, a lossy encoding's scale included (side tensors
    such as labels not counted)."""
    kind = store_dtype(settings)
    ratio = settings.compression if settings.compression is not None else COMPRESSION[kind]
    scale = LOSSY_SCALE_BYTES if STORE_DTYPES[kind] == 1 else 0
    return (m.hidden * STORE_DTYPES[kind] + scale) / ratio


def traffic(m: ModelShape, settings: Settings, degree: int) -> dict:
    """Activation traffic of pipeline-parallel BCD against one caching pass and its reads, per token.

    Pipeline: at each of the degree - 1 stage boundaries, forward activations and backward gradients of b*s*h
    elements cross the link every step (worst case: the active block on the first stage). Pre-inference: one
    caching pass writes the boundary store once and every epoch reads it back over the same link (compressed).
    Break-even epochs E solve E * pipeline = write + E * read.
    """
    c = DTYPES[settings.dtype]["act"]
    pipeline = 2 * (degree - 1) * m.hidden * c
    store = store_bytes_per_token(m, settings)
    break_even = store / (pipeline - store) if pipeline > store else None  # None: never breaks even
    result = dict(
        pipeline_degree=degree, pipeline_bytes_per_token=pipeline,
        pipeline_bytes_per_step=pipeline * settings.seq_len * settings.micro_batch,
        cache_write_bytes_per_token=store, cache_read_bytes_per_token_per_epoch=store,
        break_even_epochs=break_even,
        pays_off=break_even is not None and break_even <= settings.epochs_per_visit,
    )
    if settings.tokens:
        link = settings.bandwidth_gbps * 1e9 / 8  # bytes per second on one link
        result["pipeline_seconds_per_epoch"] = settings.tokens * pipeline / link
        result["cache_seconds_per_epoch"] = settings.tokens * store / link
    return result


def flops_per_token(m: ModelShape, blocks: list[Block], epochs_per_visit: float) -> dict:
    """Training FLOPs per token: 6N for full Adam (2N forward, 4N backward; attention's s^2 terms neglected).

    N counts matmul parameters a token runs through (layers, a sparse layer's router and top-k experts only, and
    the LM head; an embedding lookup costs nothing). For a visit of
    block k: forward 2N; backward 2N_above + 4N_k (input gradients above and in the block, weight gradients in
    it). From a store, the forward skips the prefix but one caching pass per visit runs it over the dataset
    once (2N_below / epochs per visit, per trained token). Averaged over visits of equal token counts.
    """
    head = m.vocab * m.hidden
    per_block = [m.span_params(b.start, b.stop, active=True) + (head if b.head else 0) for b in blocks]
    n = sum(per_block)
    live = store = 0.0
    for k, own in enumerate(per_block):
        below, above = sum(per_block[:k]), sum(per_block[k + 1:])
        live += 2 * n + 2 * above + 4 * own
        store += 2 * (own + above) + 2 * above + 4 * own + 2 * below / epochs_per_visit
    return dict(full=6.0 * n, bcd_live=live / len(blocks), bcd_store=store / len(blocks))


def cost(m: ModelShape, settings: Settings, blocks: list[Block]) -> dict | None:
    """GPU-hours and dollars to train on `tokens` tokens: FLOPs / (peak x MFU), at the hourly price.

    GPU-hours do not depend on the number of GPUs (ideal scaling; pipeline bubbles neglected).
    """
    if not settings.tokens:
        return None
    gpu = GPUS.get(settings.gpu, {})
    peak = gpu.get("tflops_fp32" if settings.dtype == "float32" else "tflops_bf16")
    price = settings.price_per_hour if settings.price_per_hour is not None else gpu.get("price")
    if peak is None:
        return dict(note="no peak FLOPs for a --gpu-mem GPU; give --gpu for the cost estimate")
    out = dict(peak_tflops=peak, mfu=settings.mfu, price_per_hour=price)
    for mode, flops in flops_per_token(m, blocks, settings.epochs_per_visit).items():
        hours = settings.tokens * flops / (peak * 1e12 * settings.mfu) / 3600
        out[mode] = dict(gpu_hours=hours, dollars=None if price is None else hours * price)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The plan.


@dataclass
class MemoryPlan:
    """Everything `preinfer plan` reports."""

    model: dict
    settings: dict
    capacity_bytes: int
    weight_bytes: int
    memory: dict[str, Memory]
    auto: dict
    full_adam_pipeline_degree: int | None
    store: dict
    traffic: dict
    cost: dict | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def plan_memory(m: ModelShape, settings: Settings) -> MemoryPlan:
    """The full plan for a model shape and settings."""
    if settings.gpu_mem_gb is None and settings.gpu not in GPUS:
        raise UsageError(f"unknown GPU '{settings.gpu}'; use one of {', '.join(GPUS)} or --gpu-mem GB")
    if settings.dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{settings.dtype}'; use one of {', '.join(DTYPES)}")
    blocks = partition(m, settings.blocks)
    memory = {
        "full_adam": full_memory(m, settings, recompute=False),
        "full_adam_recompute": full_memory(m, settings, recompute=True),
        "bcd_live": worst_bcd(m, settings, blocks, store=False),
        "bcd_store": worst_bcd(m, settings, blocks, store=True),
    }
    auto = auto_choice(m, settings)
    degree = settings.pipeline or max(2, auto["pipeline_degree"] or 2)
    per_token = store_bytes_per_token(m, settings)
    store = dict(dtype=store_dtype(settings), bytes_per_token=per_token,
                 bytes_per_boundary=None if not settings.tokens else per_token * settings.tokens)
    return MemoryPlan(
        model=asdict(m) | dict(params=m.total_params()),
        settings=asdict(settings) | dict(ufp=1 / settings.blocks),
        capacity_bytes=settings.capacity(),
        weight_bytes=m.total_params() * DTYPES[settings.dtype]["weight"],
        memory=memory, auto=auto, full_adam_pipeline_degree=full_pipeline_degree(m, settings),
        store=store, traffic=traffic(m, settings, degree), cost=cost(m, settings, blocks),
        notes=[
            f"fits = total <= {USABLE_FRACTION:.0%} of the GPU's memory (CUDA context and fragmentation)",
            "BCD rows are the worst visit; from a store excludes block 0, which has no prefix and trains live",
        ],
    )
