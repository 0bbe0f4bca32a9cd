"""A pipeline x data mesh (`bcd --pipeline 2` under torchrun with 4 processes: 2 replicas of a 2-stage pipeline)
against one process reading both replicas' batches (invariant 10), in float32 and with the features whose sums
cross the replicas: fp16-mixed's found-inf agreed over every stage and replica with the low-rank factors' gradients
summed, and the sgd expansion's step summed over each stage's replicas; and the plain run halted mid-visit and
resumed, each replica from its own checkpoints (its own data cursor).
"""

from pathlib import Path

import json

import pytest
import torch

import preinfer
from pipelines.data.batches import token_batches
from pipelines.training import load_datasets, partition_for, train
from preinfer.batch_source import LiveSources
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.metrics import VisitRecord, read_metrics
from preinfer.parallel_dims import ParallelDims, check_degrees
from preinfer.presets import build_preset
from preinfer.run_dir import RunDir
from tests.helpers.training_runs import assert_close, torchrun, weights

COMMON = ["--seq-len", "32", "--samples-per-shard", "8", "--eval-fraction", "0.2", "--sweeps", "2",
          "--steps-per-visit", "2", "--lr", "1e-3", "--seed", "0", "--pre-inference", "off", "--eval-tokens", "256",
          "--expand", "none"]


class ReplicaMicroBatches:
    """One process reading what the replicas of a pipeline read, in their micro-batches: replica 0's batch's
    halves, then replica 1's (grad_accum 4 makes one step of them)."""

    def __init__(self, dataset, batch_size: int, samples_per_shard: int, replicas: int = 2, parts: int = 2):
        self.readers = [token_batches(dataset, batch_size, samples_per_shard, 0, rank, replicas)
                        for rank in range(replicas)]
        self.parts, self.boundary = parts, 0
        self.batches_per_epoch = self.readers[0].batches_per_epoch * replicas * parts
        self.pending: list[dict] = []

    def __next__(self) -> dict:
        if not self.pending:
            for reader in self.readers:
                batch = next(reader)
                self.pending += [{k: v.chunk(self.parts)[i] for k, v in batch.items()} for i in range(self.parts)]
        return self.pending.pop(0)

    def state_dict(self) -> dict:
        assert not self.pending  # steps end at a whole batch of every replica
        return {"readers": [reader.state_dict() for reader in self.readers]}

    def load_state_dict(self, state: dict) -> None:
        for reader, saved in zip(self.readers, state["readers"]):
            reader.load_state_dict(saved)


MESH_RUNS = {  # name: (flags of the 2 x 2 mesh's run, the same settings of the one-process config)
    "plain": ([], {}),
    "fp16-lowrank": (["--precision", "fp16-mixed", "--expand", "lowrank"],
                     {"run.precision": "fp16-mixed", "blocks.expand": "lowrank"}),  # found-inf over stages x replicas
    # The block's optimizer SGD too: Adam turns the replicas' other order of summing into up to 5e-5 relative on one
    # weight (layer 3's o_proj) after 2 sweeps, where SGD keeps it at rounding.
    "sgd": (["--expand", "sgd", "--expand-lr", "1e-2", "--optimizer", "sgd", "--lr", "1e-2"],
            {"blocks.expand": "sgd", "blocks.expand_lr": 1e-2, "optim.name": "sgd", "optim.lr": 1e-2}),
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, corpus) -> Path:
    """Every MESH_RUNS entry on 2 replicas of a 2-stage pipeline, in one torchrun job of 4 processes, and the plain
    one again, halted after step 3 (the second visit's first) and resumed."""
    tmp = tmp_path_factory.mktemp("mesh")
    runs = [["bcd", "--model", "tiny-llama", "--blocks", "2", "--data", corpus, *COMMON, *flags, "--batch-size", "4",
             "--pipeline", "2", "--attention", "eager", "--out", str(tmp / name)]
            for name, (flags, _) in MESH_RUNS.items()]
    runs += [[*runs[0][:-1], str(tmp / "plain-resumed")], ["bcd", "--out", str(tmp / "plain-resumed"), "--resume"]]
    torchrun(tmp, 4, runs, halts={len(runs) - 2: 3})
    return tmp


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(MESH_RUNS))
def test_a_pipeline_of_two_times_two_replicas_equals_one_process_reading_both_replicas(mesh, tmp_path, corpus,
                                                                                        name):
    """In eager attention: PyTorch's CPU sdpa kernel rounds differently for micro-batches of 2 samples (the mesh's)
    and of 1 (the one process's), and Adam carries that to 1.2e-5 relative on one weight after 2 sweeps."""
    records = [r for r in read_metrics(RunDir(mesh / name).metrics) if isinstance(r, VisitRecord)]
    assert sorted((r["stage"], r["replica"]) for r in records[0].ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]

    config = Config()
    config.model.name, config.data.path = "tiny-llama", corpus
    config.data.seq_len, config.data.samples_per_shard, config.data.eval_fraction = 32, 8, 0.2
    config.data.eval_tokens, config.data.batch_size = 256, 4
    config.blocks.ufp, config.blocks.blocks, config.blocks.sweeps = None, 2, 2
    config.optim.lr, config.optim.grad_accum = 1e-3, 4
    config.stop.steps_per_visit, config.blocks.expand = 2, "none"  # as the pipeline runs
    config.run.out, config.model.attention = str(tmp_path / "one"), "eager"
    for key, value in MESH_RUNS[name][1].items():
        section, field = key.split(".")
        setattr(getattr(config, section), field, value)
    data = load_datasets(config, quiet=True)
    staged = preinfer.stage(build_preset("tiny-llama", attention="eager"))
    blocks, _ = partition_for(staged, config)
    evaluation = token_batches(data.eval, 4, 8, 0, shuffle=False)
    train(config, staged, blocks, None, LiveSources(ReplicaMicroBatches(data.train, 4, 8), evaluation),
          resume=False, quiet=True)
    assert_close(weights(str(mesh / name)), weights(str(tmp_path / "one")))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pipeline_with_replicas_resumes_each_replica_from_its_own_cursor(mesh):
    """Each replica's stages checkpoint their own state (replica 1's under replicas/checkpoint-1/), its data cursor
    that of its own share; resumed mid-visit, the run ends with the uninterrupted run's weights bit for bit."""
    run = RunDir(mesh / "plain-resumed")
    for replica, checkpoint in enumerate((run.checkpoint, run.replica_checkpoint(1))):
        for stage in range(2):
            cursor = json.loads((checkpoint / f"stage-{stage}" / "state.json").read_text())["trainer"]["cursor"]
            assert (cursor["rank"], cursor["world_size"]) == (replica, 2)
    resumed, whole = weights(str(run.path)), weights(str(mesh / "plain"))
    assert set(resumed) == set(whole) and all(torch.equal(resumed[k], v) for k, v in whole.items())


def test_the_parallel_dims_place_each_replica_s_stages_on_consecutive_ranks():
    """rank = replica x stages + stage; a world the stages do not divide is refused before any group is made."""
    dims = ParallelDims(data=2, pipeline=3, rank=4)
    assert (dims.world, dims.replica, dims.stage, dims.rank_of(0), dims.is_first, dims.is_last) == (6, 1, 1, 3,
                                                                                                   False, False)
    assert ParallelDims(data=2, pipeline=3, rank=5).is_last and ParallelDims(data=2, pipeline=3, rank=3).is_first
    assert check_degrees(3, 6) == 2 and ParallelDims().data_group is None
    with pytest.raises(UsageError, match=r"^--pipeline 4 does not divide the world size 6"):
        check_degrees(4, 6)
