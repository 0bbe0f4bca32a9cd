"""Importance orders (scores, floor, resume), the planner's choice of importance-cached, and the gain stopping rule
(on constructed losses and an injected clock)."""

import itertools
import json
import math
import random

import pytest
import torch

from preinfer.block_order import importance_sweep, sweep_order
from preinfer.errors import UsageError
from preinfer.gain import GainRule
from preinfer.metrics import ImportanceRecord, StepRecord, VisitRecord
from tests.helpers.cli_run import run_cli
from tests.helpers.trainers import make_trainer, snapshot

IMPORTANCE = dict(blocks__order="importance")


def autograd_scores(trainer, batches: int) -> list[float]:
    """Each block's sqrt(mean over batches of ||d loss_i / d block||^2 / its parameter count), the loss being the
    transformers model's own (labels given), the gradients torch.autograd's."""
    model = trainer.staged.model
    model.eval()
    squares = [0.0] * len(trainer.partition)
    for batch in itertools.islice(trainer.visit_sources.train.one_pass(), batches):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        for index, block in enumerate(trainer.partition.blocks):
            grads = torch.autograd.grad(loss, block.params, retain_graph=True)
            squares[index] += sum(float(g.double().pow(2).sum()) for g in grads)
    counts = [sum(p.numel() for p in block.params) for block in trainer.partition.blocks]
    return [(total / batches / count) ** 0.5 for total, count in zip(squares, counts)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])  # tiny-gpt2: a tied embedding and head
def test_the_scores_are_the_gradient_norms_per_parameter_torch_autograd_computes(preset):
    trainer = make_trainer(preset, blocks__importance_batches=2, **IMPORTANCE)
    model = trainer.staged.model
    before = snapshot(model)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    scores, batches = trainer.sweeps.block_scores()
    assert batches == 2
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())  # the weights untouched
    assert all(p.grad is None for p in model.parameters())  # the gradients discarded
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    model.requires_grad_(True)
    assert scores == pytest.approx(autograd_scores(trainer, 2), rel=1e-5)
    assert len(set(scores)) == len(scores)  # the blocks differ: a score per block, not one number


@pytest.mark.parametrize("precision,scale,rel", [("bf16-mixed", None, 1e-2), ("fp16-mixed", None, 1e-3),
                                                  ("fp16-mixed", 2.0**40, 1e-3)])  # 2^40: overflows, halved
def test_16_bit_scores_are_the_fp32_gradient_norms_of_the_same_weights(precision, scale, rel):
    trainer = make_trainer(blocks__importance_batches=2, run__precision=precision, **IMPORTANCE)
    if scale is not None:
        trainer.scaler.scale = scale
    reference = make_trainer(blocks__importance_batches=2, **IMPORTANCE)
    with torch.no_grad():
        for ours, theirs in zip(reference.staged.model.parameters(), trainer.staged.model.parameters()):
            ours.copy_(theirs.float())  # fp32 weights equal to the 16-bit ones
    scores, _ = trainer.sweeps.block_scores()
    assert all(math.isfinite(score) for score in scores)
    assert scores == pytest.approx(autograd_scores(reference, 2), rel=rel)


@pytest.mark.parametrize("floor", [1, 2, 3])
def test_every_block_is_visited_within_the_floor(floor):
    rng = random.Random(floor)
    blocks, last, visited = 5, [-1] * 5, []
    for sweep in range(30):
        scores = [rng.random() ** 4 for _ in range(blocks)]  # skewed: few blocks reach the mean
        chosen = importance_sweep(scores, last, sweep, floor)
        assert len(set(chosen.order)) == len(chosen.order)
        assert [scores[b] for b in chosen.order] == sorted((scores[b] for b in chosen.order), reverse=True)
        assert {b for b in range(blocks) if scores[b] >= sum(scores) / blocks} <= set(chosen.order)
        for b in chosen.order:
            last[b] = sweep
        visited.append(set(chosen.order))
    for start in range(len(visited) - floor + 1):
        assert set().union(*visited[start:start + floor]) == set(range(blocks)), (start, visited)
    if floor > 1:
        assert any(len(v) < blocks for v in visited)  # sweeps visit subsets: the floor is what brings the rest


def test_a_run_in_importance_order_visits_by_descending_score_within_the_floor():
    records = []
    trainer = make_trainer(blocks__sweeps=4, blocks__importance_floor=2, on_record=records.append, **IMPORTANCE)
    trainer.fit()
    measured = [r for r in records if isinstance(r, ImportanceRecord)]
    assert [r.sweep for r in measured] == [0, 1, 2, 3]
    visits = [r for r in records if isinstance(r, VisitRecord)]
    for record in measured:
        assert [v.block for v in visits if v.sweep == record.sweep] == record.order
        assert [record.scores[b] for b in record.order] == sorted((record.scores[b] for b in record.order),
                                                                   reverse=True)
        assert record.batches == 2 and record.seconds >= 0
    for sweep in range(3):
        assert {v.block for v in visits if v.sweep in (sweep, sweep + 1)} == {0, 1, 2}


@pytest.mark.parametrize("halt", [2, 7])  # in the sweep's first visit; in its third
def test_importance_order_resumed_mid_sweep_is_bit_identical(tmp_path, halt):
    overrides = dict(blocks__sweeps=3, blocks__importance_floor=1, stop__steps_per_visit=3, **IMPORTANCE)
    reference = make_trainer(run_dir=tmp_path / "a", **overrides)
    reference.fit()
    halted = make_trainer(run_dir=tmp_path / "b", **overrides)
    halted.fit(max_total_steps=halt)
    saved = halted.position.sweep_order
    assert saved["sweep"] == 0 and halted.position.visit == (halt - 1) // 3
    records = []
    resumed = make_trainer(run_dir=tmp_path / "b", on_record=records.append, **overrides)
    resumed.resume()
    assert resumed.position.sweep_order == saved  # read back from the checkpoint's JSON exactly
    assert resumed.sweeps.block_scores()[0] != saved["scores"]  # the weights moved: measuring again would not do
    resumed.fit()
    ref, got = snapshot(reference.staged.model), snapshot(resumed.staged.model)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert [(v["sweep"], v["block"], v["eval_loss"]) for v in resumed.position.visits] == \
        [(v["sweep"], v["block"], v["eval_loss"]) for v in reference.position.visits]
    assert [r.sweep for r in records if isinstance(r, ImportanceRecord)] == [1, 2]  # sweep 0's was not measured again


@pytest.mark.parametrize("margin,chosen", [(0.25, "ascending"), (0.2, "ascending"), (0.19, "importance")])
def test_importance_cached_keeps_ascending_unless_the_scores_spread_beyond_the_margin(margin, chosen):
    scores = [0.8, 1.0, 0.9]  # spread (1.0 - 0.8) / 1.0 = 0.2
    plan = importance_sweep(scores, [-1] * 3, 0, floor=1, cached=True, margin=margin)
    assert plan.chosen == chosen and plan.spread == pytest.approx(0.2)
    assert plan.order == ([0, 1, 2] if chosen == "ascending" else [1, 2, 0])
    assert importance_sweep(scores, [-1] * 3, 0, floor=1).order == [1, 2, 0]  # importance ignores the margin


def test_the_run_logs_the_choice_of_importance_cached():
    records = []
    make_trainer(blocks__order="importance-cached", blocks__importance_floor=1, blocks__importance_margin=10.0,
                 on_record=records.append).fit()
    record = next(r for r in records if isinstance(r, ImportanceRecord))
    assert record.chosen == "ascending" and record.order == [0, 1, 2] and record.spread > 0
    records.clear()
    make_trainer(blocks__order="importance-cached", blocks__importance_floor=1, blocks__importance_margin=0.0,
                 on_record=records.append).fit()
    record = next(r for r in records if isinstance(r, ImportanceRecord))
    assert record.chosen == "importance"
    assert record.order == sorted(range(3), key=lambda b: -record.scores[b])


def feed(rule: GainRule, losses: list[float], times: list[float]) -> int | None:
    """The step (from 1) at which the rule ends the visit, or None."""
    rule.begin(0.0)
    for step, (loss, now) in enumerate(zip(losses, times), 1):
        if rule.update(loss, now):
            return step
    return None


# Losses falling by 1 a step, then slowing; one step a second. With window 2 the rate at step t is
# (mean of losses t-3, t-2) - (mean of losses t-1, t), over 2 s: step 4 (the initial rate) 1.0, step 5 0.875,
# step 6 0.525, step 7 0.1875.
LOSSES = [10.0, 9.0, 8.0, 7.0, 6.5, 6.4, 6.35, 6.3]


def test_gain_ends_a_visit_when_another_block_is_predicted_to_gain_faster():
    rule = GainRule(window=2, ratios={"1": 0.5, "2": 0.3}, switch_s={"1": 0.0, "2": 0.0}, budget=None)
    assert feed(rule, LOSSES, [1.0, 2, 3, 4, 5, 6, 7, 8]) == 7  # block 1 predicted 0.5 x 1.0: 0.525 > 0.5 > 0.1875
    assert rule.initial_rate == pytest.approx(1.0) and rule.rate == pytest.approx(0.1875)
    assert rule.predicted == pytest.approx({"1": 0.5, "2": 0.3}) and rule.best == "1"
    rule = GainRule(window=2, ratios={"1": 0.9}, switch_s={"1": 0.0}, budget=None)
    assert feed(rule, LOSSES, [1.0, 2, 3, 4, 5, 6, 7, 8]) == 5  # 0.875 < 0.9


def test_gain_prices_the_switch_over_the_visit_s_horizon():
    # budget 8 steps at 1 s a step: horizon 8 s; a switch of 24 s leaves 8 / 32 = 1/4 of block 1's gain: 0.225
    rule = GainRule(window=2, ratios={"1": 0.9}, switch_s={"1": 24.0}, budget=8)
    assert feed(rule, LOSSES, [1.0, 2, 3, 4, 5, 6, 7, 8]) == 7  # 0.525 > 0.225 > 0.1875
    assert rule.horizon_s == pytest.approx(7.0 / 7 * 8)
    assert rule.predicted["1"] == pytest.approx(0.9 * 1.0 * 8 / 32)


def test_gain_rates_are_per_second_of_the_clock():
    # the same losses, the steps from step 5 on taking 10 s each: step 5's rate is (8.5 - 6.75) / 6 s, below 0.5
    rule = GainRule(window=2, ratios={"1": 0.5}, switch_s={"1": 0.0}, budget=None)
    assert feed(rule, LOSSES, [1.0, 2, 3, 4, 14, 24, 34, 44]) == 5
    assert rule.rate == pytest.approx((8.5 - 6.75) / ((4 + 14) / 2 - (2 + 3) / 2))


def test_gain_stops_each_visit_of_a_run_where_its_logged_prediction_says():
    """One step a second by the injected clock: each visit ends at the first step whose rate (recomputed from the
    step records' losses) is below the best logged prediction, and not before."""
    ticks = itertools.count()
    records = []
    window = 2
    trainer = make_trainer(clock=lambda: float(next(ticks)), on_record=records.append, blocks__sweeps=2,
                           stop__rule="gain", stop__gain_window=window, stop__steps_per_visit=40, **IMPORTANCE)
    trainer.fit()
    visits = [r for r in records if isinstance(r, VisitRecord)]
    assert any(v.stop_reason == "gain" for v in visits)
    for visit in visits:
        losses = [r.loss for r in records if isinstance(r, StepRecord) and (r.sweep, r.block) == (visit.sweep,
                                                                                                   visit.block)]
        rates = [None] * (2 * window - 1) + [
            (sum(losses[t - 2 * window + 1:t - window + 1]) - sum(losses[t - window + 1:t + 1])) / window / window
            for t in range(2 * window - 1, len(losses))]
        gain = visit.gain
        assert gain["initial_rate"] == pytest.approx(rates[2 * window - 1], rel=1e-9, abs=1e-12)
        best = max(gain["predicted"].values())
        assert best == pytest.approx(max(gain["ratios"].values()) * max(gain["initial_rate"], 0.0), abs=1e-15)
        stops = [t + 1 for t, rate in enumerate(rates) if rate is not None and rate < best]
        if visit.stop_reason == "gain":
            assert stops[0] == visit.steps and gain["rate"] == pytest.approx(rates[-1], rel=1e-9, abs=1e-12)
        else:
            assert visit.stop_reason == "steps" and not stops


def test_the_gain_rule_and_importance_orders_refuse_what_they_cannot_run_with():
    with pytest.raises(UsageError, match=r"\[stop\] rule = 'gain': expected budget unless \[blocks\] order is importance"):
        make_trainer(stop__rule="gain")
    with pytest.raises(UsageError, match=r"start_block"):
        make_trainer(blocks__start_block=1, **IMPORTANCE)
    with pytest.raises(UsageError, match="--order importance-cached is measured by the bcd trainer"):
        sweep_order("importance-cached", 3, 0)


def test_bcd_with_importance_cached_and_the_gain_rule_logs_scores_choices_and_predictions(tmp_path, capsys):
    """The CLI end to end, with pre-inference on: each visit's switching costs are the stores' (priced by the sweep
    plan's throughputs) for the blocks above the input, 0 for the one at it."""
    out = tmp_path / "run"
    code, stdout, err = run_cli(["bcd", "--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4",
                                 "--eval-tokens", "256", "--lr", "1e-3", "--blocks", "3", "--sweeps", "2",
                                 "--order", "importance-cached", "--importance-floor", "1", "--stop", "gain",
                                 "--gain-window", "2", "--steps-per-visit", "8", "--pre-inference", "on",
                                 "--max-samples", "64", "--out", str(out)], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["kind"] == "importance"]
    assert [r["sweep"] for r in measured] == [0, 1] and all(r["chosen"] in ("importance", "ascending")
                                                            for r in measured)
    assert "block scores" in stdout + err
    visits = [r for r in records if r["kind"] == "visit"]
    assert [v["block"] for v in visits] == measured[0]["order"] + measured[1]["order"]
    for visit in visits:
        gain = visit["gain"]
        assert visit["stop_reason"] in ("gain", "steps") and set(gain["predicted"]) == set(gain["switch_s"])
        assert gain["switch_s"].get("0", 0.0) == 0.0
    assert any(cost > 0 for v in visits for b, cost in v["gain"]["switch_s"].items() if b != "0")
