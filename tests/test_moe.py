"""Mixture-of-experts models: batch-invariant experts, the routers' load-balancing loss, partitions that know
experts. (Composition for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE is in test_staged.py; stores equal live
training for tiny-moe in test_from_store.py.)"""

import pytest
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

import preinfer
from preinfer.errors import UsageError
from preinfer.memory.meter import MemoryMeter
from preinfer.moe import ROW_INVARIANT, RouterLoss, sparse_blocks
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from preinfer.evaluation import evaluate
from tests.helpers.trainers import make_trainer, random_tokens, snapshot


class FixedBatch:
    """A batch source that yields one batch forever (enough for `VisitLifecycle.train_step` and `evaluate`)."""

    boundary = 0

    def __init__(self, batch: dict):
        self.batch = batch

    def __next__(self) -> dict:
        return self.batch

    def one_pass(self):
        return iter([self.batch])


def moe_batch(n=4) -> dict:
    data = random_tokens(n=n, t=16)
    return data[:n]


def test_a_tokens_expert_output_does_not_depend_on_its_batch():
    model = build_preset("tiny-moe").eval()
    preinfer.stage(model)
    assert model.config._experts_implementation == ROW_INVARIANT
    block = sparse_blocks(model.model.layers)[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen)
    with torch.no_grad():
        _, weights, experts = block.gate(x)
        whole = block.experts(x, experts, weights)
        for size in (1, 2, 3, 17, 150):
            rows = torch.randperm(300, generator=gen)[:size]
            assert torch.equal(block.experts(x[rows], experts[rows], weights[rows]), whole[rows]), size
        model.config._experts_implementation = "grouped_mm"
        framework = block.experts(x, experts, weights)
    assert (whole - framework).abs().max().item() <= 1e-6


def test_full_mode_loss_equals_the_frameworks_loss_with_router_logits():
    trainer = make_trainer("tiny-moe", blocks__blocks=1)
    block = trainer.partition.blocks[0]
    model, batch = trainer.staged.model, moe_batch()
    model.train()
    with torch.no_grad():
        expected = model(**batch, output_router_logits=True)
        lm_only = model(**batch).loss
    assert expected.aux_loss.item() > 0 and expected.loss.item() != lm_only.item()
    visit = trainer.lifecycle.activate(block, trainer.position)
    loss, _, _ = trainer.lifecycle.train_step(block, FixedBatch(batch), visit)
    assert loss == pytest.approx(expected.loss.item(), rel=1e-6, abs=1e-6)


def test_from_boundary_k_the_loss_balances_only_the_routers_above_k():
    model = build_preset("tiny-moe", seed=0).eval()
    staged = preinfer.stage(model)
    batch = moe_batch()
    router = RouterLoss(model, staged.layers)
    with torch.no_grad():
        logits = model(**batch, output_router_logits=True).router_logits  # sparse layers 1 and 3
        for start, used in [(0, logits), (2, logits[1:])]:
            with router.capture(start):
                out = staged.run(staged.embed(batch["input_ids"], batch["attention_mask"]), 0, staged.num_layers)
            expected = model.config.router_aux_loss_coef * load_balancing_loss_func(
                used, 8, 2, batch["attention_mask"])
            assert router.loss(out.attention_mask).item() == pytest.approx(expected.item(), rel=1e-6)
        with router.capture(4):
            staged.run(staged.embed(batch["input_ids"]), 0, staged.num_layers)
        assert router.loss(None) == 0.0


def test_with_recompute_the_routers_still_get_the_balancing_gradient():
    grads = []
    for recompute in (False, True):
        trainer = make_trainer("tiny-moe", blocks__blocks=1, run__recompute=recompute)
        block = trainer.partition.blocks[0]
        router = sparse_blocks(trainer.staged.layers)[3].gate.weight
        visit = trainer.lifecycle.activate(block, trainer.position)
        router_loss = trainer.layout.router_loss
        router_loss.coef = 1.0
        state = trainer.staged.embed(**{k: moe_batch()[k] for k in ("input_ids", "attention_mask")})
        with router_loss.capture(0):
            out = trainer.staged.run(state, 0, 4, recompute)
        router_loss.loss(out.attention_mask).backward()
        grads.append(router.grad.clone())
        visit.zero_grad()
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-9)


def test_eval_reports_the_language_model_loss_alone():
    model = build_preset("tiny-moe", seed=0)
    staged = preinfer.stage(model)
    batch = moe_batch()
    with torch.no_grad():
        expected = model(**batch).loss.item()
    assert evaluate(staged, FixedBatch(batch), torch.device("cpu")) == pytest.approx(expected, rel=1e-6)


def test_partitions_count_every_expert_and_report_the_active_parameters():
    model = build_preset("tiny-moe")
    staged = preinfer.stage(model)
    partition = make_partition(staged, num_blocks=2)
    experts = sum(p.numel() for b in sparse_blocks(staged.layers).values() for p in b.experts.parameters())
    assert partition.total_params == sum(p.numel() for p in model.parameters())
    assert partition.active_params == partition.total_params - experts + experts * 2 // 8
    assert sum(b.active_params for b in partition.blocks) == partition.active_params
    assert f"({partition.active_params:,} active per token)" in partition.report()
    dense = make_partition(preinfer.stage(build_preset("tiny-llama")), num_blocks=2)
    assert dense.active_params == dense.total_params and "active" not in dense.report()


def expert_trainer(**overrides):
    """Full mode with expert-granular training: only the chosen experts (no other part) of layers 1 and 3."""
    options = {"blocks__blocks": 1, "blocks__experts": "top:0.5", "blocks__experts_with": "none", **overrides}
    return make_trainer("tiny-moe", **options)


def fused_tensors(model):
    return {name: p for name, p in model.named_parameters() if p.dim() == 3}


def test_an_expert_granular_visit_changes_only_the_chosen_experts_slices():
    trainer = expert_trainer()
    model = trainer.staged.model
    before = snapshot(model)
    trainer.fit()
    chosen = trainer.position.experts["0"]
    assert set(chosen) == {"1", "3"} and all(0 < len(c) < 8 for c in chosen.values())
    fused = fused_tensors(model)
    for name, param in model.named_parameters():
        if name not in fused:
            assert torch.equal(param, before[name]), name
            continue
        layer = name.split(".")[2]
        for expert in range(8):
            same = torch.equal(param[expert], before[name][expert])
            assert same == (expert not in chosen[layer]), (name, expert)


def test_the_optimizer_state_is_the_chosen_slices():
    trainer = expert_trainer()
    block = trainer.partition.blocks[0]
    trainer.position.experts["0"] = {"1": [0, 5], "3": [2]}
    visit = trainer.lifecycle.activate(block, trainer.position)
    trainer.lifecycle.train_step(block, FixedBatch(moe_batch(8)), visit)
    optimizer = visit.optimizer
    slices = [p[e] for name, p in fused_tensors(trainer.staged.model).items()
              for e in ([0, 5] if ".1." in name else [2])]
    step_counters = 4 * len(slices)
    assert len(optimizer.state) == len(slices)
    assert MemoryMeter.optimizer_bytes(optimizer) == sum(2 * s.numel() * 4 for s in slices) + step_counters


def test_a_chosen_expert_that_gets_no_tokens_is_not_moved():
    trainer = expert_trainer(optim__grad_clip=1.0)
    block = trainer.partition.blocks[0]
    trainer.position.experts["0"] = {"1": [0, 1], "3": [0, 1]}
    visit = trainer.lifecycle.activate(block, trainer.position)
    optimizer = visit.optimizer
    batch = FixedBatch(moe_batch(8))
    trainer.lifecycle.train_step(block, batch, visit)  # both experts get tokens and momentum
    gate = sparse_blocks(trainer.staged.layers)[1].gate
    experts = sparse_blocks(trainer.staged.layers)[1].experts

    def starve_expert_0(module, args, output):
        logits, weights, chosen = output
        return logits, weights, torch.where(chosen == 0, torch.full_like(chosen, 7), chosen)

    handle = gate.register_forward_hook(starve_expert_0, prepend=True)
    leaf = next(leaf for fused, layer, expert, leaf in trainer.experts.leaves
                if fused is experts.gate_up_proj and expert == 0)
    moments = {k: v.clone() for k, v in optimizer.state[leaf].items()}
    before = experts.gate_up_proj.detach().clone()
    trainer.lifecycle.train_step(block, batch, visit)
    handle.remove()
    assert torch.equal(experts.gate_up_proj[0], before[0])
    assert all(torch.equal(optimizer.state[leaf][k], v) for k, v in moments.items())
    assert not torch.equal(experts.gate_up_proj[1], before[1])


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_under_mixed_precision_only_the_chosen_slices_train_and_each_is_its_master_cast_down(precision):
    trainer = expert_trainer(run__precision=precision)
    model = trainer.staged.model
    before = snapshot(model)
    block = trainer.partition.blocks[0]
    trainer.position.experts["0"] = {"1": [0, 5], "3": [2]}
    visit = trainer.lifecycle.activate(block, trainer.position)
    for _ in range(2):
        visit.set_rate(0)
        trainer.lifecycle.train_step(block, FixedBatch(moe_batch(8)), visit)
    leaves = {id(leaf) for *_, leaf in trainer.experts.leaves}
    stepped = [(param, master) for param, master in zip(visit.active.params, visit.active.masters)
               if id(param) in leaves]
    assert len(stepped) == 3 * 2 and all(m.dtype == torch.float32 for _, m in stepped)  # 3 experts, 2 tensors each
    assert all(torch.equal(param, master.to(param.dtype)) for param, master in stepped)
    for name, param in model.named_parameters():
        if name not in fused_tensors(model):
            assert torch.equal(param, before[name]), name
            continue
        chosen = [0, 5] if ".1." in name else [2]
        for expert in range(8):
            assert torch.equal(param[expert], before[name][expert]) == (expert not in chosen), (name, expert)


@pytest.mark.parametrize("expand", ["lowrank", "sgd"])
def test_expansion_beside_expert_granular_blocks_moves_only_the_suffix_and_the_chosen_experts(expand):
    """Block 0 (layers 0-1) trains its chosen experts of layer 1; the suffix (layers 2-3) gets the expansion: lowrank
    on its linear weights (a fused expert tensor is none), sgd on every weight it has a gradient for."""
    trainer = make_trainer("tiny-moe", blocks__blocks=2, blocks__experts="top:0.5", blocks__experts_with="none",
                           blocks__expand=expand, blocks__expand_lr=0.05)
    model = trainer.staged.model
    before = snapshot(model)
    block = trainer.partition.blocks[0]
    trainer.position.experts["0"] = {"1": [0, 5]}
    visit = trainer.lifecycle.activate(block, trainer.position)
    for _ in range(2):
        visit.set_rate(0)
        trainer.lifecycle.train_step(block, FixedBatch(moe_batch(8)), visit)
    trainer.lifecycle.deactivate(block, visit, trainer.position)
    moved = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    below = {name for name in moved if any(f".layers.{i}." in name for i in (0, 1)) or "embed" in name}
    assert {name for name in below if name not in fused_tensors(model)} == set()
    for name in fused_tensors(model):
        if ".layers.1." in name:
            assert [e for e in range(8) if not torch.equal(model.get_parameter(name)[e], before[name][e])] == [0, 5]
    suffix = moved - below
    assert any(".layers.3.self_attn." in name for name in suffix)
    assert any(".layers.3.mlp.experts." in name for name in suffix) == (expand == "sgd")
    assert not any("lm_head" in name or name.endswith("model.norm.weight") for name in moved)


def test_bad_expert_options_are_refused_in_one_line():
    with pytest.raises(UsageError, match=r"\[blocks\] experts = 'half': expected top:SHARE"):
        expert_trainer(blocks__experts="half")
    with pytest.raises(UsageError, match=r"\[blocks\] experts_with = 'router,mlp'"):
        expert_trainer(blocks__experts_with="router,mlp")
    with pytest.raises(UsageError, match="--experts needs a mixture-of-experts model"):
        make_trainer("tiny-llama", blocks__experts="top:0.5")
