"""Training runs as the tests make them: a small config, a cached model, torchrun jobs, and their weights and
records."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from pipelines.cli import main
from pipelines.data.batches import ReaderBatches
from pipelines.data.tokenizers import ByteTokenizer
from preinfer.config import Config
from preinfer.metrics import CacheRecord, read_metrics
from preinfer.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[2]


def config_for(tmp_path: Path, corpus: str, name: str, preset="tiny-llama", **pre_inference) -> Config:
    config = Config()
    config.model.name = preset
    config.data.path = corpus
    config.data.seq_len = 32
    config.data.batch_size = 4
    config.data.samples_per_shard = 8
    config.data.eval_fraction = 0.2
    config.blocks.ufp = None
    config.blocks.blocks = 3
    config.optim.lr = 1e-3
    config.stop.steps_per_visit = 4
    config.run.out = str(tmp_path / name)
    for key, value in pre_inference.items():
        setattr(config.pre_inference, key, value)
    return config


def weights(run_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(RunDir(run_dir).checkpoint_weights))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Every tensor within relative 1e-5 (Frobenius norm of the difference over the norm of the reference)."""
    assert set(a) <= set(b)
    for name in a:
        relative = (a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-12)
        assert relative.item() <= 1e-5, (name, relative.item())


def torchrun(tmp_path: Path, procs: int, runs: list[list[str]], pinned: bool = False,
             halts: dict[int, int] | None = None, refused: dict[int, int] | None = None,
             kill: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    """The `preinfer` command lines `runs` in one torchrun job of `procs` gloo ranks (`pinned`: pre-inference plans
    with `pinned_rates.PINNED`, not with what it measures; `halts`: {run index: the global step its fit halts
    after, with a checkpoint}; `refused`: {run index: the exit code it must fail with}, each rank's stderr of it
    in `tmp_path / f"refused-{index}-rank-{rank}.txt"`; `kill`: (rank, step): the last run's process of that rank
    SIGKILLs itself at the forward of that step, and the job must fail by that signal; a killed run is resumed in
    the next job, or, the last job's, by `forked_ranks`)."""
    listing = tmp_path / f"runs-{procs}{'-killed' if kill else ''}.json"
    listing.write_text(json.dumps({"pinned": pinned, "runs": runs, "halts": halts or {}, "refused": refused or {},
                                   "kill": kill}))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--standalone",
         str(ROOT / "tests" / "helpers" / "pipeline_driver.py"), str(listing)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=500,
    )
    if kill:
        assert done.returncode != 0 and "Signal 9 (SIGKILL)" in done.stderr, done.stderr[-4000:]
    else:
        assert done.returncode == 0, done.stderr[-4000:]
    return done


def forked_ranks(procs: int, arguments: list[str]) -> None:
    """The `preinfer` command line `arguments` on `procs` gloo ranks forked from this process (so they pay no
    start-up: its imports are theirs), each with torchrun's variables and a port of their own; each must exit 0.
    For one run after a module's torchrun jobs: the resume of the last job's killed run."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    mp.start_processes(_forked_rank, (procs, port, arguments), nprocs=procs, start_method="fork")


def _forked_rank(rank: int, procs: int, port: int, arguments: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(procs), LOCAL_WORLD_SIZE=str(procs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert main(arguments) == 0, f"rank {rank} of {arguments}"


def cache_records(run_dir: str) -> list[CacheRecord]:
    return [r for r in read_metrics(RunDir(run_dir).metrics) if isinstance(r, CacheRecord)]


def cache_and_model(tmp_path: Path, corpus: str, boundary: int = 2) -> tuple[str, str]:
    """A save_pretrained model directory and a cache of its boundary states at `boundary`."""
    from preinfer.presets import build_preset

    model_dir = tmp_path / "model"
    build_preset("tiny-llama", seed=3).save_pretrained(model_dir)
    ByteTokenizer().save(model_dir)  # its own tokenizer, which --tokenizer auto takes
    store = tmp_path / "cache"
    code = main(["cache", "--model", str(model_dir), "--data", corpus, "--boundary", str(boundary),
                 "--out", str(store), "--seq-len", "32", "--samples-per-shard", "8", "--eval-fraction", "0.2"])
    assert code == 0
    return str(model_dir), str(store)


class BothRanks:
    """One process reading what two data-parallel ranks read: batch i is rank 0's batch i then rank 1's."""

    def __init__(self, store, boundary, batch_size, seed):
        self.boundary = boundary
        self.ranks = [ReaderBatches(store, boundary, batch_size, seed, rank, 2) for rank in range(2)]
        self.batches_per_epoch = self.ranks[0].batches_per_epoch

    def __next__(self):
        parts = [next(r) for r in self.ranks]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def state_dict(self):
        return [r.state_dict() for r in self.ranks]

    def load_state_dict(self, state):
        for r, s in zip(self.ranks, state):
            r.load_state_dict(s)
