"""What a step allocates beyond the tensors it keeps, measured in a fresh process's peak RSS: the terms the planner
adds for torch's CPU Adam step (`step_temporaries`) and for a tied embedding's backward (`tied_gradients`), and the
bound the chunked 8-bit step keeps."""

from __future__ import annotations

import subprocess
import sys

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
from preinfer.optim import build_optimizer
from preinfer.config import OptimConfig

{STATUS}
p = torch.nn.Parameter(torch.randn({ROWS}, {COLS}))
optimizer = build_optimizer([p], OptimConfig(name=sys.argv[1], lr=1e-4, weight_decay=0.0))
p.grad = torch.randn_like(p)
optimizer.step()  # the state exists from here on
rss = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
optimizer.step()
print((status("VmHWM") - rss) / p.numel() / 4)
"""


def peak_in_tensors(optimizer: str) -> float:
    """The peak RSS rise during a second step of `optimizer` on one tensor, in multiples of its float32 bytes."""
    out = subprocess.run([sys.executable, "-c", PEAK_DURING_STEP, optimizer], capture_output=True, text=True,
                         check=True).stdout
    return float(out.split()[-1])


def test_torchs_cpu_adam_step_allocates_the_two_temporaries_the_planner_counts():
    shape = resolve_shape("llama3-8b")
    settings = Settings(dtype="float32", host_device=True)
    span = LayerSpan(0, 1, True, False)  # the embedding is the largest tensor
    assert step_temporaries(shape, settings, span, 0) == 2 * 4 * shape.vocab * shape.hidden
    assert 1.7 < peak_in_tensors("adam") < 2.5


def test_the_8bit_step_of_a_large_tensor_stays_within_a_chunk_s_temporaries():
    assert peak_in_tensors("adamw8bit") < 4  # one call over the whole tensor: about 13 x the tensor


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
    assert transients(shape, unfused, block0, 0) == max(step_temporaries(shape, unfused, block0, 0), 2 * weight)
