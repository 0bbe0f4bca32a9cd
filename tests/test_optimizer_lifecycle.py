"""One optimizer lifecycle (`preinfer.visit_optimizer`): `preinfer bcd`'s trainer and `preinfer.hf`'s
`BlockOptimizer` with its `VisitSchedule`, over the same batches and the same steps, end with bit-identical weights
(masters, clipping in fp32, loss scaling, the schedule of each visit, the state dropped at each switch). The HF
side is driven by hand as `transformers.Trainer` drives it (backward, `optimizer.step()`, `scheduler.step()`),
each micro-batch's loss computed as the trainer computes it, so that only the lifecycle is compared."""

import pytest
import torch

from preinfer.forward_backward import forward_backward
from preinfer.hf import BlockCoordinateDescent
from preinfer.moe import RouterLoss
from preinfer.presets import build_preset
from preinfer.staged import supervised_tokens
from tests.helpers.trainers import live_batches, make_trainer, snapshot

VISIT = dict(blocks=3, steps_per_visit=3, lr=1e-3, order="descending", warmup_steps=1, decay="cosine")
CLIP = 0.05  # below every step's gradient norm here: each step is clipped


def trained_by_our_trainer(precision: str) -> dict[str, torch.Tensor]:
    trainer = make_trainer(blocks__blocks=3, blocks__order="descending", optim__warmup_steps=1,
                           optim__decay="cosine", optim__grad_clip=CLIP, run__precision=precision)
    trainer.fit()
    return snapshot(trainer.staged.model)


def trained_by_hf_block_optimizer(precision: str, clip: float = CLIP) -> dict[str, torch.Tensor]:
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, precision=precision, **VISIT)
    optimizer, scheduler = bcd.optimizers
    optimizer.grad_clip = clip  # what BlockCallback hands over from TrainingArguments.max_grad_norm
    router = RouterLoss(model, bcd.staged.layers)
    for batch in live_batches(9):
        count = torch.tensor(float(supervised_tokens(batch["labels"])))
        forward_backward(bcd.staged, batch, optimizer.block, 0, count, optimizer.current.scale_loss, router, 1,
                         False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return snapshot(model)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_the_trainer_and_the_hf_block_optimizer_end_with_bit_identical_weights(precision):
    ours, hf = trained_by_our_trainer(precision), trained_by_hf_block_optimizer(precision)
    assert ours.keys() == hf.keys()
    assert all(torch.equal(ours[name], hf[name]) for name in ours)
    initial = snapshot(build_preset("tiny-llama", seed=0))
    assert any(not torch.equal(hf[name], initial[name].to(hf[name].dtype)) for name in hf)  # it trained


def test_clipping_changes_what_both_train():
    """The clip is not vacuous: without it the HF path ends elsewhere."""
    clipped, free = trained_by_hf_block_optimizer("fp32"), trained_by_hf_block_optimizer("fp32", clip=0.0)
    assert any(not torch.equal(clipped[name], free[name]) for name in clipped)
