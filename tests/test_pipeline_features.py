"""Every feature on a pipeline of 2 (issue 44 part 5), each against the same run in one process (invariant 10:
float32, relative 1e-5): frozen weights in int8 and nf4 on each stage, landscape expansion (lowrank and sgd) over
the suffix layers each stage holds, the fused step, fp16-mixed's loss scaling agreed across the stages (asked for,
and resolved by auto from float16 weights), kept optimizer state, adamw8bit and pre-inference on and auto. All pipeline runs are one torchrun job of 2 gloo processes; the
one-process references read the same samples in the same micro-batches (`--batch-size 2 --grad-accum 2` against
`--batch-size 4 --microbatches 2`), as tests/test_pipeline.py's do.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipelines.cli import main
from pipelines.data.tokenizers import ByteTokenizer
from preinfer.metrics import CacheRecord, StepRecord, VisitRecord, read_metrics
from preinfer.precision import LossScaler
from preinfer.presets import build_preset
from preinfer.run_dir import RunDir
from tests.helpers.training_runs import assert_close, torchrun, weights

BASE = ["--model", "tiny-llama", "--blocks", "2", "--seq-len", "32", "--samples-per-shard", "8",
        "--eval-fraction", "0.2", "--sweeps", "2", "--steps-per-visit", "2", "--lr", "1e-3", "--seed", "0",
        "--eval-tokens", "256", "--pre-inference", "off"]
RUNS = {  # name: flags of a pipeline run and of its one-process reference
    "int8": ["--frozen-dtype", "int8", "--fused-step", "--expand", "none"],
    "nf4": ["--frozen-dtype", "nf4", "--optimizer", "adamw8bit", "--fused-step", "--expand", "none",
            "--pre-inference", "on"],
    "lowrank": ["--expand", "lowrank", "--fused-step", "--optimizer", "adamw8bit"],
    "sgd": ["--expand", "sgd", "--expand-lr", "1e-2", "--keep-optimizer-state", "--pre-inference", "auto"],
    "fp16": ["--precision", "fp16-mixed", "--expand", "lowrank", "--pre-inference", "on"],
    "fp16-auto": ["--model", "{float16}", "--precision", "auto"],  # resolved to fp16-mixed from the weights' dtype
}
RESUMED = {"int8": None, "lowrank": 1}  # halted after this global step (None: after one sweep), then resumed


def run(corpus: str, float16: Path, name: str, out: Path, *flags: str) -> list[str]:
    """The command of run `name` (`float16`: the directory of a model in float16 weights)."""
    given = [flag.format(float16=float16) for flag in RUNS[name]]
    return ["bcd", *BASE, "--data", corpus, *given, *flags, "--out", str(out)]


@pytest.fixture(scope="module")
def float16(tmp_path_factory) -> Path:
    """tiny-llama saved in float16, with its tokenizer."""
    model_dir = tmp_path_factory.mktemp("float16") / "model"
    build_preset("tiny-llama", seed=0).to(torch.float16).save_pretrained(model_dir)
    ByteTokenizer().save(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory, corpus, float16) -> Path:
    """Every RUNS entry on a pipeline of 2 stages, and the RESUMED ones halted and resumed: int8 after its first
    sweep, lowrank after step 1, mid-visit of block 0, whose factors on the stage holding layers above it the
    stage's checkpoint carries."""
    tmp = tmp_path_factory.mktemp("features2")
    pipeline = ["--batch-size", "4", "--pipeline", "2", "--microbatches", "2"]
    runs, halts = [run(corpus, float16, name, tmp / name, *pipeline) for name in RUNS], {}
    for name, step in RESUMED.items():
        out = tmp / f"{name}-resumed"
        if step is None:
            runs.append(run(corpus, float16, name, out, *pipeline, "--sweeps", "1"))
        else:
            halts[len(runs)] = step
            runs.append(run(corpus, float16, name, out, *pipeline))
        runs.append(["bcd", "--out", str(out), "--resume", "--sweeps", "2"])
    torchrun(tmp, 2, runs, halts=halts)
    return tmp


def one_process(corpus: str, float16: Path, name: str, out: Path) -> dict[str, torch.Tensor]:
    assert main(run(corpus, float16, name, out, "--batch-size", "2", "--grad-accum", "2")) == 0
    return weights(str(out))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RUNS))
def test_each_feature_on_two_stages_ends_with_the_weights_of_one_process(two_stages, corpus, float16, tmp_path,
                                                                         name):
    pipeline, single = weights(str(two_stages / name)), one_process(corpus, float16, name, tmp_path / "one")
    assert set(pipeline) == set(single)
    assert_close(pipeline, single)
    exported = AutoModelForCausalLM.from_pretrained(two_stages / name / "export").state_dict()
    assert all(torch.equal(exported[key], value) for key, value in pipeline.items() if key in exported)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_a_resumed_run_ends_bit_identical_to_the_uninterrupted_one(two_stages, name):
    resumed, whole = weights(str(two_stages / f"{name}-resumed")), weights(str(two_stages / name))
    assert set(resumed) == set(whole) and all(torch.equal(resumed[k], v) for k, v in whole.items())


def stage_weights(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(run_dir / "checkpoint" / f"stage-{j}" / "model.safetensors")) for j in range(2)]


@pytest.mark.distributed
@pytest.mark.slow
def test_frozen_weights_checkpoint_masters_and_every_layer_trains(two_stages):
    """Each stage's checkpoint and the gathered weights hold float32 masters (never codes), and every layer's
    linears changed from the preset's (both blocks trained through their visits' masters)."""
    initial = build_preset("tiny-llama").state_dict()
    for name in ("int8", "nf4"):
        for held in stage_weights(two_stages / name):
            assert all(t.dtype == torch.float32 for t in held.values())
        gathered = weights(str(two_stages / name))
        linears = [k for k in gathered if k.endswith("proj.weight")]
        assert linears and all(not torch.equal(gathered[k], initial[k]) for k in linears)


@pytest.mark.distributed
@pytest.mark.slow
def test_expansion_updates_the_suffix_that_each_stage_holds(two_stages):
    """Block 0's visits (layers 0-1) expand layers 2-3: on stage 1 when the stages cut 0-1 | 2-3 (or across
    both), so the top layers end unlike a run without expansion, and the stage above holds optimizer state."""
    for name in ("lowrank", "sgd"):
        block0 = [r for r in read_metrics(RunDir(two_stages / name).metrics)
                  if isinstance(r, VisitRecord) and r.block == 0]
        assert block0 and all(r.expand == name for r in block0)
        assert all(sum(rank["optimizer"] for rank in r.ranks) > 0 for r in block0)


@pytest.mark.distributed
@pytest.mark.slow
def test_fp16_on_two_stages_scales_the_loss_and_makes_its_stores(two_stages):
    """The loss scale every step reports is the one scaler's, the same as one process's (the weights test), and
    pre-inference made its stores through the stages."""
    for name in ("fp16", "fp16-auto"):
        steps = [r for r in read_metrics(RunDir(two_stages / name).metrics) if isinstance(r, StepRecord)]
        assert steps and all(r.loss_scale is not None and r.loss_scale >= 1 for r in steps)
    records = read_metrics(RunDir(two_stages / "fp16").metrics)
    assert [r.boundary for r in records if isinstance(r, CacheRecord) and r.how == "input"]


def test_agreed_loss_scaling_skips_and_scales_as_grad_scaler_does():
    """A stage's scaler with `agree` (its found-inf combined with every other stage's) against torch's GradScaler
    over the same gradients: the same weights, scale, growth count and skipped steps; a stage holding none of the
    step's gradients keeps that same scale, and one whose own gradients are finite skips where another's are not."""
    gradients = [1.0, float("inf"), 2.0, 3.0, 4.0, float("nan"), 5.0]

    def stepper(agree=None, params=True):
        weight = torch.nn.Parameter(torch.zeros(3))
        scaler = LossScaler(growth_interval=2)
        scaler.agree = agree
        return weight, scaler, torch.optim.SGD([{"params": [weight] if params else []}], lr=0.1)

    reference, agreed, empty = stepper(), stepper(lambda found: None), stepper(params=False)
    told = stepper()  # its own gradients finite; another stage's not where the reference's are not
    for step, gradient in enumerate(gradients):
        empty[1].agree = lambda found, g=gradient: found.fill_(float(not torch.isfinite(torch.tensor(g))))
        told[1].agree = empty[1].agree
        for weight, scaler, optimizer in (reference, agreed, told):
            scaler.scale_loss(torch.ones(()))
            own = 1.0 if scaler is told[1] else gradient
            weight.grad = torch.full((3,), own) * scaler.scale
        for weight, scaler, optimizer in (reference, agreed, empty, told):
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            optimizer.zero_grad()
        assert agreed[1].state_dict() == empty[1].state_dict() == told[1].state_dict() == reference[1].state_dict()
        assert torch.equal(agreed[0], reference[0]), step
    assert reference[1].skipped == 2 and reference[1].scale != 2.0**16
