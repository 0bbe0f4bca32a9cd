"""Frozen linear weights in bf16, int8 and nf4: boundary states and input gradients against the Hugging Face
model's own forward with the masters, and masters kept bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from preinfer.errors import UsageError
from preinfer.frozen_weights import FrozenWeight, FrozenWeights, decode, encode

# Relative Frobenius error of a boundary state after every layer is frozen in the dtype, for weights of std 0.02:
# bf16 rounds each weight by <= 2^-8 relatively, int8 by <= absmax(row) / 254, nf4 by <= 0.152 absmax(64-block).
STATE_ERROR = {"bf16": 0.01, "int8": 0.02, "nf4": 0.25}


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval()


def states(model, ids):
    return model(ids, output_hidden_states=True).hidden_states


def relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", ["bf16", "int8", "nf4"])
def test_quantized_layers_give_the_masters_boundary_states_within_the_dtypes_error(dtype):
    reference, model = tiny_llama(), tiny_llama()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    frozen = FrozenWeights(model.model.layers, dtype, "cpu")
    frozen.quantize(range(3))
    assert all(isinstance(m.weight, FrozenWeight) for m in model.model.layers[0].self_attn.children())
    with torch.no_grad():
        expected, got = states(reference, ids), states(model, ids)
    errors = [relative(g, e) for g, e in zip(got[1:], expected[1:])]
    assert max(errors) < STATE_ERROR[dtype]
    assert max(errors) > 0  # the codes are used: the masters' forward is not what runs


@pytest.mark.parametrize("dtype", ["bf16", "int8", "nf4"])
def test_f_linear_on_a_frozen_weight_is_torch_s_on_the_decoded_weight_saving_nothing_and_the_tree_is_unchanged(dtype):
    """Forward and input gradient equal torch's `F.linear` on the decoded weight, within the master's element
    bounds of its forward with the master; the weight takes no gradient, autograd saves no tensor of it, and the
    module tree (names and types) and the parameter names are what they were."""
    model = tiny_llama()
    tree, names = [(n, type(m)) for n, m in model.named_modules()], [n for n, _ in model.named_parameters()]
    FrozenWeights(model.model.layers, dtype, "cpu").quantize(range(3))
    assert [(n, type(m)) for n, m in model.named_modules()] == tree
    assert [n for n, _ in model.named_parameters()] == names
    linear = model.model.layers[1].mlp.down_proj
    master = linear.weight.detach().clone()
    weight = decode(encode(master, dtype), dtype, torch.float32)
    x = torch.randn(2, 5, master.shape[1], generator=torch.Generator().manual_seed(4), requires_grad=True)
    reference = x.detach().clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear(x)
    expected = F.linear(reference, weight)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-7)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    y.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, reference.grad, rtol=1e-6, atol=1e-7)
    assert saved == [] and linear.weight.grad is None
    bound = torch.broadcast_to(ELEMENT_BOUND[dtype](master), master.shape)
    assert bool(((weight - master).abs() <= bound * (1 + 1e-6)).all())
    exact = F.linear(x.detach(), master)
    assert bool(((y.detach() - exact).abs() <= x.detach().abs() @ bound.t() * (1 + 1e-5) + 1e-6).all())


def _nf4_bound(w: torch.Tensor) -> torch.Tensor:
    """0.152 absmax(64-block) plus 1/254 of the scaler block's largest centred absmax (one scaler block here)."""
    absmax = w.reshape(-1, 64).abs().amax(1, keepdim=True)
    assert absmax.numel() <= 256
    return (0.152 * absmax + (absmax - absmax.mean()).abs().max() / 254).expand(-1, 64).reshape(w.shape)


# The documented element bound of a weight's codes, as a tensor broadcasting to the weight.
ELEMENT_BOUND = {"bf16": lambda w: w.abs() * 2**-8, "int8": lambda w: w.abs().amax(1, keepdim=True) / 254,
                 "nf4": _nf4_bound}


def test_element_errors_are_the_documented_bounds():
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * 0.02
    int8 = decode(encode(weight, "int8"), "int8", torch.float32)
    assert bool(((int8 - weight).abs() <= weight.abs().amax(1, keepdim=True) / 254 * (1 + 1e-6)).all())
    bf16 = decode(encode(weight, "bf16"), "bf16", torch.float32)
    assert bool(((bf16 - weight).abs() <= weight.abs() * 2**-8).all())
    nf4 = decode(encode(weight, "nf4"), "nf4", torch.float32)
    blocks, err = weight.reshape(-1, 64), (nf4 - weight).reshape(-1, 64).abs()
    absmax = blocks.abs().amax(1, keepdim=True)
    scaler_error = (absmax - absmax.mean()).abs().max() / 254
    assert bool((err <= 0.152 * absmax + scaler_error).all())


@pytest.mark.parametrize("dtype", ["int8", "nf4"])
def test_quantize_restore_gives_the_masters_back_bit_for_bit_and_codes_come_from_masters(dtype):
    model = tiny_llama()
    original = copy.deepcopy(model.state_dict())
    frozen = FrozenWeights(model.model.layers, dtype, "cpu")
    frozen.quantize([0, 1, 2])
    first = [c.clone() for c in _codes(model.model.layers[1].mlp.down_proj)]
    held = model.state_dict()["model.layers.1.mlp.down_proj.weight"]  # a state dict holds the master, never codes
    assert held.device.type == "cpu" and torch.equal(held, original["model.layers.1.mlp.down_proj.weight"])
    assert not any(k.endswith("code0") for k in model.state_dict())
    frozen.restore([1])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in original.items() if k.startswith("model.layers.1."))
    frozen.quantize([1])
    frozen.quantize([1])  # already quantized: kept, not coded again
    second = _codes(model.model.layers[1].mlp.down_proj)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    frozen.restore([0, 1, 2])
    assert set(model.state_dict()) == set(original)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in original.items())
    masters = frozen.masters()
    assert torch.equal(masters["2.self_attn.k_proj.weight"], original["model.layers.2.self_attn.k_proj.weight"])


def test_a_restored_layers_trained_weight_becomes_its_master():
    model = tiny_llama()
    frozen = FrozenWeights(model.model.layers, "int8", "cpu")
    frozen.quantize([0, 2])
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.add_(1.0)
    trained = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    assert torch.equal(frozen.masters()["1.mlp.up_proj.weight"], trained)
    frozen.quantize([1])
    frozen.restore([1])
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, trained)


def test_on_the_cpu_a_master_is_the_loaded_weight_itself_never_a_second_copy():
    model = tiny_llama()
    linears = {path: m for path, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    loaded = {f"{path}.weight": m.weight.data_ptr() for path, m in linears.items()}
    frozen = FrozenWeights(model.model.layers, "nf4", "cpu")
    frozen.quantize([0, 1, 2])
    assert {name: t.data_ptr() for name, t in frozen.masters().items()} == loaded
    frozen.restore([1])
    up = model.model.layers[1].mlp.up_proj.weight
    assert up.data_ptr() == loaded["1.mlp.up_proj.weight"]  # the restored layer trains its master in place
    with torch.no_grad():
        up.add_(1.0)
    frozen.quantize([1])
    assert torch.equal(frozen.masters()["1.mlp.up_proj.weight"], up.detach())
    assert {name: t.data_ptr() for name, t in frozen.masters().items()} == loaded


@pytest.mark.parametrize("dtype", ["bf16", "int8", "nf4"])
def test_input_gradients_flow_through_quantized_layers_to_a_trainable_layer_below(dtype):
    reference, model = tiny_llama(), tiny_llama()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    for m in (reference, model):
        m.requires_grad_(False)
        m.model.layers[0].requires_grad_(True)
    frozen = FrozenWeights(model.model.layers, dtype, "cpu")
    frozen.quantize([1, 2])
    for m in (reference, model):
        m(ids, labels=ids).loss.backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.model.layers[0].parameters(), reference.model.layers[0].parameters())]
    assert all(g is not None for g, _ in grads)
    assert max(relative(g, e) for g, e in grads) < STATE_ERROR[dtype]
    assert all(not b.requires_grad for b in model.model.layers[1].buffers())


def test_nf4_refuses_a_weight_it_cannot_block_in_one_line():
    layer = torch.nn.Sequential(torch.nn.Linear(10, 3))
    with pytest.raises(UsageError, match="divisible by 64.*use int8"):
        FrozenWeights([layer], "nf4", "cpu")


def test_a_missing_torchao_is_refused_in_one_line(monkeypatch):
    import importlib

    real = importlib.import_module

    def without_torchao(name, *args):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_torchao)
    with pytest.raises(UsageError, match=r"^frozen dtype nf4 needs torchao.*pip install preinfer\[quant\]$"):
        FrozenWeights(tiny_llama().model.layers, "nf4", "cpu")


def _codes(module):
    assert isinstance(module.weight, FrozenWeight)
    codes = module.weight.codes
    return [c.get_original_weight() if type(c).__name__ == "NF4Tensor" else c for c in codes]
