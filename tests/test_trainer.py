"""The live BCD trainer: what a visit may and may not touch, stopping rules, orders, resume. Batches come from
the reader-backed token source every run uses (`pipelines.data.batches`)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from preinfer.errors import UsageError
from preinfer.memory.meter import MemoryMeter
from preinfer.metrics import StepRecord
from preinfer.block_order import sweep_order
from tests.helpers.trainers import assert_resumes_as, make_trainer, snapshot


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("block_index", [0, 1, 2])
def test_a_visit_touches_only_its_block(preset, block_index):
    """Invariant 4, without expansion (which invariant 18 lets update the layers above: tests/test_expansion.py)."""
    trainer = make_trainer(preset, blocks__expand="none")
    block = trainer.partition.blocks[block_index]
    model = trainer.staged.model
    mine = {id(p) for p in block.params}
    before = snapshot(model)

    saved_by_layer = {}
    current = {"layer": None}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: current.update(layer=i))
             for i, layer in enumerate(trainer.staged.layers)]

    def pack(tensor):
        if current["layer"] is not None:
            saved_by_layer[current["layer"]] = saved_by_layer.get(current["layer"], 0) + 1
        return tensor

    seen_state = {}
    real_step = torch.optim.Adam.step

    def spy_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        seen_state["params"] = {id(p) for p in self.state}
        seen_state["grads"] = {id(p) for p in model.parameters() if p.grad is not None}
        return out

    torch.optim.Adam.step = spy_step
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer._visit(block, None)
    finally:
        torch.optim.Adam.step = real_step
        for h in hooks:
            h.remove()

    after = dict(model.named_parameters())
    for name, p in after.items():
        if id(p) in mine:
            assert not torch.equal(before[name], p), f"{name} of the active block did not change"
        else:
            assert torch.equal(before[name], p), f"frozen {name} changed"
    assert seen_state["params"] == mine
    assert seen_state["grads"] <= mine
    assert all(p.grad is None for p in model.parameters())
    assert all(saved_by_layer.get(i, 0) == 0 for i in range(block.start)), saved_by_layer
    assert all(saved_by_layer.get(i, 0) > 0 for i in range(block.start, trainer.staged.num_layers))


@pytest.mark.parametrize("order", ["ascending", "descending", "random", "fixed"])
@pytest.mark.parametrize("start", [0, 2])
def test_every_order_visits_every_block_once_per_sweep(order, start):
    for sweep in range(4):
        visits = sweep_order(order, 4, sweep, seed=7, start_block=start, fixed=[3, 1, 0, 2])
        assert sorted(visits) == [0, 1, 2, 3]
        assert visits[0] == start


def test_random_order_reshuffles_per_sweep_and_is_seeded():
    orders = [tuple(sweep_order("random", 6, s, seed=1)) for s in range(6)]
    assert len(set(orders)) > 1
    assert orders == [tuple(sweep_order("random", 6, s, seed=1)) for s in range(6)]


def test_plateau_rule_stops_a_visit():
    trainer = make_trainer(stop__steps_per_visit=1000, stop__patience=3, stop__min_delta=10.0, optim__lr=1e-6)
    visits = trainer.fit()
    assert [v["stop_reason"] for v in visits] == ["plateau"] * 3
    assert all(v["steps"] == 4 for v in visits)  # the first step sets the best; 3 without improvement


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_each_visit_s_learning_rate_decays_as_the_transformers_schedule_after_our_warmup(decay):
    """After warmup (ours: step 0 at 1/warmup), the rate of every step is transformers' schedule of the visit."""
    records = []
    make_trainer(on_record=records.append, optim__warmup_steps=2, optim__decay=decay, stop__steps_per_visit=7).fit()
    rates = [r.lr for r in records if isinstance(r, StepRecord)]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    make = get_linear_schedule_with_warmup if decay == "linear" else get_cosine_schedule_with_warmup
    scheduler = make(optimizer, num_warmup_steps=2, num_training_steps=7)
    expected = []
    for _ in range(7):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected[:2] = [0.5e-3, 1e-3]
    assert rates == pytest.approx(expected * 3, rel=1e-12, abs=1e-15)  # 3 visits of 7 steps


def test_a_decaying_rate_needs_a_known_visit_length():
    with pytest.raises(UsageError, match=r"\[optim\] decay = 'cosine': expected one of none, constant_with_warmup, inverse_sqrt when a visit ends "
                                        r"on a plateau"):
        make_trainer(optim__decay="cosine", stop__steps_per_visit=None, stop__patience=3)  # refused when made


def untimed(visits: list[dict]) -> list[dict]:
    """Visit records without their measured times."""
    return [{k: v for k, v in visit.items() if k not in ("wall_s", "eval_s")} for visit in visits]


@pytest.mark.parametrize("order", ["ascending", "importance"])
def test_total_steps_ends_the_run_mid_visit_and_mid_sweep_and_a_raised_budget_continues_it(tmp_path, order):
    """--total-steps 7 of 3-step visits: visits of 3, 3 and 1 steps, the last stopped by it (evaluated and
    recorded), the run ending in its first sweep of three; resumed with the same budget it trains nothing, with
    9 it continues the cut visit (issue 48, case 3) to the weights of the run started with 9, bit for bit."""
    records = []
    overrides = dict(blocks__sweeps=3, blocks__order=order, blocks__importance_floor=1, stop__steps_per_visit=3)
    trainer = make_trainer(run_dir=tmp_path, on_record=records.append, stop__total_steps=7, **overrides)
    visits = trainer.fit()
    assert [(v["sweep"], v["steps"], v["stop_reason"]) for v in visits] == \
        [(0, 3, "steps"), (0, 3, "steps"), (0, 1, "total-steps")]
    assert trainer.position.global_step == 7 and not trainer.stopped
    assert sum(isinstance(r, StepRecord) for r in records) == 7
    weights = snapshot(trainer.staged.model)
    again = make_trainer(run_dir=tmp_path, stop__total_steps=7, **overrides)
    again.resume()
    assert untimed(again.fit()) == untimed(visits) and again.position.global_step == 7
    assert all(torch.equal(weights[k], p) for k, p in again.staged.model.named_parameters())
    raised = make_trainer(run_dir=tmp_path, stop__total_steps=9, **overrides)
    raised.resume()
    assert [(v["steps"], v["stop_reason"]) for v in raised.fit()] == [(3, "steps")] * 3
    assert raised.position.global_step == 9
    straight = make_trainer(run_dir=tmp_path / "straight", stop__total_steps=9, **overrides)
    assert untimed(straight.fit()) == untimed(raised.position.visits)
    assert all(torch.equal(p, dict(straight.staged.model.named_parameters())[k])
               for k, p in raised.staged.model.named_parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_resume_is_bit_identical(tmp_path, precision):
    overrides = dict(blocks__sweeps=2, optim__warmup_steps=2, optim__decay="cosine", stop__steps_per_visit=4,
                     run__precision=precision, run__loss_chunk=16)  # the default loss, chunked: 3-4 chunks a batch
    reference = make_trainer(run_dir=tmp_path / "a", **overrides)
    halted = make_trainer(run_dir=tmp_path / "b", **overrides)
    assert reference.staged.loss_kind == "chunked"
    if precision == "fp16-mixed":  # a scale that overflows at first: the loss scaler's state must resume too
        reference.scaler.scale = halted.scaler.scale = 2.0**20
    reference.fit()
    halted.fit(max_total_steps=6)  # mid-visit: block 1, step 2 of 4
    saved = load_file(str(tmp_path / "b" / "checkpoint" / "state.safetensors"))
    masters = [saved[f"master.{i}"] for i in range(sum(name.startswith("master.") for name in saved))]
    params = halted.partition.blocks[1].params
    factors = 2 * 7  # the default expansion's (lowrank): A and B of each linear of the one layer above block 1
    own = 0 if precision == "fp32" else len(params)
    assert len(masters) == own + factors and all(m.dtype == torch.float32 for m in masters)
    if precision != "fp32":  # the fp32 masters hold what the bf16 weights cannot, and travel with the checkpoint
        assert [m.shape for m in masters[:own]] == [p.shape for p in params]
        assert any(not torch.equal(m, p.float()) for m, p in zip(masters, params))
    resumed = assert_resumes_as(reference, tmp_path / "b", **overrides)
    if precision == "fp16-mixed":
        assert halted.scaler.skipped > 0 and resumed.scaler.state_dict() == reference.scaler.state_dict()


def test_a_meter_tracking_the_first_steps_of_each_visit_reports_the_peaks_of_one_tracking_every_step():
    reports = {}
    for steps in (2, None):
        trainer = make_trainer(stop__steps_per_visit=4)
        trainer.meter = MemoryMeter(trainer.staged.model, steps_per_visit=steps)
        trainer.fit()
        reports[steps] = [{k: v for k, v in visit["memory"].items() if k not in ("rss_peak", "cuda_peak")}
                          for visit in trainer.position.visits]
    assert reports[2] == reports[None]
    assert all(report["activations"] > 0 and report["optimizer"] > 0 for report in reports[2])
