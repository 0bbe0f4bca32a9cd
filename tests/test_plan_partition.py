"""The automatic partition (`--ufp auto`, and `preinfer plan`'s choice): the ends' placement chosen by what fits
and makes the fewest visits, with `--separate-ends` too; the Llama-3-8B plan on one 12 GiB card; each pipeline
stage priced as its own card; the run line the plan prints, run as printed; and a table whose figures stay apart
however large they are."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import replace

import pytest

import preinfer
from pipelines.training import partition_for
from preinfer.config import load_config
from preinfer.memory.budget import blocks_for_budget, budget_settings
from preinfer.memory.footprint import bcd_memory, best_fit, fewest_blocks, stage_bytes, visit_peaks, worst_bcd
from preinfer.memory.layer_spans import LayerSpan, partition
from preinfer.memory.settings import GIB, Settings
from preinfer.memory.shapes import resolve_shape
from preinfer.memory.stage_cut import cut_stages, stage_cost, stage_label
from preinfer.presets import build_preset
from tests.helpers.cli_run import run_cli

SEQ, BATCH = 32, 4
TINY = ["--model", "tiny-llama", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--steps-per-visit", "2",
        "--eval-tokens", "128", "--lr", "1e-3", "--pre-inference", "off"]
SAVERS = ["--dtype", "bf16-mixed", "--recompute", "--frozen-dtype", "nf4", "--optimizer", "adamw8bit",
          "--fused-step"]


def worst(blocks: int, separate_ends: bool, settings: Settings | None = None) -> int:
    """The planner's worst live visit of tiny-llama in `blocks` blocks of layers, the ends apart or inside."""
    shape = resolve_shape("tiny-llama")
    settings = settings or Settings(seq_len=SEQ, micro_batch=BATCH)
    return worst_bcd(shape, settings, partition(shape, blocks, separate_ends), store=False).total


def fp32_budget(budget: int, separate_ends: bool = False) -> Settings:
    return budget_settings(budget, "fp32", SEQ, BATCH, recompute=False, attention="sdpa", separate_ends=separate_ends)


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(["plan", *argv, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def test_the_ends_go_apart_where_only_that_fits():
    shape, layers = resolve_shape("tiny-llama"), resolve_shape("tiny-llama").layers
    assert worst(layers, True) < worst(layers, False)  # one layer a block: the embedding's visit without layer 0
    budget = (worst(layers, True) + worst(layers, False)) // 2
    settings = fp32_budget(budget)
    assert fewest_blocks(shape, settings) is None  # the ends inside: nothing fits one card
    blocks, peak = fewest_blocks(shape, replace(settings, separate_ends=True))
    fit = best_fit(shape, settings)
    assert (fit.blocks, fit.separate_ends, fit.peak, fit.visits) == (blocks, True, peak, blocks + 2)
    record = blocks_for_budget(shape, settings, "fp32")
    assert (record.blocks, record.separate_ends) == (blocks, True)
    assert record.predicted == [bcd_memory(shape, settings, partition(shape, blocks, True), k, store=False).total
                                for k in range(blocks + 2)]
    assert max(record.predicted) <= budget


def test_the_ends_stay_inside_where_that_makes_fewer_visits():
    shape = resolve_shape("tiny-llama")
    budget = (worst(2, False) + worst(1, True)) // 2  # two blocks with the ends fit; the ends apart need 4 visits
    assert worst(2, False) <= budget < worst(1, True)
    settings = fp32_budget(budget)
    apart = fewest_blocks(shape, replace(settings, separate_ends=True))
    fit = best_fit(shape, settings)
    assert (fit.blocks, fit.separate_ends, fit.visits) == (2, False, 2)
    assert apart is not None and apart[0] + 2 > fit.visits  # the ends apart fit too, in more visits
    record = blocks_for_budget(shape, settings, "fp32")
    assert (record.blocks, record.separate_ends, len(record.predicted)) == (2, False, 2)


def test_separate_ends_fixes_the_ends_apart_and_auto_chooses_the_blocks():
    shape = resolve_shape("tiny-llama")
    budget = (worst(2, False) + worst(1, True)) // 2
    record = blocks_for_budget(shape, fp32_budget(budget, separate_ends=True), "fp32")
    assert record.separate_ends and record.blocks == fewest_blocks(shape, fp32_budget(budget, True))[0]


def test_bcd_ufp_auto_trains_the_ends_placement_the_planner_chose(tmp_path):
    layers = resolve_shape("tiny-llama").layers
    budget = (worst(layers, True) + worst(layers, False)) // 2
    staged = preinfer.stage(build_preset("tiny-llama"))
    config = load_config(overrides={"blocks": {"ufp": "auto", "memory_budget": f"{budget}"},
                                    "data": {"seq_len": SEQ, "batch_size": BATCH}})
    chosen, _ = partition_for(staged, config)
    expected = partition(resolve_shape("tiny-llama"), chosen.budget.blocks, separate_ends=True)
    assert chosen.budget.separate_ends
    assert [(b.start, b.stop, b.has_embed, b.has_head) for b in chosen.blocks] == \
        [(b.start, b.stop, b.embed, b.head) for b in expected]


def test_ufp_auto_with_separate_ends_runs_and_records_the_placement(tmp_path, capsys):
    budget = (worst(2, False) + worst(1, True)) // 2
    out = tmp_path / "run"
    code, stdout, err = run_cli(["bcd", *TINY, "--out", str(out), "--ufp", "auto", "--memory-budget", str(budget),
                                 "--separate-ends"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan = next(r for r in records if r["kind"] == "budget_plan")
    blocks = fewest_blocks(resolve_shape("tiny-llama"), fp32_budget(budget, True))[0]
    assert (plan["blocks"], plan["separate_ends"], len(plan["predicted"])) == (blocks, True, blocks + 2)
    assert [r["block"] for r in records if r["kind"] == "visit"] == list(range(blocks + 2))
    assert "+ the embedding and head blocks" in stdout + err


def test_llama3_8b_under_12_gib_with_the_savers_plans_one_card_every_visit_within_it(capsys):
    plan = plan_json(capsys, "--model", "llama3-8b", "--memory-budget", "12GiB", *SAVERS)
    auto, budget = plan["auto"], 12 * GIB
    assert auto["pipeline_degree"] == 1 and auto["separate_ends"] is True
    assert len(auto["predicted"]) == auto["visits"] == auto["blocks"] + 2
    assert max(auto["predicted"]) == auto["per_gpu_bytes"] <= budget
    shape = resolve_shape("llama3-8b")
    settings = Settings(budget_bytes=budget, dtype="bf16-mixed", recompute=True, frozen_dtype="nf4",
                        optimizer="adamw8bit", fused_step=True)
    assert fewest_blocks(shape, settings) is None  # with the embedding in block 0 no partition fits 12 GiB
    assert auto["predicted"] == visit_peaks(shape, settings, partition(shape, auto["blocks"], True))
    code, out, _ = run_cli(["plan", "--model", "llama3-8b", "--memory-budget", "12GiB", *SAVERS], capsys)
    line = next(line for line in out.splitlines() if line.startswith("run it: "))
    assert line.startswith("run it: preinfer bcd ") and f"--blocks {auto['blocks']} --separate-ends" in line
    assert all(flag in line for flag in ("--frozen-dtype nf4", "--optimizer adamw8bit", "--fused-step",
                                         "--recompute", "--precision bf16-mixed"))


def test_the_run_line_of_the_plan_runs_as_printed(tmp_path, capsys):
    shape = resolve_shape("tiny-llama")
    savers = Settings(seq_len=SEQ, micro_batch=BATCH, dtype="bf16-mixed", recompute=True, frozen_dtype="nf4",
                      optimizer="adamw8bit", fused_step=True)
    budget = (worst(shape.layers, True, savers) + worst(shape.layers, False, savers)) // 2
    argv = ["plan", "--model", "tiny-llama", "--seq-len", str(SEQ), "--micro-batch", str(BATCH), "--memory-budget",
            str(budget), *SAVERS]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("run it: ")).removeprefix("run it: ")
    words = shlex.split(line)
    assert words[:2] == ["preinfer", "bcd"] and "--separate-ends" in words and "--pipeline" not in words
    run = tmp_path / "run"
    code, _, err = run_cli([*words[1:], "--out", str(run), "--total-steps", "2", "--max-samples", "64",
                            "--eval-tokens", "128"], capsys)
    assert code == 0, err
    records = [json.loads(text) for text in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and all(math.isfinite(step["loss"]) for step in steps)  # it trained


def test_a_pipeline_prices_each_stage_as_its_own_card(capsys):
    argv = ["--model", "llama3-8b", *SAVERS, "--blocks", "32", "--separate-ends"]
    one, four = plan_json(capsys, *argv), plan_json(capsys, *argv, "--pipeline", "4")
    shape, stages = resolve_shape("llama3-8b"), four["stages"]
    settings = Settings(dtype="bf16-mixed", recompute=True, frozen_dtype="nf4", optimizer="adamw8bit",
                        fused_step=True, blocks=32, separate_ends=True, pipeline=4)
    cut = cut_stages(shape, settings, 4, partition(shape, 32, True), 4)
    assert [(s["start"], s["stop"], s["embed"], s["head"], s["label"]) for s in stages] == \
        [(s.start, s.stop, s.embed, s.head, stage_label(s)) for s in cut]
    live = four["memory"]["bcd_live"]
    assert live["total"] == max(stage["peak_bytes"] for stage in stages)
    worst_stage = next(stage for stage in stages if live["note"].startswith(f"stage {stages.index(stage)} "))
    ends = shape.embed_params() * worst_stage["embed"] + shape.head_params() * worst_stage["head"]
    layers = worst_stage["stop"] - worst_stage["start"]
    one_card_layers = one["memory"]["bcd_live"]["weights"] - (shape.embed_params() + shape.head_params()) * 2
    expected = one_card_layers * layers / shape.layers + ends * 2  # the ends in bf16, the layers coded
    assert live["weights"] == pytest.approx(expected, rel=0.1)
    assert live["weights"] < one["memory"]["bcd_live"]["weights"] / 2
    assert four["memory"]["full_adam"]["weights"] < one["memory"]["full_adam"]["weights"] / 2


def test_llama3_70b_on_four_stages_fits_20_gib_a_card(capsys):
    plan = plan_json(capsys, "--model", "llama3-70b", "--pipeline", "4", *SAVERS, "--blocks", "80",
                     "--separate-ends")
    assert plan["memory"]["bcd_live"]["total"] <= 20 * GIB < plan["weight_bytes"]
    assert len(plan["stages"]) == 4 and plan["memory"]["bcd_live"]["fits"]


def test_huge_figures_stay_separated_in_the_table(capsys):
    argv = ["--model", "llama3-70b", "--tokens", "9e15", "--seq-len", "1000000", "--micro-batch", "64"]
    plan = plan_json(capsys, *argv)
    code, out, _ = run_cli(["plan", *argv], capsys)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in plan["memory"]}
    assert set(rows) == set(plan["memory"])
    for name, memory in plan["memory"].items():
        figures = [float(cell) for cell in rows[name][1:9]]  # a figure run into the next one is no number
        parts = ("weights", "grads", "optimizer", "activations", "step", "host", "total")
        assert figures[:7] == pytest.approx([memory[part] / GIB for part in parts], abs=0.006)
        assert rows[name][9] in ("yes", "no")
    assert max(plan["memory"]["full_adam"][part] for part in ("activations", "total")) > 1e5 * GIB


def test_the_plan_offers_the_run_line_of_expansion_beside_frozen_codes(capsys):
    """The run's own rules judge the line before it is offered; expansion runs beside frozen codes."""
    flags = ["--expand", "lowrank", "--frozen-dtype", "nf4", "--dtype", "bf16-mixed"]
    code, out, _ = run_cli(["plan", "--model", "7b", *flags], capsys)
    line = next(line for line in out.splitlines() if line.startswith("run it: "))
    assert code == 0 and line.startswith("run it: preinfer bcd ")
    assert "--expand lowrank" in line and "--frozen-dtype nf4" in line


@pytest.mark.parametrize("separate_ends", [False, True])
def test_a_stage_s_cost_over_its_distinct_visits_is_its_cost_over_every_visit(separate_ends):
    shape = resolve_shape("llama3-8b")
    settings = Settings(dtype="bf16-mixed", recompute=True, frozen_dtype="nf4", optimizer="adamw8bit",
                        fused_step=True)
    blocks = partition(shape, 8, separate_ends)
    for j, (lo, hi) in enumerate([(0, 5), (5, 13), (13, 27), (27, 32)]):
        stage = LayerSpan(lo, hi, lo == 0, hi == shape.layers)
        every = max(stage_bytes(shape, settings, stage, active, 4 - j) for active in blocks)
        assert stage_cost(shape, settings, stage, j, 4, blocks, 4, "1f1b") == every
