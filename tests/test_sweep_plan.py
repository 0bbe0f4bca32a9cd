"""Whole-sweep pre-inference plans: the plan for fixed throughputs is the expected one, and never exceeds the disk;
builds are priced at their own layer rate, and the probe from its size and the measured forward."""

import dataclasses
import math
import random

import pytest

from pipelines.pre_inference import sweep_plan
from pipelines.pre_inference.sweep_plan import Throughputs, Visit, Workload, plan_for, plan_sweep, store_cost

# small-llama-like: 6 layers, UFP 1/3 (blocks start at 0, 2, 4), seq 128 x hidden 256 float32, batch 8
SAMPLE_BYTES = 128 * 256 * 4
EPOCH = 125  # steps: 1000 training samples
RATES = Throughputs(layer_seconds=5e-4, write_bps=1e9, read_bps=1e9)
ASCENDING, DESCENDING, SHUFFLED = (0, 2, 4), (4, 2, 0), (4, 0, 2)


def workload(starts=ASCENDING, steps=EPOCH, free_bytes=10**12, stores=frozenset(), num_layers=6) -> Workload:
    return Workload(
        visits=tuple(Visit(block=i, start=s, steps=steps) for i, s in
                     ((sorted(starts).index(s), s) for s in starts)),
        num_layers=num_layers, samples_per_step=8, train_samples=1000, eval_split_samples=100, eval_samples=100,
        sample_bytes=SAMPLE_BYTES, free_bytes=free_bytes, stores=frozenset(stores))


def builds(plan) -> list[tuple[int, int, int]]:
    return [(b.boundary, b.source, b.slot) for b in plan.builds]


STORE = (1000 + 100) * SAMPLE_BYTES
# 32 layers in 4 blocks (a 7B model's depth, UFP 1/4): at 1 epoch a visit the stores save 8% over the sweep
DEEP_ASCENDING, DEEP_DESCENDING = (0, 8, 16, 24), (24, 16, 8, 0)
CASES = [
    # name, workload, expected sources, expected builds (boundary, from, before visit)
    ("ascending, 1 epoch, 32 layers: store at 8, rolled forward to 16 and 24",
     workload(DEEP_ASCENDING, num_layers=32), DEEP_ASCENDING, [(8, 0, 1), (16, 8, 2), (24, 16, 3)]),
    ("descending, 1 epoch, 32 layers: every store at the start, each from the one below",
     workload(DEEP_DESCENDING, num_layers=32), DEEP_DESCENDING, [(8, 0, 0), (16, 8, 0), (24, 16, 0)]),
    ("ascending, 1 epoch, 6 layers: stores save 1.7%, within the margin: live", workload(), (0, 0, 0), []),
    ("ascending, 3 epochs", workload(steps=3 * EPOCH), (0, 2, 4), [(2, 0, 1), (4, 2, 2)]),
    ("ascending, a tenth of an epoch: live", workload(steps=EPOCH // 10), (0, 0, 0), []),
    ("descending, 1 epoch, 6 layers: within the margin: live", workload(DESCENDING), (0, 0, 0), []),
    ("descending, 1 epoch, room for one store: live", workload(DESCENDING, free_bytes=int(1.5 * STORE)), (0, 0, 0),
     []),
    ("descending, 3 epochs, room for one store: each made before its visit",
     workload(DESCENDING, steps=3 * EPOCH, free_bytes=int(1.5 * STORE)), (4, 2, 0), [(4, 0, 0), (2, 0, 1)]),
    ("ascending, 3 epochs, room for one store: each made from the input",
     workload(steps=3 * EPOCH, free_bytes=int(1.5 * STORE)), (0, 2, 4), [(2, 0, 1), (4, 0, 2)]),
    ("no room for any store: live", workload(free_bytes=STORE), (0, 0, 0), []),
    ("a valid store at 2 is reused, then rolled forward", workload((2, 4), stores={2}), (2, 4), [(4, 2, 1)]),
    ("shuffled, 3 epochs: each store from the input", workload(SHUFFLED, steps=3 * EPOCH), (4, 0, 2),
     [(4, 0, 0), (2, 0, 2)]),
]


@pytest.mark.parametrize("name, work, sources, made", CASES, ids=[c[0] for c in CASES])
def test_the_plan_for_fixed_throughputs(name, work, sources, made):
    plan = plan_sweep(work, RATES)
    assert plan.chosen.sources == sources
    assert builds(plan.chosen) == made
    assert plan.chosen.peak_bytes <= work.disk_budget
    if plan.chosen.reads_stores:
        assert plan.chosen.seconds < (1 - sweep_plan.STORE_MARGIN) * plan.live.seconds
        assert plan.alternative is plan.live
    else:
        assert plan.chosen is plan.live


def test_ascending_at_one_epoch_pays_over_the_sweep_though_no_single_visit_does():
    """The issue's case: a store for any one visit alone costs more than it saves; the sweep's roll-forwards
    pay."""
    work = workload(DEEP_ASCENDING, num_layers=32)
    plan = plan_sweep(work, RATES)
    live = plan.live.seconds
    for alone in ((False, True, False, False), (False, False, True, False), (False, False, False, True)):
        assert min(plan_for(work, RATES, alone, *timing).seconds for timing in sweep_plan.TIMINGS) > live
    assert plan.chosen.sources == DEEP_ASCENDING and plan.chosen.seconds < live
    assert plan.chosen.peak_bytes == 2 * work.store_bytes  # a roll-forward holds its source and its result
    assert plan.chosen.deletes == ((8, 4), (16, 6), (24, 7))  # each after it fed the next, the last after its visit


def test_auto_reads_stores_only_beyond_the_margin(monkeypatch):
    """6 layers at 1 epoch a visit: the sweep's stores are predicted to save 1.7%, within `STORE_MARGIN`, so
    auto stays live; with no margin it reads them."""
    work = workload()
    plan = plan_sweep(work, RATES)
    saving = 1 - plan.best_store.seconds / plan.live.seconds
    assert not plan.chosen.reads_stores and 0 < saving < sweep_plan.STORE_MARGIN
    monkeypatch.setattr(sweep_plan, "STORE_MARGIN", 0.0)
    assert plan_sweep(work, RATES).chosen.sources == (0, 2, 4)


def test_a_shuffled_order_with_short_visits_says_stores_are_useless_and_stays_live():
    plan = plan_sweep(workload(SHUFFLED), RATES)
    assert plan.no_reuse and not plan.chosen.reads_stores
    assert not plan_sweep(workload(), RATES).no_reuse and not plan_sweep(workload(DESCENDING), RATES).no_reuse


def test_on_reads_a_store_on_every_visit_above_the_input_and_builds_nothing_else():
    for starts in (ASCENDING, DESCENDING, SHUFFLED):
        plan = plan_sweep(workload(starts, steps=1), RATES, mode="on").chosen
        assert plan.sources == starts
        assert sorted(b.boundary for b in plan.builds) == sorted(s for s in starts if s)


def test_stores_that_cannot_be_rolled_forward_are_each_made_from_the_input_just_before_their_reader():
    """A pipeline's plan (`roll=False`): where one process rolls each store forward from the one below, or makes
    them all at the sweep's start, each store is made from the input before its own visit; a valid store is still
    reused, and the switching cost is a build from the input."""
    deep = workload(DEEP_ASCENDING, num_layers=32)
    assert builds(plan_sweep(deep, RATES, mode="on").chosen) == [(8, 0, 1), (16, 8, 2), (24, 16, 3)]
    for starts in (DEEP_ASCENDING, DEEP_DESCENDING):
        plan = plan_sweep(workload(starts, num_layers=32), RATES, mode="on", roll=False).chosen
        assert plan.sources == starts
        assert builds(plan) == [(k, 0, i) for i, k in enumerate(starts) if k]
    kept = plan_sweep(workload((2, 4), stores={2}), RATES, mode="on", roll=False).chosen
    assert kept.reused == (2,) and builds(kept) == [(4, 0, 1)]
    work, visit = workload(stores={2}), Visit(block=2, start=4, steps=EPOCH)
    assert sweep_plan.switch_seconds(work, RATES, visit, stores_read=True, roll=False) == \
        store_cost(work, RATES, 4, [])[1] > sweep_plan.switch_seconds(work, RATES, visit, stores_read=True)


def test_existing_stores_the_plan_does_not_read_are_deleted_at_the_start():
    plan = plan_sweep(workload(stores={2, 4}, steps=1), RATES).chosen
    assert not plan.reads_stores and plan.deletes == ((2, 0), (4, 0))


@pytest.mark.parametrize("seed", range(40))
def test_a_plan_never_exceeds_the_free_disk(seed):
    rng = random.Random(seed)
    num_layers = rng.choice([4, 6, 12])
    starts = rng.sample(range(num_layers), rng.randint(1, min(num_layers, 6)))
    work = workload(tuple(starts), steps=rng.choice([1, 12, EPOCH, 3 * EPOCH]),
                    free_bytes=int(rng.uniform(0, 4) * STORE), num_layers=num_layers)
    rates = Throughputs(layer_seconds=rng.uniform(1e-5, 1e-2), write_bps=rng.uniform(1e7, 2e9),
                        read_bps=rng.uniform(1e7, 2e9))
    for mode in ("auto", "on"):
        plan = plan_sweep(work, rates, mode)
        if plan.chosen.peak_bytes > work.disk_budget:  # `on` only, and only when no timing of its stores fits
            assert mode == "on" and all(plan_for(work, rates, tuple(s > 0 for s in starts), *timing).peak_bytes
                                        > work.disk_budget for timing in sweep_plan.TIMINGS)
        assert plan.best_store is None or plan.best_store.peak_bytes <= work.disk_budget


def test_many_visits_use_a_local_search_that_finds_the_exhaustive_plan(monkeypatch):
    work = workload(tuple(range(12)), num_layers=12)
    searched = plan_sweep(work, RATES).chosen
    monkeypatch.setattr(sweep_plan, "EXHAUSTIVE_VISITS", 12)
    exhaustive = plan_sweep(work, RATES).chosen
    assert searched.reads_stores and searched.seconds == pytest.approx(exhaustive.seconds)


def test_measured_step_times_enter_the_prediction_but_not_the_choice():
    work = workload()
    timed, untimed = (Throughputs(RATES.layer_seconds, RATES.write_bps, RATES.read_bps,
                                  step_seconds={b: seconds for b in range(3)}) for seconds in (1.0, 0.0))
    measured = plan_sweep(work, timed)
    assert measured.chosen.sources == plan_sweep(work, RATES).chosen.sources
    assert measured.live.seconds == pytest.approx(3 * EPOCH * 1.0 + plan_sweep(work, untimed).live.seconds)


def test_throughputs_differ_beyond_the_margin():
    assert RATES.differs(RATES) == []
    slower = Throughputs(RATES.layer_seconds * 1.2, RATES.write_bps / 2, RATES.read_bps, store_overhead_s=0.05)
    assert slower.differs(RATES) == ["write_bps"]  # the overhead moved by less than OVERHEAD_FLOOR_S
    assert Throughputs(RATES.layer_seconds, RATES.write_bps, RATES.read_bps, 0.5).differs(RATES) == [
        "store_overhead_s"]


def test_plan_records_round_trip_through_json_and_read_as_one_line():
    import dataclasses
    import json

    from preinfer.metrics import PlanOutcomeRecord, SweepPlanRecord, parse_record

    plan = SweepPlanRecord(sweep=0, reason="sweep start", mode="auto", first_visit=0, chosen="stores at 2 (...)",
                           predicted_s=21.5, alternative="live", alternative_s=21.9, live_s=21.9, sources=[0, 2, 4],
                           builds=[{"boundary": 2, "from": 0, "before_visit": 1, "seconds": 1.2}], peak_bytes=2 << 20,
                           free_bytes=1 << 30, layer_seconds=5e-4, write_bps=1e9, read_bps=1e9, store_overhead_s=0.1)
    outcome = PlanOutcomeRecord(sweep=0, predicted_s=21.5, measured_s=25.0, run_predicted_s=21.5, run_measured_s=25.0)
    without = dataclasses.replace(plan, alternative="none fits the disk", alternative_s=None)
    for record in (plan, without, outcome):
        assert parse_record(json.loads(json.dumps(record.to_dict()))) == record
    assert "note" not in plan.to_dict()
    assert plan.line() == ("sweep 0 pre-inference plan (sweep start): stores at 2 (...), predicted 21.5 s; "
                           "alternative live 21.9 s; live 21.9 s; peak disk 2.0 MiB of 1.0 GiB free; assumed "
                           "layer 0.5 ms/sample, write 1,000.0 MB/s, read 1,000.0 MB/s")
    assert outcome.line().endswith("25.0 s measured (-14%)")


def test_data_parallel_ranks_share_a_store_build():
    """Each of 2 ranks computes and writes half of every store: half the forward and the bytes, the fixed cost once."""
    rates = dataclasses.replace(RATES, store_overhead_s=0.5)
    one, two = workload(), dataclasses.replace(workload(), ranks=2)
    for below in ([], [2]):
        (source, alone), (_, shared) = store_cost(one, rates, 4, below), store_cost(two, rates, 4, below)
        assert source == (2 if below else 0)
        assert shared == pytest.approx((alone - 0.5) / 2 + 0.5)


def test_the_switching_cost_of_the_gain_rule_is_the_store_s_build_or_the_live_prefix():
    work, visit = workload(stores={2}), Visit(block=2, start=4, steps=EPOCH)
    # live: the prefix's 4 layers over the visit's 125 x 8 samples at 0.5 ms a layer and sample: 2 s
    assert sweep_plan.switch_seconds(work, RATES, visit, stores_read=False) == pytest.approx(4 * 1000 * 5e-4)
    # stores: rolled forward from the valid store at 2 (2 layers over 1100 samples, written and read once)
    assert sweep_plan.switch_seconds(work, RATES, visit, stores_read=True) == \
        store_cost(work, RATES, 4, [2])[1] == pytest.approx(2 * 1100 * 5e-4 + 2 * STORE / 1e9)
    assert sweep_plan.switch_seconds(work, RATES, Visit(block=1, start=2, steps=EPOCH), stores_read=True) == 0.0
    assert sweep_plan.switch_seconds(work, RATES, Visit(block=0, start=0, steps=EPOCH), stores_read=False) == 0.0


def test_builds_are_priced_at_the_builds_layer_rate_and_the_live_prefix_at_the_live_one():
    """A build's forward measured twice as slow as the live one: a store costs its forward at the builds' rate,
    while a visit that runs its prefix live is priced as before."""
    work, visit = workload(), Visit(block=1, start=2, steps=EPOCH)
    slow = dataclasses.replace(RATES, build_layer_seconds=2 * RATES.layer_seconds)
    forward = 2 * RATES.layer_seconds * (work.train_samples + work.eval_split_samples)  # boundary 2
    assert store_cost(work, slow, 2, [])[1] - store_cost(work, RATES, 2, [])[1] == pytest.approx(forward)
    assert sweep_plan.visit_seconds(work, slow, visit, 0) == sweep_plan.visit_seconds(work, RATES, visit, 0)
    assert slow.differs(RATES) == ["build_layer"]


def test_the_probe_is_priced_from_its_size_and_the_measured_forward_and_made_only_where_it_could_pay():
    """Stores that save a little beyond the margin on a free disk (a sweep of 32-step visits over 64 samples, the
    rates given): a probe of one sample (one sample a shard) is worth its cost, one of 64 samples at the same
    forward per sample is not; a faster build forward makes the larger one worth it too."""
    from pipelines.pre_inference import probe

    work = Workload(visits=tuple(Visit(b, 2 * b, 32) for b in range(3)), num_layers=6, samples_per_step=4,
                    train_samples=64, eval_split_samples=16, eval_samples=16, sample_bytes=1000, free_bytes=math.inf)
    slow, fast = (Throughputs(1e-3, 1e9, 1e9, 0.0, build_layer_seconds=s) for s in (2.1e-3, 1e-3))
    assert probe.probe_seconds(64, 1000, slow) > probe.probe_seconds(1, 1000, slow) > 0
    assert probe.stores_could_pay(work, slow, shard=1) and not probe.stores_could_pay(work, slow, shard=64)
    assert probe.stores_could_pay(work, fast, shard=64)
