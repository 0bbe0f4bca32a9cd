"""Landscape expansion on layers held in fewer bits (`--frozen-dtype` with `--expand`): the factors sit beside the
codes, the merged update is the dense update B A added to the layer's master (invariant 18), the codes are built
again from that master only, the sgd step writes the master, and a visit leaves every layer below its block bit for
bit as it was, in the export too (which holds masters only)."""

import pytest
import torch
from safetensors.torch import load_file

import preinfer
from preinfer import frozen_weights
from preinfer.expansion import LowRankExpansion, linear_weights
from preinfer.frozen_weights import FrozenWeight, QuantizedFrozenLayers, decode, encode
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from tests.helpers.trainers import assert_resumes_as, live_batches, make_trainer, snapshot
from tests.helpers.training_runs import assert_close


def decoded(codes, dtype: str) -> torch.Tensor:
    return decode(codes, dtype, torch.float32)


class EncodeSpy:
    """Records what every encode call was given, then encodes it."""

    def __init__(self):
        self.inputs: list[torch.Tensor] = []

    def __call__(self, weight: torch.Tensor, dtype: str):
        self.inputs.append(weight)
        return encode(weight, dtype)


@pytest.mark.parametrize("dtype", ["int8", "nf4"])
def test_the_merge_adds_b_a_to_each_master_and_its_codes_are_built_from_that_master_only(dtype, monkeypatch):
    staged = preinfer.stage(build_preset("tiny-llama", seed=0))
    tree = [(name, type(m)) for name, m in staged.model.named_modules()]
    block = make_partition(staged, num_blocks=3).blocks[0]
    frozen = QuantizedFrozenLayers(staged, dtype, "cpu")
    frozen.activate(block)
    expansion = LowRankExpansion(staged, rank=4, lr=None)
    factors = expansion.activate(block)
    modules = [module for module, _ in linear_weights(list(staged.layers[block.stop:]))]
    assert modules and all(isinstance(m.weight, FrozenWeight) for m in modules)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in factors[1::2]:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    before = snapshot(staged.model)
    expected = {id(m.weight): m.weight.detach().float() + b.detach() @ a.detach()
                for m, a, b in zip(modules, factors[0::2], factors[1::2])}
    spy = EncodeSpy()
    monkeypatch.setattr(frozen_weights, "encode", spy)
    expansion.deactivate(block)
    frozen.deactivate(block)
    masters = {t.data_ptr(): t for t in frozen.weights.masters().values()}
    assert len(spy.inputs) == len(modules) + sum(len(found) for found in frozen.weights.linears[:block.stop])
    assert all(t.data_ptr() in masters and torch.equal(t, masters[t.data_ptr()]) for t in spy.inputs)
    for module in modules:
        assert isinstance(module.weight, FrozenWeight) and not module._forward_hooks
        assert torch.equal(module.weight.detach(), expected[id(module.weight)])  # fp32: the update, bit for bit
        rebuilt = decoded(encode(module.weight.detach(), dtype), dtype)
        assert torch.equal(decoded(module.weight.codes, dtype), rebuilt)
    suffix = {name for name, p in staged.model.named_parameters() if id(p) in expected}
    assert suffix and all(torch.equal(p, before[name]) for name, p in staged.model.named_parameters()
                          if name not in suffix)
    assert [(name, type(m)) for name, m in staged.model.named_modules()] == tree


@pytest.mark.parametrize("dtype,expand", [("int8", "lowrank"), ("nf4", "lowrank"), ("int8", "sgd")])
def test_a_visit_expanding_codes_trains_the_suffix_masters_and_the_export_keeps_the_rest_bit_for_bit(
        tmp_path, dtype, expand):
    """The middle block's visit: its suffix's masters moved, every layer below it, the embedding and the head
    exported bit for bit as loaded; the export's names are the model's own, no codes."""
    original = snapshot(build_preset("tiny-llama", seed=0))
    trainer = make_trainer(model__frozen_dtype=dtype, blocks__expand=expand, blocks__expand_lr=0.05)
    staged, block = trainer.staged, trainer.partition.blocks[1]
    visit = trainer.lifecycle.activate(block, trainer.position, trainer.visit_sources.train)
    losses = [trainer.lifecycle.train_step(block, trainer.visit_sources.train, visit)[0] for _ in range(3)]
    trainer.lifecycle.deactivate(block, visit, trainer.position)
    assert losses[-1] < losses[0]
    staged.model.save_pretrained(tmp_path / "export")
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) <= set(original) and not any("code" in k for k in exported)
    layer = staged.model.model.layers
    inside = {f"model.layers.{i}." for i in range(block.start, len(layer))}
    untouched = [k for k in exported if not any(k.startswith(p) for p in inside)]
    assert untouched and all(torch.equal(exported[k], original[k]) for k in untouched)
    suffix = [k for k in exported if k.startswith(f"model.layers.{block.stop}.") and k.endswith("proj.weight")]
    assert suffix and all(not torch.equal(exported[k], original[k]) for k in suffix)
    for module, _ in linear_weights(list(staged.layers[block.stop:])):
        assert torch.equal(decoded(module.weight.codes, dtype), decoded(encode(module.weight.detach(), dtype), dtype))


def test_an_sgd_step_on_codes_is_w_minus_lr_g_on_the_master_with_g_torch_s_gradient_through_the_decoded_weight():
    """One step of block 0 with --expand sgd over int8 codes: every suffix master is w - lr g, g the gradient torch's
    autograd gives the framework's loss of the model whose frozen layers hold their decoded weights (relative 1e-6
    of w); the suffix's codes are then those of the new masters."""
    lr, dtype = 0.5, "int8"
    trainer = make_trainer(blocks__expand="sgd", blocks__expand_lr=lr, stop__total_steps=1, model__frozen_dtype=dtype)
    block = trainer.partition.blocks[0]
    reference = build_preset("tiny-llama", seed=0)
    layers = preinfer.stage(reference).layers
    masters = {}
    with torch.no_grad():
        for layer in layers[block.stop:]:
            for module, _ in linear_weights([layer]):
                masters[id(module.weight)] = module.weight.detach().clone()
                module.weight.copy_(decoded(encode(module.weight, dtype), dtype))
    batch = live_batches(1)[0]
    loss = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss
    suffix = [(name, p) for layer in layers[block.stop:] for name, p in layer.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in suffix])
    trainer.fit()
    trained = [p for layer in trainer.staged.layers[block.stop:] for p in layer.parameters()]
    assert sum(isinstance(p, FrozenWeight) for p in trained) == len(masters)
    for (name, start), grad, now in zip(suffix, grads, trained):
        expected = masters.get(id(start), start.detach()) - lr * grad
        assert (now.detach() - expected).norm() <= 1e-6 * expected.norm(), name
        assert now.grad is None and not now.requires_grad
        if isinstance(now, FrozenWeight):
            assert torch.equal(decoded(now.codes, dtype), decoded(encode(now.detach(), dtype), dtype))


@pytest.mark.parametrize("dtype,expand,precision", [("int8", "lowrank", "fp32"), ("nf4", "lowrank", "bf16-mixed"),
                                                    ("int8", "sgd", "fp32")])
def test_resume_mid_visit_with_codes_and_expansion_is_bit_identical(tmp_path, dtype, expand, precision):
    overrides = dict(blocks__sweeps=2, optim__warmup_steps=2, optim__decay="cosine", stop__steps_per_visit=4,
                     run__precision=precision, model__frozen_dtype=dtype, blocks__expand=expand,
                     blocks__expand_lr=0.05 if expand == "sgd" else None)
    reference = make_trainer(run_dir=tmp_path / "a", **overrides)
    halted = make_trainer(run_dir=tmp_path / "b", **overrides)
    reference.fit()
    halted.fit(max_total_steps=2)  # mid-visit: block 0, step 2 of 4, the suffix's codes expanded
    assert_resumes_as(reference, tmp_path / "b", **overrides)


@pytest.mark.parametrize("dtype,expand,change", [("int8", "lowrank", dict(run__recompute=True)),
                                                 ("nf4", "sgd", dict(run__recompute=True)),
                                                 ("int8", "lowrank", dict(optim__fused_step=True))])
def test_recompute_and_the_fused_step_train_codes_and_their_expansion_as_without(dtype, expand, change):
    """Each layer run again in backward (`--recompute`) decodes its codes and runs its factors again; the fused step
    steps the block inside backward: the same weights (relative 1e-5) as the plain run."""
    trained = []
    for extra in ({}, change):
        trainer = make_trainer(model__frozen_dtype=dtype, blocks__expand=expand, blocks__expand_lr=0.05, **extra)
        trainer.fit()
        trained.append(snapshot(trainer.staged.model))
    assert_close(trained[1], trained[0])
