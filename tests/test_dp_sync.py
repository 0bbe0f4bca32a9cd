"""How data-parallel replicas agree (`--dp-sync`, `preinfer.replica_sync`) and how step sync's gradients are sent
(`--grad-compression`), on two gloo ranks of one torchrun job, each mode against its one-process definition:
visit sync with a plain average ends with the mean of the replicas' independently trained blocks (each replica's
training run in one process on its shard); the outer Nesterov step moves the start by lr (1 + momentum) times
the replicas' mean change at a visit's one sync; every:1 with SGD (linear in the gradient) ends as step sync; a
run halted mid-visit and resumed ends bit-identical in each mode (PowerSGD's too), and so does one whose rank 1 was
SIGKILLed mid-visit, resumed from its last checkpoint in new processes (visit sync's in the second torchrun job; step
sync's, killed at the end of that job, in two ranks forked from this process); a resume from replicas' checkpoints
of different steps is refused in one line and changes nothing; and the bytes each rank sent, counted at the
collectives, are those of the block's tensors (compressed: bf16's, PowerSGD's factors) once a step or once a visit.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pipelines.training.placement as placement
import pipelines.training.runner as runner
from pipelines.cli import main
from preinfer.metrics import ResumeRecord, StepRecord, VisitRecord, read_metrics
from preinfer.parallel_dims import ParallelDims
from preinfer.presets import build_preset
from preinfer.run_dir import RunDir
from preinfer.seams import SingleProcess
from tests.helpers.cli_run import failure_line, tree
from tests.helpers.training_runs import forked_ranks, torchrun, weights

pytestmark = pytest.mark.distributed

BASE = ["--model", "tiny-llama", "--active", "2-3", "--seq-len", "32", "--samples-per-shard", "8",
        "--eval-fraction", "0.2", "--steps-per-visit", "4", "--lr", "1e-3", "--seed", "0", "--eval-tokens", "256",
        "--pre-inference", "off", "--batch-size", "2", "--grad-clip", "0"]
SGD = ["--optimizer", "sgd", "--lr", "0.1"]
OUTER = ["--outer-lr", "0.7", "--outer-momentum", "0.9"]
RUNS = {  # name: flags (each run one sweep of one 4-step visit of layers 2-3)
    "sgd-step": [*SGD, "--dp-sync", "step"],
    "sgd-every-1": [*SGD, "--dp-sync", "every:1"],
    "visit": ["--dp-sync", "visit"],
    "visit-outer": ["--dp-sync", "visit", *OUTER],
    "every-2-outer": ["--dp-sync", "every:2", *OUTER],
    "sgd-bf16": [*SGD, "--grad-compression", "bf16"],
    "sgd-powersgd": [*SGD, "--grad-compression", "powersgd:2"],
}
RESUMED = {"sgd-step": 2, "every-2-outer": 3, "sgd-powersgd": 2}  # halted after this step (every:2: after its first
# sync, the outer step's anchor, momentum and step count in each replica's checkpoint; PowerSGD: its Q and errors)
KILLED = (1, 3)  # "visit" and "sgd-step" again, checkpointed every 2 steps: rank 1 SIGKILLed at the forward of step 3


def bcd(corpus: str, out: Path, *flags: str) -> list[str]:
    return ["bcd", *BASE, "--data", corpus, *flags, "--out", str(out)]


def resume(out: Path) -> list[str]:
    return ["bcd", "--out", str(out), "--resume"]


def mixed_steps(tmp: Path) -> RunDir:
    """A copy of the finished "visit" run whose replica 1 holds the killed run's step-2 checkpoint (as a rank
    killed in its last save leaves its previous one), and a copy of that in `mixed-steps-before`."""
    mixed = RunDir(tmp / "mixed-steps")
    shutil.copytree(tmp / "visit", mixed.path)
    shutil.rmtree(mixed.replica_checkpoint(1))
    shutil.copytree(RunDir(tmp / "visit-killed").replica_checkpoint(1), mixed.replica_checkpoint(1))
    shutil.copytree(mixed.path, tmp / "mixed-steps-before")
    return mixed


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, corpus) -> Path:
    """Every RUNS entry on two ranks, then "visit" killed (KILLED), whose job fails by the kill; in a second job that
    run resumed, the mixed-steps run's resume refused, the RESUMED ones again, halted mid-visit and resumed, and
    "sgd-step" killed, resumed in two ranks forked from this process."""
    tmp = tmp_path_factory.mktemp("dp-sync")
    killed = {name: bcd(corpus, tmp / f"{name}-killed", *RUNS[name], "--checkpoint-every", "2")
              for name in ("visit", "sgd-step")}
    torchrun(tmp, 2, [*(bcd(corpus, tmp / name, *flags) for name, flags in RUNS.items()), killed["visit"]], kill=KILLED)
    runs, halts = [resume(tmp / "visit-killed"), resume(mixed_steps(tmp).path)], {}
    two_blocks = [*BASE[:2], *BASE[4:], "--blocks", "2"]  # BASE without --active 2-3: layers 0-1, then 2-3
    runs.append(["bcd", *two_blocks, "--data", corpus, "--dp-sync", "visit", "--out", str(tmp / "visit-expanded")])
    for name, step in RESUMED.items():
        halts[len(runs)] = step
        runs.append(bcd(corpus, tmp / f"{name}-resumed", *RUNS[name]))
        runs.append(resume(tmp / f"{name}-resumed"))
    refused = {1: 1}  # the mixed-steps resume: exit code 1, as a checkpoint that cannot be resumed from has
    torchrun(tmp, 2, [*runs, killed["sgd-step"]], halts=halts, refused=refused, kill=KILLED)
    forked_ranks(2, resume(tmp / "sgd-step-killed"))
    return tmp


def replica_alone(monkeypatch, corpus: str, out: Path, replica: int) -> dict[str, torch.Tensor]:
    """The visit-sync run's replica `replica` of 2 trained in one process: its shard of the batches, no sync."""
    monkeypatch.setattr(runner, "parallel_dims", lambda pipeline, device: ParallelDims(data=2, rank=replica))
    monkeypatch.setattr(placement, "replica_seams", lambda staged, config, dims: SingleProcess(staged, config))
    assert main(bcd(corpus, out, *RUNS["visit"])) == 0
    return weights(str(out))


def block_tensors(initial: dict[str, torch.Tensor]) -> list[str]:
    """The tensors of the active block: layers 2-3, with the final norm and the head (the last block's)."""
    return [name for name in initial if ".layers.2." in name or ".layers.3." in name or "layers" not in name
            and "embed" not in name]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_visit_sync_with_a_plain_average_is_the_mean_of_the_replicas_trained_apart(two_ranks, corpus, tmp_path,
                                                                                    monkeypatch):
    synced = weights(str(two_ranks / "visit"))
    apart = [replica_alone(monkeypatch, corpus, tmp_path / f"replica-{r}", r) for r in (0, 1)]
    initial = build_preset("tiny-llama", seed=0).state_dict()
    trained = [name for name in synced if not torch.equal(synced[name], initial[name])]
    assert set(trained) == set(block_tensors(initial))
    assert not torch.equal(apart[0][trained[0]], apart[1][trained[0]])  # the replicas did train apart
    for name in synced:
        assert relative(synced[name], (apart[0][name] + apart[1][name]) / 2) <= 1e-6, name


def test_the_outer_nesterov_step_moves_the_start_by_lr_1_plus_momentum_times_the_mean_change(two_ranks):
    """One sync (a visit's) from a fresh momentum: anchor - lr (g + mu g), g = anchor - the replicas' mean."""
    mean, outer = weights(str(two_ranks / "visit")), weights(str(two_ranks / "visit-outer"))
    initial = build_preset("tiny-llama", seed=0).state_dict()
    for name, start in initial.items():
        expected = start - 0.7 * 1.9 * (start - mean[name])
        assert relative(outer[name], expected) <= 1e-5, name


def test_every_step_averaging_with_sgd_ends_as_step_sync(two_ranks):
    """SGD's step is linear in the gradient: the mean of the replicas' steps is the step of the mean gradient."""
    every, step = weights(str(two_ranks / "sgd-every-1")), weights(str(two_ranks / "sgd-step"))
    initial = build_preset("tiny-llama", seed=0).state_dict()
    assert any(not torch.equal(step[name], initial[name]) for name in step)
    for name in step:
        assert relative(every[name], step[name]) <= 1e-6, name


@pytest.mark.parametrize("name", ["visit", "sgd-step"])
def test_a_run_whose_rank_was_killed_mid_visit_resumes_from_its_last_checkpoint_with_nothing_lost(two_ranks, name):
    """The job failed at step 3 (its last checkpoint: step 2's, each replica's own); the resumed job's steps 3 and 4
    and the visit's end are the uninterrupted run's, its weights bit for bit."""
    killed, whole = RunDir(two_ranks / f"{name}-killed"), RunDir(two_ranks / name)
    records, uninterrupted = read_metrics(killed.metrics), read_metrics(whole.metrics)
    assert [r.step for r in records if isinstance(r, ResumeRecord)] == [2]
    steps = [(r.step, r.loss) for r in records if isinstance(r, StepRecord)]
    assert steps == [(r.step, r.loss) for r in uninterrupted if isinstance(r, StepRecord)] and len(steps) == 4
    assert [r.eval_loss for r in records if isinstance(r, VisitRecord)] == [
        r.eval_loss for r in uninterrupted if isinstance(r, VisitRecord)]
    resumed, reference = weights(str(killed.path)), weights(str(whole.path))
    assert set(resumed) == set(reference) and all(torch.equal(resumed[k], v) for k, v in reference.items())
    replica = load_file(str(killed.replica_checkpoint(1) / "model.safetensors"))
    assert all(torch.equal(replica[k], v) for k, v in reference.items())


def test_replicas_checkpoints_of_different_steps_are_refused_in_one_line_and_left_as_they_were(two_ranks):
    """Replica 0's checkpoint is of step 4, replica 1's of step 2: each rank's resume fails with one line naming
    the run directory and the steps, before anything is written."""
    mixed = two_ranks / "mixed-steps"
    stderr = sorted(two_ranks.glob("refused-*-rank-*.txt"))  # the run's, on each rank
    assert len(stderr) == 2
    for printed in stderr:
        assert failure_line(printed.read_text()) == (f"preinfer bcd: error: the replicas' checkpoints in {mixed} are "
                                                     f"of different steps (2 to 4); the run cannot resume from them")
    assert tree(mixed) == tree(two_ranks / "mixed-steps-before")


@pytest.mark.parametrize("name", list(RESUMED))
def test_a_run_resumed_mid_visit_ends_bit_identical_in_each_mode(two_ranks, name):
    resumed, whole = weights(str(two_ranks / f"{name}-resumed")), weights(str(two_ranks / name))
    assert set(resumed) == set(whole) and all(torch.equal(resumed[k], v) for k, v in whole.items())
    assert (RunDir(two_ranks / f"{name}-resumed").replica_checkpoint(1) / "state.json").is_file()  # its own


def test_visit_sync_with_lowrank_expansion_ends_with_the_same_weights_on_every_replica(two_ranks):
    """Two visits, the first expanding the layers above its block (`--expand auto`: lowrank), whose factors the
    replicas average with the block; after the last visit's sync both replicas' checkpoints hold one model."""
    run = RunDir(two_ranks / "visit-expanded")
    visits = [r for r in read_metrics(run.metrics) if isinstance(r, VisitRecord)]
    assert [(v.block, v.expand) for v in visits] == [(0, "lowrank"), (1, None)]
    replica = load_file(str(run.replica_checkpoint(1) / "model.safetensors"))
    zero = weights(str(run.path))
    assert set(zero) == set(replica) and all(torch.equal(zero[k], replica[k]) for k in zero)


def test_compressed_gradients_send_fewer_bytes_and_train(two_ranks):
    """bf16 sends the block's gradients in 2 bytes each; PowerSGD at rank 2 sends P (n x 2) and Q (m x 2) of each
    matrix it compresses ((n + m) 2 < n m) and the others whole; both move the block as step sync does, roughly."""
    initial = build_preset("tiny-llama", seed=0).state_dict()
    shapes = [initial[name].shape for name in block_tensors(initial)]
    elements = sum(shape.numel() for shape in shapes)
    factors = sum((s[0] + s[1]) * 2 if len(s) == 2 and (s[0] + s[1]) * 2 < s.numel() else s.numel() for s in shapes)
    step = weights(str(two_ranks / "sgd-step"))
    for name, per_step in (("sgd-bf16", 2 * elements + 12), ("sgd-powersgd", 4 * factors + 12)):
        records = read_metrics(RunDir(two_ranks / name).metrics)
        assert [r.sent_bytes for r in records if isinstance(r, StepRecord)] == [per_step] * 4, name
        compressed = weights(str(two_ranks / name))
        for tensor in block_tensors(initial):
            moved = (step[tensor] - initial[tensor]).norm()
            assert (compressed[tensor] - step[tensor]).norm() < moved, (name, tensor)


def test_the_bytes_sent_are_the_blocks_once_a_step_or_once_a_visit(two_ranks):
    """Per step, step sync sends the block's fp32 gradients (a 2-rank all-reduce sends each rank's whole tensor
    once) and three scalars (the stop agreement, the token count, the loss); visit sync two scalars a step, and
    the block once at the visit's end; every:2 the block at steps 2 and 4."""
    initial = build_preset("tiny-llama", seed=0).state_dict()
    block = sum(initial[name].numel() for name in block_tensors(initial)) * 4
    for name, per_step, syncs in (("sgd-step", block + 12, 0), ("visit", 8, 1), ("every-2-outer", 8, 2)):
        records = read_metrics(RunDir(two_ranks / name).metrics)
        steps = [r.sent_bytes for r in records if isinstance(r, StepRecord)]
        visits = [r.sent_bytes for r in records if isinstance(r, VisitRecord)]
        expected_steps = [per_step] * 4
        if name == "every-2-outer":
            expected_steps = [8, 8 + block, 8, 8 + block]
        assert steps == expected_steps and visits == [sum(steps) + (block if name == "visit" else 0)], name
