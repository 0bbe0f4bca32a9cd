"""The planner's landscape expansion (`--expand`): the factors, their gradients, optimizer state and saved inputs
(lowrank) and the suffix's gradients (sgd), against the meter on real steps of `preinfer.expansion`'s own hooks,
per visit (worst for the lowest block, the largest suffix), and through `preinfer plan` and `--ufp auto`."""

import dataclasses
import json

import pytest
import torch

import preinfer
from pipelines.cli import main
from preinfer.errors import UsageError
from preinfer.expansion import LowRankExpansion, SgdExpansion
from preinfer.memory.budget import blocks_for_budget, budget_settings
from preinfer.memory.expansion import factor_tensors
from preinfer.memory.footprint import bcd_memory, best_fit, worst_bcd
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import resolve_shape, shape_for_size
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from tests.helpers.metered_visits import metered_peak, visit_optimizer


def _metered_visit(name: str, k: int, expand: str, optimizer_name: str, attention: str, rank: int = 8,
                   seq: int = 64, batch: int = 4) -> int:
    """The meter's tracked_peak over two live float32 steps of block k (of 3) with `expand`'s hook of
    `preinfer.expansion`: the hook's parameters stepped with the block's by `optimizer_name`, its after_step after each
    step, as the trainer's visit runs them."""
    model = build_preset(name, attention=attention).train()
    staged = preinfer.stage(model)
    span = partition(resolve_shape(name), 3)[k]
    block = make_partition(staged, num_blocks=3).blocks[k]
    model.requires_grad_(False)
    for param in block.params:
        param.requires_grad_(True)
    hook = LowRankExpansion(staged, rank, None) if expand == "lowrank" else SgdExpansion(staged, 1e-3)
    optimizer = visit_optimizer([*block.params, *hook.activate(block)], optimizer_name)
    peak = metered_peak(staged, span, optimizer, seq, batch, hook.after_step)
    hook.deactivate(block)
    return peak


@pytest.mark.parametrize("name, k, expand, optimizer, attention", [
    ("small-llama", 0, "lowrank", "adam", "sdpa"), ("small-llama", 0, "sgd", "adam", "sdpa"),
    ("small-llama", 1, "lowrank", "adamw8bit", "eager"), ("medium-llama", 0, "lowrank", "sgd", "sdpa"),
    ("medium-llama", 1, "sgd", "adamw8bit", "sdpa"), ("tiny-gpt2", 0, "lowrank", "adam", "sdpa"),
    ("tiny-gpt2", 1, "sgd", "adam", "eager"),
])
def test_the_meter_agrees_with_the_planner_within_2_percent_with_expansion(name, k, expand, optimizer, attention):
    shape = resolve_shape(name)
    settings = Settings(seq_len=64, micro_batch=4, dtype="float32", optimizer=optimizer, expand=expand,
                        attention=attention)
    planned = bcd_memory(shape, settings, partition(shape, 3), k, store=False)
    without = bcd_memory(shape, dataclasses.replace(settings, expand="none"), partition(shape, 3), k, store=False)
    metered = _metered_visit(name, k, expand, optimizer, attention)
    assert planned.held == pytest.approx(metered, rel=0.02)  # the meter sees tensors held, not the step's temporaries
    assert metered - without.held >= 0.5 * (planned.held - without.held) > 0  # the expansion's share is seen


def test_the_expansion_costs_most_for_the_lowest_block_and_nothing_for_the_head_s():
    shape = shape_for_size("7b")
    for expand in ("lowrank", "sgd"):
        settings = Settings(dtype="bf16-mixed", recompute=True, expand=expand)
        blocks = partition(shape, 4)
        added = [bcd_memory(shape, settings, blocks, k, store=False).total
                 - bcd_memory(shape, dataclasses.replace(settings, expand="none"), blocks, k, store=False).total
                 for k in range(4)]
        assert added[0] > added[1] > added[2] > added[3] == 0


def test_lowrank_factors_are_those_the_hook_makes():
    """Element counts of A and B per linear of each suffix layer, against the factors `LowRankExpansion` makes."""
    for name in ("small-llama", "tiny-gpt2"):
        staged = preinfer.stage(build_preset(name))
        block = make_partition(staged, num_blocks=3).blocks[0]
        made = LowRankExpansion(staged, 4, None).activate(block)
        assert [p.numel() for p in made] == factor_tensors(resolve_shape(name), 4, staged.num_layers - block.stop)
        assert all(p.dtype == torch.float32 for p in made)


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_takes_the_expand_flags_and_the_automatic_ufp_counts_them(capsys):
    flags = ["--model", "7b", "--dtype", "bf16-mixed", "--recompute", "--gpu-mem", "40"]
    today = plan_json(capsys, *flags, "--expand", "none")
    shape = shape_for_size("7b")
    for expand in ("lowrank", "sgd"):
        plan = plan_json(capsys, *flags, "--expand", expand, "--expand-rank", "16")
        assert (plan["settings"]["expand"], plan["settings"]["expand_rank"]) == (expand, 16)
        expected = Settings(dtype="bf16-mixed", recompute=True, expand=expand, expand_rank=16, gpu_mem_gb=40)
        worst = worst_bcd(shape, expected, partition(shape, 3), store=False)
        assert plan["memory"]["bcd_live"]["total"] == worst.total > today["memory"]["bcd_live"]["total"]
        assert plan["memory"]["full_adam"] == today["memory"]["full_adam"]
        fit = best_fit(shape, expected)
        assert (plan["auto"]["blocks"], plan["auto"]["separate_ends"]) == (fit.blocks, fit.separate_ends)
        budget = budget_settings(expected.capacity(), "bf16-mixed", 1024, 1, True, "sdpa", expand=expand,
                                 expand_rank=16)
        record = blocks_for_budget(shape, budget, "bf16-mixed")
        assert (record.blocks, record.separate_ends) == (fit.blocks, fit.separate_ends)
    assert best_fit(shape, expected).visits > today["auto"]["visits"]  # sgd's suffix gradients need more blocks
    assert main(["plan", *flags, "--expand", "lowrank"]) == 0
    assert "expand lowrank rank 8" in capsys.readouterr().out


def test_no_pipeline_is_offered_with_expansion_which_a_pipeline_does_not_run(capsys):
    flags = ["--model", "13b", "--dtype", "bf16-mixed", "--gpu-mem", "16"]
    assert plan_json(capsys, *flags)["auto"]["pipeline_degree"] > 1
    assert plan_json(capsys, *flags, "--expand", "lowrank")["auto"]["blocks"] is None
    budget = budget_settings(16 * 10**9, "bf16-mixed", 1024, 1, False, "sdpa", expand="lowrank")
    with pytest.raises(UsageError, match="nothing fits it, not even one layer per GPU in a pipeline"):
        blocks_for_budget(shape_for_size("13b"), budget, "bf16-mixed")


def test_an_expansion_the_planner_does_not_price_is_refused():
    with pytest.raises(UsageError, match="expand 'dense' is not one of auto, none, lowrank, sgd"):
        bcd_memory(resolve_shape("small-llama"), Settings(expand="dense"), partition(resolve_shape("small-llama"), 3),
                   0, store=False)
    moe = resolve_shape("tiny-moe")
    with pytest.raises(UsageError, match="--expand is priced for dense models only"):
        bcd_memory(moe, Settings(expand="sgd"), partition(moe, 2), 0, store=False)


def test_the_default_auto_is_priced_as_the_trainer_resolves_it(capsys):
    """auto: lowrank on a dense model in one GPU (under --frozen-dtype too: the factors sit beside the codes); none
    on a mixture of experts and on a pipeline (whose stages the trainer runs without expansion)."""
    flags = ["--model", "7b", "--dtype", "bf16-mixed", "--recompute", "--gpu-mem", "40"]
    default = plan_json(capsys, *flags)
    assert default["settings"]["expand"] == "lowrank"
    assert default["memory"] == plan_json(capsys, *flags, "--expand", "lowrank")["memory"]
    nf4 = plan_json(capsys, *flags, "--frozen-dtype", "nf4")
    assert nf4["settings"]["expand"] == "lowrank"
    assert nf4["memory"] == plan_json(capsys, *flags, "--frozen-dtype", "nf4", "--expand", "lowrank")["memory"]
    assert nf4["memory"] != plan_json(capsys, *flags, "--frozen-dtype", "nf4", "--expand", "none")["memory"]
    moe = resolve_shape("tiny-moe")
    assert bcd_memory(moe, Settings(), partition(moe, 2), 0, store=False) == \
        bcd_memory(moe, Settings(expand="none"), partition(moe, 2), 0, store=False)
    pipeline = ["--model", "13b", "--dtype", "bf16-mixed", "--gpu-mem", "16"]
    offered = plan_json(capsys, *pipeline)["auto"]
    assert offered == plan_json(capsys, *pipeline, "--expand", "none")["auto"] and offered["pipeline_degree"] > 1
