"""What a step allocates beyond the tensors it keeps, measured in a fresh process's peak RSS: the terms the planner
adds for torch's CPU Adam step (`step_temporaries`) and for a tied embedding's backward (`tied_gradients`), and the
bound the chunked 8-bit step keeps."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from preinfer.memory.activations import loss_workspace
from preinfer.memory.footprint import step_temporaries, tied_gradients, transients
from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import resolve_shape

ROWS, COLS = 8192, 2048  # 16.8M elements: a 64 MiB float32 tensor, every allocation of it mmapped (and given back)

# A child's /proc/self/status field in bytes.
STATUS = '''
def status(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
'''

# The peak is the process's VmHWM, reset just before the step (getrusage's ru_maxrss would not do: a child
# inherits its parent's maximum, and pytest's own is larger than this whole process).
PEAK_DURING_STEP = f"""
import sys, torch
import preinfer.low_bit
from preinfer.optim import build_optimizer
from preinfer.config import OptimConfig

{STATUS}
rows, cols, chunk = map(int, sys.argv[2:5])
preinfer.low_bit.CHUNK = chunk or preinfer.low_bit.CHUNK
p = torch.nn.Parameter(torch.randn(rows, cols))
optimizer = build_optimizer([p], OptimConfig(name=sys.argv[1], lr=1e-4, weight_decay=0.0))
p.grad = torch.randn_like(p)
optimizer.step()  # the state exists from here on
rss = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
optimizer.step()
print((status("VmHWM") - rss) / p.numel() / 4)
"""


def peak_in_tensors(optimizer: str, rows: int = ROWS, cols: int = COLS, chunk: int = 0) -> float:
    """The peak RSS rise during a second step of `optimizer` on one rows x cols tensor, in multiples of its float32
    bytes; `chunk` (elements) replaces preinfer.low_bit.CHUNK where given. Allocations of 64 KiB and more are mmapped
    and given back (MALLOC_MMAP_THRESHOLD_), so the peak follows the tensors alive at any size."""
    out = subprocess.run([sys.executable, "-c", PEAK_DURING_STEP, optimizer, str(rows), str(cols), str(chunk)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}).stdout
    return float(out.split()[-1])


def test_torchs_cpu_adam_step_allocates_the_two_temporaries_the_planner_counts():
    shape = resolve_shape("llama3-8b")
    settings = Settings(dtype="float32", host_device=True)
    span = LayerSpan(0, 1, True, False)  # the embedding is the largest tensor
    assert step_temporaries(shape, settings, span, 0) == 2 * 4 * shape.vocab * shape.hidden
    assert 1.7 < peak_in_tensors("adam") < 2.5


def test_the_8bit_step_of_a_large_tensor_stays_within_a_chunk_s_temporaries():
    """A tensor of 4 chunks (2^20 elements in chunks of 2^18, the module's CHUNK scaled down with the tensor): about
    13 / 4 x the tensor; one call over the whole tensor holds about 13 x."""
    assert peak_in_tensors("adamw8bit", ROWS // 16, COLS, chunk=1 << 18) < 4


# The backward of a Llama whose head is its embedding (transformers' own model, tie_word_embeddings), over 16 tokens:
# its activations are small beside the 64 MiB weight. The peak is over the RSS just before backward.
PEAK_DURING_TIED_BACKWARD = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

{STATUS}
config = LlamaConfig(vocab_size={ROWS}, hidden_size={COLS}, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
model = LlamaForCausalLM(config)
for name, p in model.named_parameters():
    p.requires_grad_(name == "model.embed_tokens.weight")
ids = torch.randint(0, {ROWS}, (1, 16))
for _ in range(2):  # the second backward's, after the first's allocations
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    rss = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    loss.backward()
    peak = status("VmHWM") - rss
print(peak / ({ROWS} * {COLS} * 4))
"""


def test_a_tied_embedding_s_backward_holds_three_gradients_at_once_as_the_planner_counts():
    out = subprocess.run([sys.executable, "-c", PEAK_DURING_TIED_BACKWARD], capture_output=True, text=True,
                         check=True).stdout
    assert 2.7 < float(out.split()[-1]) < 3.3  # the head's gradient, the embedding's and their sum
    shape = resolve_shape("tiny-gpt2")
    settings, weight = Settings(dtype="float32", fused_step=True), 4 * shape.vocab * shape.hidden
    block0, block1 = LayerSpan(0, 1, True, False), LayerSpan(1, 2, False, False)
    assert tied_gradients(shape, settings, block0, 0) == 2 * weight  # beyond the one gradient `grads` counts
    assert tied_gradients(shape, settings, block0, weight) == weight  # less the activations freed by then
    assert tied_gradients(shape, settings, block1, 0) == 0
    unfused = Settings(dtype="float32", host_device=True)
    loss = loss_workspace(shape, 1, 1024, 4, unfused.loss_chunk)  # the loss's backward: a chunk's logits, two gradients
    assert transients(shape, unfused, block0, 0) == max(step_temporaries(shape, unfused, block0, 0), 2 * weight, loss)


# The loss's backward over 8192 tokens of a 2048-token vocabulary (a [tokens, vocab] float32 tensor is 64 MiB), the
# plain loss from whole logits or the chunked one in chunks of 1024 tokens. Allocations are mmapped and given back
# at any size (MALLOC_MMAP_THRESHOLD_), so the peak RSS follows the tensors alive; the peak is over the RSS just
# before backward, in multiples of one [rows, vocab] float32 tensor (rows: every token, or one chunk).
TOKENS, VOCAB, CHUNK = 8192, 2048, 1024
PEAK_DURING_LOSS_BACKWARD = f"""
import sys, torch
from preinfer.chunked_loss import LinearHead, chunked_loss_sum
from preinfer.staged import causal_lm_loss

{STATUS}
torch.manual_seed(0)
weight = torch.nn.Parameter(torch.randn({VOCAB}, 64) / 8)
features = torch.randn(1, {TOKENS} + 1, 64, requires_grad=True)
labels = torch.randint(0, {VOCAB}, (1, {TOKENS} + 1))
for _ in range(2):  # the second backward's, after the first's allocations
    weight.grad = features.grad = None
    if sys.argv[1] == "plain":
        loss = causal_lm_loss(torch.nn.functional.linear(features, weight), labels, reduction="sum")
    else:
        loss = chunked_loss_sum(features[0, :-1], LinearHead(weight), labels[0, 1:], {CHUNK})
    rss = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    loss.backward()
    peak = status("VmHWM") - rss
rows = {TOKENS} if sys.argv[1] == "plain" else {CHUNK}
print(peak / (rows * {VOCAB} * 4))
"""


def test_the_loss_s_backward_allocates_what_the_planner_counts_plain_and_chunked():
    """The plain loss's backward holds two float32 gradients of the whole logits beyond the log-softmax it saved
    (the planner's `loss_workspace`); the chunked one, for one chunk: its log-softmax (the activation the planner
    counts while a chunk runs again), its logits and the same two gradients, and the input's gradient."""
    shape = replace(resolve_shape("tiny-llama"), vocab=VOCAB)
    peaks = {}
    for loss in ("plain", "chunked"):
        out = subprocess.run([sys.executable, "-c", PEAK_DURING_LOSS_BACKWARD, loss], capture_output=True,
                             text=True, check=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}).stdout
        peaks[loss] = float(out.split()[-1])
    unit = TOKENS * VOCAB * 4
    assert loss_workspace(shape, 1, TOKENS, 4, None) == 2 * unit
    assert peaks["plain"] == pytest.approx(2, abs=0.3)
    chunk_unit, input_gradient = CHUNK * VOCAB * 4, TOKENS * 64 * 4
    assert loss_workspace(shape, 1, TOKENS, 4, CHUNK) + chunk_unit == 4 * chunk_unit + input_gradient
    assert peaks["chunked"] == pytest.approx(4 + input_gradient / chunk_unit, abs=0.3)
