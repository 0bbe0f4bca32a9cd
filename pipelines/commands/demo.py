"""`preinfer demo`: BCD (UFP 1/3, Adam) of small-llama on Python's own docs, about 2 minutes on 2 CPU cores."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from preinfer.config import Config
from pipelines.training import run_bcd


def demo_config(out: str) -> Config:
    config = Config()
    config.model.name = "small-llama"
    config.data.seq_len = 128
    config.data.batch_size = 8
    config.data.eval_batches = 12
    config.blocks.ufp = "1/3"
    config.blocks.sweeps = 2
    config.optim.name = "adam"
    config.optim.lr = 2e-3
    config.optim.warmup_steps = 10
    config.optim.grad_clip = 1.0
    config.stop.steps_per_visit = 60
    config.run.out = out
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="run directory, replaced if it holds an earlier demo "
                                                           "[runs/demo]")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out / "config.toml").exists():
        shutil.rmtree(out)
    summary = run_bcd(demo_config(args.out))
    peak = summary["peak_memory"].get("tracked_peak", 0) / 2**20
    print(f"\ndemo: eval loss {summary['visits'][0]['eval_loss']:.3f} after the first visit -> "
          f"{summary['final_eval_loss']:.3f} after {len(summary['visits'])} visits "
          f"({summary['tokens']:,} tokens, {summary['wall_s']:.0f} s, peak tracked memory {peak:.1f} MiB)")
    print(f"run directory: {out} (config.toml, metrics.jsonl, loss.png, summary.json, checkpoint/, export/)")
    return 0
