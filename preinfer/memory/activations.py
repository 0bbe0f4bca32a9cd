"""Activations saved for backward, per layer and per step (elements -> bytes).

Activations count what PyTorch's autograd saves for backward in the Hugging Face Llama and GPT-2 layers, with
eager or sdpa attention, tensor by tensor, as `preinfer.memory.meter.MemoryMeter` measures it. A tensor saved by a
linear layer for its weight gradient exists only when that layer trains; a tensor saved for the input gradient
exists only when its input requires grad. Notation: b micro-batch, s sequence length, h hidden size, a heads, d head dim,
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
With sdpa attention (PyTorch's scaled_dot_product_attention: flash on CPU and CUDA, memory-efficient on CUDA) no
[b, a, s, s] tensor is saved: the kernel keeps q, k and v (k and v at the key/value heads: with no padding mask
the framework passes GQA through, `enable_gqa`), its output (the o_proj input, one storage) and a float32
log-sum-exp per query row, b*a*s; backward recomputes the probabilities. Llama's attention term becomes
2*bsad + 2*b*s*kv*d elements + 4*b*a*s bytes, in every layer in the gradient path. A padded batch (conversations)
passes a mask instead: k and v are then repeated to every head and the mask is saved per layer (b*s^2 elements);
the planner prices unpadded batches (packed samples).
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
from dataclasses import dataclass

from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.shapes import ModelShape


def linear_input_bytes(m: ModelShape, b: int, s: int, c: int, index: int | None, attention: str) -> int:
    """Bytes of the inputs a decoder layer's linear weights keep for their gradients, beyond what the layer saves
    in the gradient path anyway. Llama: the two norms' outputs (q/k/v and gate/up input) and the down_proj input;
    GPT-2: the c_attn, c_fc and MLP c_proj inputs. Eager attention adds the o_proj (c_proj) input, which sdpa
    keeps as its output anyway."""
    bsh = b * s * m.hidden
    if m.arch == "gpt2":
        return 2 * bsh * c + b * s * m.intermediate * c + (bsh * c if attention == "eager" else 0)
    o_proj = b * s * m.heads * m.head_dim * c if attention == "eager" else 0
    return 2 * bsh * c + b * s * m.mlp_width(index) * c + o_proj


def _llama_layer_acts(m: ModelShape, b: int, s: int, c: int, trainable: bool, input_grad: bool,
                      index: int | None, attention: str) -> int:
    """Bytes Llama layer `index` saves for backward. A sparse (MoE) layer counts its MLP at the width one token
    activates (`mlp_width`), plus the router's float32 probabilities and each routed copy of a token's input
    (kept for the experts' weight gradients): an estimate, not checked against the meter."""
    bsh, bsad, probs = b * s * m.hidden, b * s * m.heads * m.head_dim, b * m.heads * s * s
    bskd = b * s * m.kv_heads * m.head_dim
    bsi = b * s * m.mlp_width(index)
    routing = b * s * m.experts * 4 + (b * s * m.experts_per_token * m.hidden * c if trainable else 0)
    f32 = 4  # RMSNorm upcasts its input to float32 and keeps that copy and rsqrt in float32
    total = (bsh + b * s) * f32 if input_grad else 0  # norm 1: input (pow), rsqrt
    if trainable:  # weight gradients: both norms' normalised x, and the linear weights' inputs
        total += 2 * bsh * c + linear_input_bytes(m, b, s, c, index, attention)
    if attention == "sdpa":  # q, k, v at the key/value heads, output (= o_proj input), float32 log-sum-exp
        total += (2 * bsad + 2 * bskd) * c + b * m.heads * s * f32
    else:
        total += 3 * bsad * c + probs * c  # q, repeated k, repeated v; softmax output (the matmul's input)
        if c != f32:
            total += probs * f32  # softmax runs with dtype=float32 and keeps that output, then a 16-bit copy
    total += (bsh + b * s) * f32  # norm 2: residual sum (pow), rsqrt
    total += routing if m.is_sparse(index) else 0
    return total + 3 * bsi * c  # gate output (SiLU input), SiLU output, up output


def _gpt2_layer_acts(m: ModelShape, b: int, s: int, c: int, trainable: bool, input_grad: bool,
                     index: int | None, attention: str) -> int:
    """Bytes one GPT-2 layer saves for backward (dropout masks: 1 byte each, CUDA's fused dropout)."""
    bsh, bsi, probs = b * s * m.hidden, b * s * m.intermediate, b * m.heads * s * s
    layer_norm = bsh * c + 2 * b * s * 4  # input, mean and rstd in float32 (for input and weight gradients)
    total = 2 * layer_norm  # ln_1 (its input or its weight needs grad), ln_2 (residual sum)
    if trainable:  # weight gradients: the linear weights' inputs
        total += linear_input_bytes(m, b, s, c, index, attention)
    if attention == "sdpa":  # q, k, v as views of c_attn's output; output (= c_proj input); float32 log-sum-exp
        total += 4 * bsh * c + b * m.heads * s * 4
    else:
        total += 3 * bsh * c + probs * c  # contiguous q, k, v copies for the batched matmuls; softmax output
    if m.dropout > 0:  # CUDA keeps a 1-byte mask; PyTorch's CPU path keeps a c-byte float mask instead
        # eager: attention dropout mask and output (sdpa's kernels draw theirs again in backward); two residual
        total += (probs * (1 + c) if attention == "eager" else 0) + 2 * bsh
    return total + 4 * bsi * c  # tanh-GELU as elementwise ops: x (pow), tanh output, 0.5*x, 1 + tanh


def layer_activation_bytes(m: ModelShape, b: int, s: int, c: int, trainable: bool, input_grad: bool,
                           index: int | None, attention: str) -> int:
    """Bytes decoder layer `index` saves for backward with `attention` (sdpa, eager) (0 when neither it nor
    anything below it trains)."""
    if not trainable and not input_grad:
        return 0
    layer = _gpt2_layer_acts if m.arch == "gpt2" else _llama_layer_acts
    return layer(m, b, s, c, trainable, input_grad, index, attention)


def input_side_bytes(m: ModelShape, b: int, s: int, embed_trains: bool, any_layer_in_path: bool, c: int) -> int:
    """Bytes the embedding (and Llama's rotary tables) save for backward."""
    total = 8 * b * s if embed_trains else 0  # embedding backward keeps the int64 token ids
    if m.arch == "gpt2" and embed_trains:
        total += 8 * s + (b * s * m.hidden if m.dropout > 0 else 0)  # int64 position ids (batch 1); dropout mask
    if m.arch == "llama" and any_layer_in_path:
        total += 2 * s * m.head_dim * c  # rotary cos and sin, positions shared across the batch, once per step
    return total


def output_side_bytes(m: ModelShape, b: int, s: int, c: int, head_trains: bool, input_grad: bool,
                      tied_trains: bool, loss_chunk: int | None = None) -> int:
    """Bytes the final norm, the LM head and the cross-entropy loss save for backward: with the plain loss
    (`loss_chunk` None) the float32 log-softmax of every position; with the chunked loss
    (`preinfer.chunked_loss`) the head's input and the targets of every position, and, while backward runs a
    chunk again, that chunk's float32 log-softmax."""
    bs, bsh = b * s, b * s * m.hidden
    if not (head_trains or input_grad or tied_trains):
        return 0
    head_weight_trains = (tied_trains if m.tied else head_trains) if m.arch == "gpt2" else head_trains
    if m.arch == "gpt2":
        total = bsh * c + 2 * bs * 4  # ln_f: input, mean, rstd
    else:
        total = (bsh + bs) * 4 if input_grad else 0  # final RMSNorm: float32 input, rsqrt
        total += bsh * c if head_trains else 0  # normalised input (norm weight grad)
    if loss_chunk is None:
        head_input = bsh * c if head_weight_trains else 0  # the norm's output, for the head's weight gradient
        return total + head_input + bs * m.vocab * 4 + 8 * bs + 4  # float32 log-softmax (upcast), int64 targets
    kept = bsh * c + 8 * bs  # the head's input (the norm's output, to run chunks again) and the int64 targets
    return total + kept + min(loss_chunk, bs) * m.vocab * 4 + 4  # one chunk's log-softmax, its weight sum


def loss_workspace(m: ModelShape, b: int, s: int, c: int, loss_chunk: int | None) -> int:
    """Bytes the loss's backward allocates for a moment beyond what is saved for it, while every activation is
    still held: the float32 gradients of the log-softmax's output and input, each [rows, vocab] (rows: every
    position with the plain loss, one chunk with the chunked), and with the chunked loss the chunk's logits
    themselves (c bytes each), computed again, and the gradient of the head's input, filled chunk by chunk
    (tests/test_step_memory.py measures both)."""
    if loss_chunk is None:
        return 2 * b * s * m.vocab * 4
    return min(loss_chunk, b * s) * m.vocab * (2 * 4 + c) + b * s * m.hidden * c



@dataclass(frozen=True)
class StepActs:
    """Saved-activation bytes of one step: per layer, and of the input and output sides."""

    layers: tuple[int, ...]
    input_side: int
    output_side: int
    recomputed: tuple[int, ...] = ()  # with recomputation: each layer's full set, held while it runs again
    offloaded: int = 0  # with offload: the layers' kept inputs, in host memory until backward

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
def step_activations(m: ModelShape, b: int, s: int, c: int, active: LayerSpan | None, recompute: bool,
                     attention: str, loss_chunk: int | None = None, offload: bool = False) -> StepActs:
    """Activations saved in one step with `active` training (None: every parameter trains, full Adam), the
    `attention` implementation (sdpa, eager) and the loss (`output_side_bytes`).

    Layers below the active block run without grad (or are not resident, from a store): they save nothing.
    Recomputation (activation checkpointing of every layer in the gradient path) keeps each layer's 16/32-bit
    input and, during backward, one layer's full saved set at a time. With `offload` those inputs wait in host
    memory (`offloaded`), and a layer's own comes back to the device while it runs again (in float32 its set
    holds it already, where the first norm keeps its input).
    """
    train = range(m.layers) if active is None else range(active.start, active.stop)
    embed_trains = active is None or active.embed
    head_trains = active is None or active.head
    input_grad, per_layer, saves_input = embed_trains, [], []
    for layer in range(m.layers):
        per_layer.append(layer_activation_bytes(m, b, s, c, layer in train, input_grad, layer, attention))
        saves_input.append(input_grad and c == 4)  # its first norm keeps the float32 input itself
        input_grad = input_grad or layer in train
    recomputed, offloaded = (), 0
    if recompute:
        recomputed = tuple(per_layer)
        per_layer = [b * s * m.hidden * c if full_bytes else 0 for full_bytes in recomputed]
    if recompute and offload:  # a layer's input back on the device while it runs again, unless its set holds it
        recomputed = tuple(full + (0 if saved else kept) for full, kept, saved in zip(recomputed, per_layer,
                                                                                         saves_input))
        offloaded, per_layer = sum(per_layer), [0] * len(per_layer)
    tied_trains = m.tied and embed_trains
    return StepActs(
        tuple(per_layer),
        input_side_bytes(m, b, s, embed_trains, input_grad, c),
        output_side_bytes(m, b, s, c, head_trains, input_grad, tied_trains, loss_chunk),
        recomputed,
        offloaded,
    )
