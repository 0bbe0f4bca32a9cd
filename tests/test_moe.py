"""Mixture-of-experts models: batch-invariant experts, the routers' load-balancing loss, partitions that know
experts. (Composition for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE is in test_staged.py; stores equal live
training for tiny-moe in test_from_store.py.)"""

import pytest
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

import preinfer
from preinfer.moe import ROW_INVARIANT, RouterLoss, sparse_blocks
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from preinfer.trainer import evaluate
from test_trainer import make_trainer, random_tokens


class FixedBatch:
    """A batch source that yields one batch forever (enough for `Trainer._step` and `evaluate`)."""

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
    loss, _, _ = trainer._step(block, FixedBatch(batch), trainer._activate(block))
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
        optimizer = trainer._activate(block)
        trainer.router_loss.coef = 1.0
        state = trainer.staged.embed(**{k: moe_batch()[k] for k in ("input_ids", "attention_mask")})
        with trainer.router_loss.capture(0):
            out = trainer.staged.run(state, 0, 4, recompute)
        trainer.router_loss.loss(out.attention_mask).backward()
        grads.append(router.grad.clone())
        optimizer.zero_grad()
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
