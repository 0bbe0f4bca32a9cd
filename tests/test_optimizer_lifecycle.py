"""One optimizer lifecycle (`preinfer.visit_optimizer`): `preinfer bcd`'s trainer and `preinfer.hf`'s
`BlockOptimizer` with its `VisitSchedule`, over the same batches and the same steps, end with bit-identical weights
(masters, clipping in fp32, loss scaling, the schedule of each visit, the state dropped at each switch). The HF
side is driven by hand as `transformers.Trainer` drives it (backward, `optimizer.step()`, `scheduler.step()`),
each micro-batch's loss computed as the trainer computes it, so that only the lifecycle is compared. The fused step
(`--fused-step`) equals the unfused one where it applies and is refused where it does not."""

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from preinfer.config import Config, OptimConfig, StopConfig
from preinfer.config.resolved import check_resolved
from preinfer.errors import UsageError
from preinfer.forward_backward import forward_backward
from preinfer.hf import BlockCoordinateDescent
from preinfer.moe import RouterLoss
from preinfer.presets import build_preset
from preinfer.precision import Precision, resolve_precision
from preinfer.staged import supervised_tokens
from preinfer.visit_optimizer import VisitOptimizers
from tests.helpers.cli_run import failure_line, run_cli
from tests.helpers.trainers import drive_as_hf_trainer, live_batches, make_trainer, snapshot

VISIT = dict(blocks=3, steps_per_visit=3, lr=1e-3, order="descending", warmup_steps=1, decay="cosine")
CLIP = 0.05  # below every step's gradient norm here: each step is clipped


def trained_by_our_trainer(precision: str, clip: float = CLIP, **overrides) -> dict[str, torch.Tensor]:
    trainer = make_trainer(blocks__blocks=3, blocks__order="descending", optim__warmup_steps=1,
                           optim__decay="cosine", optim__grad_clip=clip, run__precision=precision, **overrides)
    trainer.fit()
    return snapshot(trainer.staged.model)


def trained_by_hf_block_optimizer(precision: str, clip: float = CLIP, steps: int = 9,
                                  **options) -> dict[str, torch.Tensor]:
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, precision=precision, **VISIT, **options)
    bcd.optimizer.grad_clip = clip  # what BlockCallback hands over from TrainingArguments.max_grad_norm
    drive_as_hf_trainer(bcd, live_batches(steps))
    return snapshot(model)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_the_trainer_and_the_hf_block_optimizer_end_with_bit_identical_weights(precision):
    ours, hf = trained_by_our_trainer(precision), trained_by_hf_block_optimizer(precision)
    assert ours.keys() == hf.keys()
    assert all(torch.equal(ours[name], hf[name]) for name in ours)
    initial = snapshot(build_preset("tiny-llama", seed=0))
    assert any(not torch.equal(hf[name], initial[name].to(hf[name].dtype)) for name in hf)  # it trained


@pytest.mark.parametrize("options", [
    dict(keep_state=True, block_lr="depth:0.5..1.5"), dict(name="adamw8bit", fused_step=True, block_lr="1,2,0.5"),
], ids=["kept-depth-rates", "adamw8bit-fused-listed-rates"])
def test_the_hf_block_optimizer_takes_the_same_options_and_ends_with_the_same_weights(options):
    """Two sweeps: the kept states come back at each block's second visit."""
    hf_options = {("optimizer" if key == "name" else key): value for key, value in options.items()}
    ours = trained_by_our_trainer("bf16-mixed", clip=0.0, blocks__sweeps=2,
                                  **{f"optim__{key}": value for key, value in options.items()})
    hf = trained_by_hf_block_optimizer("bf16-mixed", clip=0.0, steps=18, **hf_options)
    assert all(torch.equal(ours[name], hf[name]) for name in ours)


def test_clipping_changes_what_both_train():
    """The clip is not vacuous: without it the HF path ends elsewhere."""
    clipped, free = trained_by_hf_block_optimizer("fp32"), trained_by_hf_block_optimizer("fp32", clip=0.0)
    assert any(not torch.equal(clipped[name], free[name]) for name in clipped)


def fused_against_unfused(**overrides) -> tuple[dict, dict]:
    """The weights of two runs of two sweeps, the fused step on and off, over the same batches."""
    runs = []
    for fused in (False, True):
        trainer = make_trainer(blocks__sweeps=2, optim__fused_step=fused, **overrides)
        trainer.fit()
        runs.append(snapshot(trainer.staged.model))
    return runs[0], runs[1]


@pytest.mark.parametrize("overrides", [
    dict(run__precision="fp32"), dict(run__precision="fp32", optim__grad_accum=2),
    dict(run__precision="fp32", optim__name="adamw", optim__warmup_steps=1, optim__decay="cosine"),
    dict(run__precision="fp32", optim__name="sgd"), dict(run__precision="fp32", optim__name="adamw8bit"),
    dict(run__precision="bf16-mixed"), dict(preset="tiny-gpt2", run__precision="fp32", run__recompute=True),
    dict(preset="tiny-moe", run__precision="fp32", optim__grad_accum=2, blocks__experts="top:0.5"),
    dict(preset="tiny-moe", run__precision="bf16-mixed", blocks__experts="top:0.5"),
], ids=["adam", "accumulated", "adamw-scheduled", "sgd", "adamw8bit", "bf16-mixed", "tied-recomputed", "experts",
        "experts-bf16-mixed"])
def test_the_fused_step_equals_the_unfused_step(overrides):
    unfused, fused = fused_against_unfused(**overrides)
    initial = snapshot(build_preset(overrides.get("preset", "tiny-llama"), seed=0))
    for name in unfused:
        moved = (unfused[name].float() - initial[name].float()).abs().max()
        assert float((fused[name].float() - unfused[name].float()).abs().max()) <= 1e-6 * max(1.0, float(moved))
    assert any(not torch.equal(unfused[n], initial[n].to(unfused[n].dtype)) for n in unfused)  # it trained


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_fused_step_steps_in_backward_and_frees_each_gradient(precision):
    """After backward and before `VisitOptimizer.step`, the block's masters (the weights themselves under fp32)
    have moved, some 16-bit weights with them, and nothing holds a gradient."""
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, precision=precision, fused_step=True, **VISIT)
    optimizer = bcd.optimizer
    before = [p.detach().clone() for p in optimizer.block.params]
    masters = [m.detach().clone() for m in optimizer.active.masters]
    batch = live_batches(1)[0]
    count = torch.tensor(float(supervised_tokens(batch["labels"])))
    forward_backward(bcd.staged, batch, optimizer.block, 0, count, optimizer.current.scale_loss,
                     RouterLoss(model, bcd.staged.layers), 1, False)
    assert all(p.grad is None for p in optimizer.block.params)
    assert all(m.grad is None for m in optimizer.active.masters)
    assert all(not torch.equal(m, n) for m, n in zip(optimizer.active.masters, masters))
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(optimizer.block.params, optimizer.active.masters))
    assert any(not torch.equal(p, q) for p, q in zip(optimizer.block.params, before))
    assert optimizer.current.step()


@pytest.mark.parametrize("argv, line", [
    (["--grad-clip", "1"], "--fused-step True ([optim] fused_step): expected false with --grad-clip > 0: the "
                           "fused step steps each tensor in backward, before the global gradient norm is known"),
    (["--precision", "fp16-mixed"], "expected false with --precision fp16-mixed: the fused step steps each tensor "
                                    "in backward, before loss scaling checks every gradient"),
])
def test_the_fused_step_is_refused_where_it_cannot_apply(argv, line, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--model", "/does/not/exist", "--out", str(out), "--fused-step", *argv], capsys)
    assert code == 2 and line in failure_line(err) and not out.exists()


def test_the_fused_step_is_refused_under_a_resolved_fp16_mixed_and_handed_to_a_reducer():
    optim = OptimConfig(fused_step=True)
    with pytest.raises(UsageError, match=r"^\[optim\] fused_step = True: expected false with \[run\] precision auto, "
                                         r"resolved from the model's weights to fp16-mixed: the fused step"):
        config = Config(optim=optim, stop=StopConfig(steps_per_visit=1))
        check_resolved(config, resolve_precision("auto", torch.float16))  # the one rule, on the resolved run
    visit = VisitOptimizers(optim, Precision.FP32, "cpu").open(0, [nn.Parameter(torch.ones(2))], 1)
    reducer = lambda index: None  # noqa: E731 (what the data-parallel layout watches with at a visit's start)
    assert visit.active.watch(reducer) == visit._step_one  # the fused step, which the reducer calls after each sum
    assert visit.active.on_grad_ready is reducer


@pytest.mark.parametrize("arguments, message", [
    (dict(gradient_accumulation_steps=2), r"TrainingArguments\(gradient_accumulation_steps=2\): fused_step=True"),
    (dict(max_grad_norm=1.0), r"TrainingArguments\(max_grad_norm=1.0\): fused_step=True steps each tensor in "),
])
def test_the_hf_trainer_s_arguments_that_a_fused_step_cannot_apply_are_refused(tmp_path, arguments, message):
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, precision="fp32", fused_step=True, **VISIT)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, **arguments)
    with pytest.raises(UsageError, match=message):
        Trainer(model=model, args=args, train_dataset=[], optimizers=bcd.optimizers, callbacks=[bcd.callback])
