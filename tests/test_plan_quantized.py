"""The planner's frozen dtypes, 8-bit moments, fused step and host masters: on a hand-computable shape, and
against the bytes torchao and the optimizer actually allocate."""

import dataclasses

import pytest
import torch

from preinfer.errors import UsageError
from preinfer.frozen_weights import encode
from preinfer.low_bit import low_bit_adam
from preinfer.memory.footprint import bcd_memory
from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.quantized import frozen_linear_bytes, moment_bytes
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import ModelShape, shape_for_size

# Linear weights per layer: q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128: 36,864 elements.
TINY = ModelShape("tiny", "llama", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128)
BLOCKS = [LayerSpan(0, 1, True, False), LayerSpan(1, 2, False, False), LayerSpan(2, 4, False, True)]
BASE = Settings(dtype="bf16-mixed", seq_len=8)


def visit(**fields):
    return bcd_memory(TINY, dataclasses.replace(BASE, **fields), BLOCKS, 1, store=False)


def test_defaults_keep_todays_bytes_and_no_host_memory():
    today = visit()
    assert today.host == 0 and today.weights == TINY.total_params() * 2
    assert today.grads == 36992 * 4 and today.optimizer == 36992 * 12  # the block: 36,864 + two 64-element norms = 36,992


def test_int8_frozen_layers_hold_a_byte_and_a_row_scale_and_their_masters_go_to_the_host():
    today, int8 = visit(), visit(frozen_dtype="int8")
    # three frozen layers, each 36,864 bytes of codes + 4 x 512 rows of scales instead of 2 x 36,864
    assert today.weights - int8.weights == 3 * (2 * 36864 - (36864 + 4 * 512))
    assert int8.host == 4 * 36864 * 2  # every layer's linear masters, bf16
    assert int8.total == int8.weights + int8.grads + int8.optimizer + int8.activations


def test_8bit_moments_and_the_fused_step():
    memory = visit(optimizer_bits=8, fused_step=True)
    moments = 2 * (2 * (4096 + 4 * 16 + 1024)) + 2 * (2 * 2048 * 4) + 3 * (2 * (8192 + 4 * 32 + 1024)) + 2 * 512
    assert memory.optimizer == 36992 * 4 + moments  # fp32 masters + 8-bit moments (small tensors in fp32)
    assert memory.grads == 8192 * 4  # the largest tensor's fp32 gradient only


@pytest.mark.parametrize("dtype, rows, cols", [("nf4", 64, 128), ("nf4", 192, 576), ("int8", 32, 64),
                                               ("bf16", 32, 64)])
def test_frozen_bytes_are_what_the_codes_allocate(dtype, rows, cols):
    codes = encode(torch.randn(rows, cols, dtype=torch.bfloat16), dtype)
    inner = [getattr(c, name) for c in codes for name in c.__tensor_flatten__()[0]] if dtype == "nf4" else codes
    assert frozen_linear_bytes(rows, cols, dtype, 2) == sum(t.numel() * t.element_size() for t in inner)


@pytest.mark.parametrize("shape", [(64, 128), (10, 10)])
def test_moment_bytes_are_what_the_8bit_optimizer_allocates(shape):
    param = torch.nn.Parameter(torch.randn(shape))
    optimizer = low_bit_adam([param], "adam8bit", 1e-3, (0.9, 0.999), 0.0)
    param.sum().backward()
    optimizer.step()
    state = optimizer.state_dict()["state"][0]
    allocated = sum(v.numel() * v.element_size() for k, v in state.items() if torch.is_tensor(v) and k != "step")
    assert moment_bytes(param.numel(), 4) == allocated


def test_llama3_8b_size_and_refusals():
    m = shape_for_size("llama3-8b")
    assert (m.vocab, m.kv_heads, m.tied) == (128256, 8, False)
    assert m.total_params() == 8_030_261_248  # Meta-Llama-3-8B's parameter count
    with pytest.raises(UsageError, match="frozen dtype 'fp8' is not one of auto, bf16, int8, nf4"):
        visit(frozen_dtype="fp8")
    with pytest.raises(UsageError, match="has no --arch gpt2 shape"):
        shape_for_size("llama3-8b", "gpt2")
