"""`--ufp auto --memory-budget SIZE`: the planner's fewest blocks under a budget, its record and lines, the
measured peaks against the budget, and refusals (exit 2, nothing written)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import preinfer
from pipelines.training import partition_for
from preinfer.errors import UsageError
from preinfer.memory.budget import budget_settings, blocks_for_budget
from preinfer.config import load_config
from preinfer.memory.footprint import auto_choice, bcd_memory, best_fit, fewest_blocks, worst_bcd
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import resolve_shape, shape_for_size
from preinfer.metrics import parse_record
from preinfer.presets import build_preset
from preinfer.sizes import parse_size
from tests.helpers.cli_run import run_cli

SEQ, BATCH = 32, 4
TINY = ["--model", "tiny-llama", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--steps-per-visit", "2",
        "--eval-tokens", "128", "--lr", "1e-3", "--pre-inference", "off"]


def peaks(blocks: int, **changes) -> int:
    """The planner's worst live visit of tiny-llama in `blocks` blocks at the test's sequence and batch."""
    shape = resolve_shape("tiny-llama")
    settings = replace(Settings(seq_len=SEQ, micro_batch=BATCH), **changes)
    return worst_bcd(shape, settings, partition(shape, blocks), store=False).total


def budget_between(blocks: int) -> int:
    """A budget half way between the worst visit with `blocks` blocks and with one block fewer."""
    return (peaks(blocks) + peaks(blocks - 1)) // 2


@pytest.mark.parametrize("text, expected", [
    ("22GiB", 22 * 2**30), ("512MiB", 512 * 2**20), ("1.5e9", 1_500_000_000), ("24GB", 24 * 10**9),
    ("1 KiB", 1024), ("0.5gib", 2**29), ("1_000", 1000), ("4096", 4096), ("2TB", 2 * 10**12),
])
def test_sizes_parse_in_decimal_and_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["22GiBs", "lots", "-1GiB", "0", "0.1", "", "1e9e9", "GiB", "12 GiB 3", "_"])
def test_malformed_sizes_are_refused(text):
    with pytest.raises(UsageError, match="expected"):
        parse_size(text)


def test_the_plan_is_the_planners_fewest_blocks():
    shape = resolve_shape("tiny-llama")
    assert peaks(3) < peaks(2) < peaks(1)
    for blocks in (2, 3):
        settings = budget_settings(budget_between(blocks), "fp32", SEQ, BATCH, recompute=False, attention="sdpa")
        plan = blocks_for_budget(shape, settings, "fp32")
        chosen = partition(shape, blocks)
        assert plan.blocks == blocks == fewest_blocks(shape, settings)[0] == auto_choice(shape, settings)["blocks"]
        assert plan.predicted == [bcd_memory(shape, settings, chosen, k, store=False).total for k in range(blocks)]
        assert max(plan.predicted) <= plan.budget < peaks(blocks - 1)


def test_precision_and_recompute_change_the_plan():
    shape = shape_for_size("7b")
    settings = budget_settings(40 * 2**30, "bf16-mixed", 1024, 1, recompute=False, attention="eager", expand="none")
    assert settings.dtype == "bf16-mixed"
    bf16 = blocks_for_budget(shape, settings, "bf16-mixed")
    recompute = blocks_for_budget(shape, replace(settings, recompute=True), "bf16-mixed")
    assert recompute.blocks < bf16.blocks and max(recompute.predicted) <= recompute.budget
    with pytest.raises(preinfer.UsageError, match="fp32"):
        budget_settings(2**30, "fp8", 1024, 1, recompute=False, attention="sdpa")


def test_partition_for_builds_the_planners_blocks():
    staged = preinfer.stage(build_preset("tiny-llama"))
    budget = budget_between(3)
    config = load_config(overrides={"blocks": {"ufp": "auto", "memory_budget": f"{budget}"},
                                    "data": {"seq_len": SEQ, "batch_size": BATCH}})
    chosen, active = partition_for(staged, config)
    expected = partition(resolve_shape("tiny-llama"), 3)
    assert active is None and chosen.budget.blocks == 3 and chosen.budget.budget == budget
    assert [(b.start, b.stop, b.has_embed, b.has_head) for b in chosen.blocks] == \
        [(b.start, b.stop, b.embed, b.head) for b in expected]


def test_auto_run_logs_the_plan_and_every_visit_is_under_the_budget(tmp_path, capsys):
    budget = budget_between(3)
    out = tmp_path / "run"
    code, stdout, err = run_cli(["bcd", *TINY, "--out", str(out), "--ufp", "auto", "--memory-budget", str(budget)],
                                capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan = next(r for r in records if r["kind"] == "budget_plan")
    shape = resolve_shape("tiny-llama")
    settings = budget_settings(budget, "fp32", SEQ, BATCH, recompute=False, attention="sdpa")
    assert plan["blocks"] == fewest_blocks(shape, settings)[0] == 3
    assert plan["budget"] == budget
    visits = [r for r in records if r["kind"] == "visit"]
    assert [v["block"] for v in visits] == [0, 1, 2]
    for k, (visit, predicted) in enumerate(zip(visits, plan["predicted"])):
        memory = bcd_memory(shape, settings, partition(shape, 3), k, store=False)
        assert visit["memory"]["tracked_peak"] <= budget and predicted == memory.total
        assert visit["memory"]["tracked_peak"] == pytest.approx(memory.held, rel=0.15)  # the meter sees no `step`
    assert "memory budget" in err + stdout and "3 blocks (UFP 1/3)" in err + stdout
    assert (err + stdout).count(f"of the {budget / 2**20:.2f} MiB budget)") == 3 and "OVER" not in err + stdout
    resumed, _ = partition_for(preinfer.stage(build_preset("tiny-llama")), load_config(out / "config.toml"))
    assert resumed.budget == parse_record(plan)  # --resume plans the same blocks from the run's config.toml


def test_gpu_takes_the_planners_usable_memory(tmp_path, capsys):
    staged = preinfer.stage(build_preset("tiny-llama"))
    config = load_config(overrides={"blocks": {"ufp": "auto", "gpu": "4090"}})
    chosen, _ = partition_for(staged, config)
    assert chosen.budget.budget == Settings(gpu="4090").capacity() and chosen.budget.blocks == 1


def bad_toml(tmp_path) -> str:
    path = tmp_path / "bad.toml"
    path.write_text('[blocks]\nufp = "auto"\nmemory_budget = "a lot"\n')
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["--ufp", "auto", "--memory-budget", "1MiB"], "even one layer per block needs"),
    (["--ufp", "auto", "--memory-budget", "22GiBs"], "--memory-budget"),
    (["--ufp", "auto", "--memory-budget", "-3"], "--memory-budget"),
    (["--ufp", "auto"], "exactly one of --memory-budget and --gpu"),
    (["--ufp", "auto", "--memory-budget", "1GiB", "--gpu", "4090"], "exactly one"),
    (["--ufp", "1/3", "--memory-budget", "1GiB"], "--ufp auto"),
    (["--ufp", "auto", "--gpu", "h100"], "--gpu"),
    (["--config", "TOML"], "[blocks] memory_budget"),
])
def test_impossible_or_malformed_budgets_exit_2_in_one_line_and_write_nothing(argv, message, tmp_path, capsys):
    argv = [bad_toml(tmp_path) if a == "TOML" else a for a in argv]
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *TINY, "--out", str(out), *argv], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_nothing_fits_names_recompute_a_smaller_batch_and_the_pipeline_degree():
    shape = resolve_shape("tiny-llama")
    budget = (peaks(shape.layers, recompute=True) + peaks(shape.layers)) // 2
    settings = budget_settings(budget, "fp32", SEQ, BATCH, recompute=False, attention="sdpa")
    assert fewest_blocks(shape, settings) is None
    with pytest.raises(preinfer.UsageError) as refused:
        blocks_for_budget(shape, settings, "fp32")
    message = str(refused.value)
    assert "even one layer per block needs" in message and "\n" not in message
    recompute = fewest_blocks(shape, replace(settings, recompute=True))
    assert f"--recompute ({recompute[0]} blocks" in message
    smaller = next(batch for batch in range(BATCH - 1, 0, -1) if best_fit(shape, replace(settings, micro_batch=batch)))
    found = best_fit(shape, replace(settings, micro_batch=smaller))  # the largest batch that fits, ends placed
    assert f"--batch-size {smaller} ({found.blocks} blocks{' + the embedding' if found.separate_ends else ''}" in message
    seven = budget_settings(int(24e9 * 0.9), "fp32", 1024, 1, recompute=False, attention="sdpa")
    message = str(pytest.raises(preinfer.UsageError, blocks_for_budget, shape_for_size("7b"), seven, "fp32").value)
    degree = auto_choice(shape_for_size("7b"), seven)["pipeline_degree"]
    assert degree > 1 and f"a pipeline of {degree} GPUs" in message
