"""Kept optimizer state (`--keep-optimizer-state`): each block's state waits in host memory between its visits (the
8-bit optimizers' codes stay 8-bit), comes back onto the device at the block's next visit with its step count going
on, is priced in the meter's records, and a run resumed mid-sweep with kept states ends bit for bit as one run."""

import pytest
import torch

from preinfer.memory.meter import MemoryMeter
from tests.helpers.resume import halted_and_resumed, same_weights
from tests.helpers.trainers import make_trainer, snapshot

STEPS = 4


@pytest.mark.parametrize("overrides", [
    dict(run__precision="fp32"), dict(run__precision="bf16-mixed"),
    dict(run__precision="fp32", optim__name="adamw8bit"), dict(run__precision="fp32", optim__fused_step=True),
    dict(run__precision="fp32", optim__block_lr="depth:0.5..1.5"),
    dict(run__precision="bf16-mixed", blocks__expand="lowrank", blocks__expand_lr=0.05),
], ids=["fp32", "bf16-mixed", "adamw8bit", "fused", "block-lr", "lowrank"])
def test_a_run_resumed_with_kept_states_ends_bit_for_bit_as_one_run(tmp_path, overrides):
    options = dict(optim__keep_state=True, blocks__sweeps=2, stop__steps_per_visit=STEPS, **overrides)
    # halted in sweep 1 with block 0 mid-visit, blocks 1 and 2 kept
    reference, saved, resumed = halted_and_resumed(tmp_path, 3 * STEPS + 2, **options)
    assert {name.split(".")[1] for name in saved if name.startswith("optim.")} == {"0", "1", "2"}
    assert same_weights(reference, resumed)
    assert [v["eval_loss"] for v in resumed.position.visits] == [v["eval_loss"] for v in reference.position.visits]


def test_kept_states_change_the_second_sweep_and_their_step_count_goes_on():
    kept, reset = (make_trainer(optim__keep_state=keep, blocks__sweeps=2) for keep in (True, False))
    kept.fit()
    reset.fit()
    a, b = snapshot(kept.staged.model), snapshot(reset.staged.model)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert sorted(kept.optimizers.kept) == [0, 1, 2] and reset.optimizers.kept == {}
    steps = {float(entries["step"]) for state in kept.optimizers.kept.values() for entries in state["state"].values()}
    assert steps == {2 * 3}  # two visits of 3 steps each: the bias correction of step 6, not of step 3 again


def test_kept_states_wait_in_host_memory_and_8bit_codes_stay_8bit():
    trainer = make_trainer(optim__keep_state=True, optim__name="adamw8bit")
    trainer.fit()
    tensors = [value for state in trainer.optimizers.kept.values() for entries in state["state"].values()
               for value in entries.values() if torch.is_tensor(value)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert any(t.dtype == torch.uint8 for t in tensors)
    assert trainer.visit is None


def test_the_visit_records_give_the_kept_states_host_bytes():
    """fp32 Adam keeps two fp32 moments and a float32 step count per tensor of each visited block."""
    trainer = make_trainer(optim__keep_state=True)
    trainer.meter = MemoryMeter(trainer.staged.model)
    trainer.fit()
    blocks, expected, visited = trainer.partition.blocks, [], 0
    for visit in trainer.position.visits:
        params = blocks[visit["block"]].params
        visited += sum(2 * 4 * p.numel() + 4 for p in params)
        expected.append(visited)
    assert [v["memory"]["host_optimizer"] for v in trainer.position.visits] == expected
    plain = make_trainer()
    plain.meter = MemoryMeter(plain.staged.model)
    plain.fit()
    assert all("host_optimizer" not in v["memory"] for v in plain.position.visits)


@pytest.mark.parametrize("expand_lr", [None, 0.05], ids=["one-group", "factors-apart"])
def test_with_lowrank_expansion_a_block_keeps_its_own_moments_and_its_new_factors_start_fresh(expand_lr):
    """Each visit draws new factors (B zero): their moments start at step 0 while the block's kept moments come
    back bit for bit, their step count going on (the factors in the block's group or in one of their own)."""
    trainer = make_trainer(optim__keep_state=True, blocks__expand="lowrank", blocks__expand_lr=expand_lr,
                           blocks__order="descending")
    trainer.fit()
    block = trainer.partition.blocks[0]  # its suffix: blocks 1 and 2's layers
    kept = trainer.optimizers.kept[0]
    assert len(kept["state"]) == len(block.params) and all(float(e["step"]) == 3 for e in kept["state"].values())
    visit = trainer.lifecycle.activate(block, trainer.position)
    assert trainer.lifecycle.extras > 0
    state = visit.optimizer.state
    for index, master in enumerate(visit.active.masters):
        if index < len(block.params):
            assert all(torch.equal(state[master][k], kept["state"][index][k]) for k in ("exp_avg", "exp_avg_sq"))
        else:
            assert master not in state  # a factor: no moments until its first step
    visit.set_rate(0)
    trainer.lifecycle.train_step(block, trainer.visit_sources.sources(block)[0], visit)
    steps = [float(state[m]["step"]) for m in visit.active.masters]
    assert steps == [4.0] * len(block.params) + [1.0] * trainer.lifecycle.extras
