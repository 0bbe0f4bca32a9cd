"""Pipeline-parallel BCD (`bcd --pipeline N`): stages, refusals, and whole runs under torchrun (gloo) against
one process.

The single-process reference reads the same samples in the same micro-batches (`--batch-size B/M --grad-accum
M` against `--batch-size B --microbatches M`): a pipeline sums each micro-batch's gradients as gradient
accumulation does. Against one process running each whole batch at once the float32 sums differ in the last
bits, which Adam turns into relative differences of up to 3e-5 here (a GPT-2 key bias, whose true gradient is
zero, steps on rounding noise alone: up to 5e-4).
"""

import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipelines.cli import main
from pipelines.pipeline_parallel.placement import PipelinePlacement, run_stages
from preinfer.parallel_dims import ParallelDims
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import resolve_shape
from preinfer.metrics import CacheRecord, PreInferenceRecord, SweepPlanRecord, VisitRecord, read_metrics
from preinfer.presets import build_preset
from preinfer.run_dir import RunDir
from preinfer.memory.stage_cut import cut_stages, stage_cost
from tests.helpers.training_runs import assert_close, cache_and_model, torchrun, weights

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--seq-len", "32", "--samples-per-shard", "8", "--eval-fraction", "0.2", "--sweeps", "2",
          "--steps-per-visit", "2", "--lr", "1e-3", "--seed", "0", "--pre-inference", "off", "--eval-tokens", "256",
          "--expand", "none"]
STORE_RUN = ["--steps-per-visit", "2", "--lr", "1e-3", "--blocks", "2", "--seed", "0", "--eval-tokens", "256",
             "--expand", "none"]
RUNS = {  # name: (model, blocks, more flags); each runs at --batch-size 4 --pipeline 2 --microbatches 2
    "llama": ("tiny-llama", "4", []),
    "gpt2": ("tiny-gpt2", "2", []),  # the tied wte = lm_head on both end stages, owned by block 0
    "on": ("tiny-llama", "2", ["--pre-inference", "on"]),  # block 1 (layers 2-3) from a store at boundary 2
}


PLAN = ["plan", "--model", "tiny-llama", "--seq-len", "32", "--micro-batch", "2", "--memory-budget", "2.2MiB"]
TORCHRUN = ["torchrun", "--nproc-per-node", "2", "-m", "pipelines.cli"]


def planned_command() -> list[str]:
    """The command line `preinfer plan` prints for a budget that only a pipeline of 2 fits."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(PLAN) == 0
    line = next(line for line in out.getvalue().splitlines() if line.startswith("run it: "))
    return shlex.split(line.removeprefix("run it: "))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, corpus):
    """Every RUNS entry on a pipeline of 2 stages, `train --store` from a cache at boundary 1 on 2 stages, and
    the command `preinfer plan` prints (its arguments after `torchrun --nproc-per-node 2 -m pipelines.cli`, with
    a small corpus and step budget appended), in one job of 2 processes; returns (directory, torchrun's
    stdout)."""
    tmp = tmp_path_factory.mktemp("pipeline2")
    runs = [["bcd", "--model", model, "--blocks", blocks, "--data", corpus, *COMMON, *more, "--batch-size", "4",
             "--pipeline", "2", "--microbatches", "2", "--out", str(tmp / name)]
            for name, (model, blocks, more) in RUNS.items()]
    first_sweep = ["bcd", "--model", "tiny-llama", "--blocks", "4", "--data", corpus, *COMMON, "--batch-size", "4",
                   "--pipeline", "2", "--out", str(tmp / "resumed")]
    runs += [[*first_sweep, "--sweeps", "1"], ["bcd", "--out", str(tmp / "resumed"), "--resume", "--sweeps", "2"]]
    model_dir, store = cache_and_model(tmp, corpus, boundary=1)
    runs.append(["train", "--store", store, "--model", model_dir, *STORE_RUN, "--batch-size", "4", "--pipeline", "2",
                 "--out", str(tmp / "store")])
    command = planned_command()
    assert command[:len(TORCHRUN)] == TORCHRUN
    runs.append([*command[len(TORCHRUN):], "--data", corpus, "--samples-per-shard", "8", "--eval-fraction", "0.2",
                 "--eval-tokens", "256", "--steps-per-visit", "1", "--out", str(tmp / "planned")])
    done = torchrun(tmp, 2, runs)
    return tmp, done.stdout


@pytest.mark.distributed
def test_the_command_plan_prints_runs_on_the_pipeline_it_recommends(two_ranks):
    tmp, _ = two_ranks
    records = visits(tmp / "planned")
    assert len(records) == 3 and {rank["stage"] for rank in records[0].ranks} == {0, 1}  # 3 blocks, 2 stages


def one_process(tmp: Path, corpus: str, model: str, blocks: str, more: list[str], name: str) -> dict[str, torch.Tensor]:
    """The same run in one process, over the same micro-batches (batch 2, two accumulated per step)."""
    assert main(["bcd", "--model", model, "--blocks", blocks, "--data", corpus, *COMMON, *more, "--batch-size", "2",
                 "--grad-accum", "2", "--out", str(tmp / name)]) == 0
    return weights(str(tmp / name))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RUNS))
def test_a_two_stage_pipeline_ends_with_the_weights_of_one_process(two_ranks, corpus, tmp_path, name):
    tmp, _ = two_ranks
    model, blocks, more = RUNS[name]
    pipeline = weights(str(tmp / name))
    single = one_process(tmp_path, corpus, model, blocks, more, "one")
    assert set(pipeline) == set(single)
    assert_close(pipeline, single)
    exported = AutoModelForCausalLM.from_pretrained(tmp / name / "export")  # gathered from both stages
    for key, value in exported.state_dict().items():
        if key in pipeline:
            assert torch.equal(value, pipeline[key]), key


@pytest.mark.distributed
def test_a_resumed_pipeline_run_ends_as_an_uninterrupted_one(two_ranks):
    """Each stage resumes from its own checkpoint (`checkpoint/stage-J/`): one sweep, then --resume for the
    second, against the llama run of two sweeps."""
    tmp, _ = two_ranks
    resumed = weights(str(tmp / "resumed"))
    assert all(torch.equal(resumed[k], v) for k, v in weights(str(tmp / "llama")).items())
    assert sorted(p.name for p in (tmp / "resumed" / "checkpoint").iterdir()) == [
        "model.safetensors", "stage-0", "stage-1"]


@pytest.mark.distributed
def test_training_from_a_store_on_two_stages_equals_one_process(two_ranks, tmp_path):
    """The store feeds the first stage (layers 1.. of a cache at boundary 1); the export adds the prefix from
    the model directory."""
    tmp, _ = two_ranks
    assert main(["train", "--store", str(tmp / "cache"), "--model", str(tmp / "model"), *STORE_RUN,
                 "--batch-size", "2", "--grad-accum", "2", "--out", str(tmp_path / "one")]) == 0
    pipeline, single = weights(str(tmp / "store")), weights(str(tmp_path / "one"))
    assert set(pipeline) == set(single) and not any(k.startswith("model.embed_tokens") for k in pipeline)
    assert_close(pipeline, single)
    exported = AutoModelForCausalLM.from_pretrained(tmp / "store" / "export").state_dict()
    assert torch.equal(exported["model.layers.3.mlp.up_proj.weight"], pipeline["model.layers.3.mlp.up_proj.weight"])
    assert "model.embed_tokens.weight" in exported


def visits(run: Path) -> list[VisitRecord]:
    return [r for r in read_metrics(RunDir(run).metrics) if isinstance(r, VisitRecord)]


@pytest.mark.distributed
def test_stages_do_only_what_they_must_and_hold_only_their_layers(two_ranks):
    """tiny-llama in 4 blocks on stages embed+layer 0 | layers 1-3+head: the last block's visits leave stage 0
    below it (forward only: nothing saved for backward, no gradient, no optimizer state), block 0's visits leave
    stage 1 above it (input gradients only: no weight gradient, no optimizer state)."""
    tmp, stdout = two_ranks
    run = tmp / "llama"
    records = visits(run)
    assert len(records) == 8 and all(len(r.ranks) == 2 for r in records)
    for record in records:
        below, above = record.ranks
        assert (below["stage"], above["stage"]) == (0, 1)
        if record.block == 3:
            assert below["activations"] == below["grads"] == below["optimizer"] == 0
            assert above["activations"] > 0 and above["optimizer"] > 0
        if record.block == 0:
            assert above["grads"] == above["optimizer"] == 0 and above["activations"] > 0
            assert below["grads"] > 0 and below["optimizer"] > 0
    total = sum(p.numel() * 4 for p in build_preset("tiny-llama").parameters())
    held = [rank["params"] for rank in records[0].ranks]
    assert sum(held) == total and max(held) < total
    stage0 = load_file(str(run / "checkpoint" / "stage-0" / "model.safetensors"))
    stage1 = load_file(str(run / "checkpoint" / "stage-1" / "model.safetensors"))
    assert not set(stage0) & set(stage1)
    assert all(k.startswith(("model.embed_tokens", "model.layers.0.")) for k in stage0)
    assert stdout.count("final eval loss") == len(RUNS) + 4  # one rank reports


@pytest.mark.distributed
def test_with_pre_inference_the_stages_make_the_store_and_those_below_it_idle(two_ranks):
    """tiny-llama in 2 blocks on stages embed+layer 0 | layers 1-3+head: block 1 reads a store at boundary 2,
    which stage 0 (forward) and stage 1 (layer 1, writing) made; while block 1 trains, stage 0 runs nothing."""
    tmp, stdout = two_ranks
    records = read_metrics(RunDir(tmp / "on").metrics)
    made = [r for r in records if isinstance(r, CacheRecord) and r.how == "input"]
    assert [r.boundary for r in made] == [2, 2] and all(r.bytes > 0 for r in made)  # made again in sweep 1
    for record in (r for r in records if isinstance(r, VisitRecord) and r.block == 1):
        assert record.source_boundary == 2
        idle = record.ranks[0]
        assert idle["stage"] == 0 and idle["activations"] == idle["grads"] == idle["optimizer"] == 0
    assert "stage(s) 0-0 below it run nothing this visit" in stdout


def store_lifecycle(run_dir: Path) -> tuple[list, list, list]:
    """What pre-inference decided in a run, without its timings: each sweep's first plan (the stores it reads and
    how each is made), each visit's decision, and every store made, reused or deleted, and why."""
    records = read_metrics(RunDir(run_dir).metrics)
    plans = [(r.sweep, r.chosen, r.sources, [(b["boundary"], b["from"], b["before_visit"]) for b in r.builds])
             for r in records if isinstance(r, SweepPlanRecord) and r.reason == "sweep start"]
    visits = [(r.block, r.boundary, r.decision, r.build_from) for r in records if isinstance(r, PreInferenceRecord)]
    stores = [(r.boundary, r.how, r.from_, r.reason) for r in records if isinstance(r, CacheRecord)]
    return plans, visits, stores


@pytest.mark.distributed
def test_pre_inference_on_a_pipeline_plans_makes_and_deletes_the_stores_one_process_does(two_ranks, corpus,
                                                                                         tmp_path):
    """One executor for both layouts: the pipeline's plans and stores (made, reused, deleted, and why) are those
    of one process for the same run."""
    tmp, _ = two_ranks
    model, blocks, more = RUNS["on"]
    one_process(tmp_path, corpus, model, blocks, more, "one")
    pipeline = store_lifecycle(tmp / "on")
    assert pipeline == store_lifecycle(tmp_path / "one")
    plans, visits, stores = pipeline
    assert [sources for _, _, sources, _ in plans] == [[0, 2], [0, 2]]
    assert [decision for _, _, decision, _ in visits] == ["store", "store"]
    assert stores == 2 * [(2, "input", 0, None), (2, "reuse", None, None),  # made before the visit, which reads it
                          (2, "deleted", None, "the plan reads it no more")]


@pytest.mark.distributed
def test_the_tied_weight_is_one_tensor_on_both_end_stages(two_ranks):
    tmp, _ = two_ranks
    stage0 = load_file(str(tmp / "gpt2" / "checkpoint" / "stage-0" / "model.safetensors"))
    stage1 = load_file(str(tmp / "gpt2" / "checkpoint" / "stage-1" / "model.safetensors"))
    shared = set(stage0) & set(stage1)
    assert shared == {"transformer.wte.weight"}
    assert torch.equal(stage0["transformer.wte.weight"], stage1["transformer.wte.weight"])
    assert not torch.equal(stage0["transformer.wte.weight"],
                           build_preset("tiny-gpt2").transformer.wte.weight.detach())  # it trained


def bcd(tmp_path: Path, corpus: str, *flags: str) -> list[str]:
    return ["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--out", str(tmp_path / "r"),
            *flags]


@pytest.mark.parametrize("flags, expected", [
    (["--pipeline", "2", "--batch-size", "4", "--microbatches", "3"],
     "--microbatches 3 ([run] microbatches): expected a divisor of --batch-size 4"),
    (["--pipeline", "5", "--microbatches", "4", "--pipeline-schedule", "gpipe"], "--pipeline 5: more stages than the model's 4 layers"),
    (["--pipeline", "2"], "--pipeline 2 does not divide the world size 1"),
])
def test_bad_pipeline_input_is_one_line_and_exit_2(tmp_path, corpus, capsys, flags, expected):
    assert main(bcd(tmp_path, corpus, *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err
    assert not (tmp_path / "r").exists()


def test_stages_are_contiguous_with_the_ends_and_minimise_the_largest_stage():
    """Against every contiguous cut of medium-llama's 12 layers into 3 stages."""
    shape = resolve_shape("medium-llama")
    settings = Settings(seq_len=128, micro_batch=2)
    blocks = partition(shape, 4)
    stages = cut_stages(shape, settings, 3, blocks, microbatches=4)
    assert [s.start for s in stages][0] == 0 and stages[-1].stop == shape.layers
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    assert [(s.embed, s.head) for s in stages] == [(True, False), (False, False), (False, True)]

    def largest(cut):
        return max(stage_cost(shape, settings, s, j, 3, blocks, 4, "1f1b") for j, s in enumerate(cut))

    Block = type(stages[0])
    cuts = [[Block(0, a, True, False), Block(a, b, False, False), Block(b, shape.layers, False, True)]
            for a in range(1, shape.layers - 1) for b in range(a + 1, shape.layers)]
    assert largest(stages) == min(largest(cut) for cut in cuts)
    assert largest(stages) < largest(partition(shape, 3)) or stages == partition(shape, 3)


def test_gpipe_keeps_every_micro_batch_in_flight_and_1f1b_fewer():
    shape = resolve_shape("tiny-llama")
    settings = Settings(seq_len=32, micro_batch=1)
    blocks = partition(shape, 2)
    stage = cut_stages(shape, settings, 2, blocks, 8, "1f1b")[0]
    gpipe = stage_cost(shape, settings, stage, 0, 2, blocks, 8, "gpipe")
    one_f_one_b = stage_cost(shape, settings, stage, 0, 2, blocks, 8, "1f1b")
    assert gpipe > one_f_one_b


def test_more_stages_than_layers_is_refused():
    with pytest.raises(UsageError, match="more stages than the model's 4 layers"):
        cut_stages(resolve_shape("tiny-llama"), Settings(), 5, partition(resolve_shape("tiny-llama"), 2), 5)


def test_the_fused_step_is_refused_with_replicas_of_a_pipeline_before_any_load():
    """Their gradients are summed after backward; one replica (world size = stages) runs it."""
    config = Config()
    config.model.name, config.optim.fused_step, config.run.pipeline = "tiny-llama", True, 2
    config.data.batch_size, config.stop.steps_per_visit = 4, 2
    plan = run_stages(config)
    PipelinePlacement(config, ParallelDims(data=1, pipeline=2), plan)
    with pytest.raises(UsageError, match=r"^--fused-step steps each tensor .* before the 2 replicas sum the grad"):
        PipelinePlacement(config, ParallelDims(data=2, pipeline=2), plan)
