"""The rows `bench.dp_sync` and `bench.dp_sync_link` run: each `--dp-sync` / `--grad-compression` mode's `preinfer
bcd` command line over one model, corpus (the source of Python's own `argparse` module, which no default was tuned
on), seed and global batch, and what a run's rank 0 recorded (eval loss, bytes sent, the step's wall)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.lib.common import ROOT

MODES = {  # row: flags
    "step": ["--dp-sync", "step"],
    "step+bf16": ["--dp-sync", "step", "--grad-compression", "bf16"],
    "step+powersgd:4": ["--dp-sync", "step", "--grad-compression", "powersgd:4"],
    "every:10": ["--dp-sync", "every:10"],
    "visit": ["--dp-sync", "visit"],
    "visit+outer": ["--dp-sync", "visit", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
}


def arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The rows' settings (`bench.dp_sync_link` adds its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=description.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma list of world sizes, e.g. 2,4")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--sweeps", type=int, default=1)
    parser.add_argument("--steps-per-visit", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences a step over all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench-dp-sync"), help="where the runs go")
    parser.add_argument("--plot", help="a PNG of training loss against bytes sent (default: none)")
    return parser


def corpus(work: Path) -> str:
    """The source of Python's `argparse` module as a text corpus."""
    path = work / "corpus.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(Path(argparse.__file__).read_text())
    return str(path)


def bcd(args: argparse.Namespace, ranks: int, mode: str, data: str, out: Path) -> list[str]:
    """One row's `preinfer bcd` command line (a fresh run: this benchmark's own run of an earlier invocation
    removed)."""
    shutil.rmtree(out, ignore_errors=True)
    return ["bcd", "--model", args.model, "--data", data, "--blocks", str(args.blocks), "--sweeps",
            str(args.sweeps), "--steps-per-visit", str(args.steps_per_visit), "--batch-size",
            str(args.global_batch // ranks), "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--seed", "0",
            "--pre-inference", "off", "--expand", "none", "--grad-clip", "0", "--order", "ascending",
            "--out", str(out), *MODES[mode]]


def run(args: argparse.Namespace, ranks: int, mode: str, data: str, out: Path) -> None:
    """One row's torchrun job."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    "-m", "pipelines.cli", *bcd(args, ranks, mode, data, out)], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def records(out: Path) -> tuple[list, list]:
    """Rank 0's step and visit records of one run."""
    from preinfer.metrics import StepRecord, VisitRecord, read_metrics
    from preinfer.run_dir import RunDir

    every = read_metrics(RunDir(out).metrics)
    return [r for r in every if isinstance(r, StepRecord)], [r for r in every if isinstance(r, VisitRecord)]


def measured(out: Path) -> dict:
    """Eval loss, bytes a step and compute seconds a step of one run (rank 0's records)."""
    steps, visits = records(out)
    seconds = [(b.tokens - a.tokens) / b.tokens_per_s for a, b in zip(steps, steps[1:])]  # this step's tokens
    return dict(eval_loss=visits[-1].eval_loss, bytes_per_step=sum(v.sent_bytes for v in visits) / len(steps),
                compute_s=statistics.median(seconds), steps=len(steps))
