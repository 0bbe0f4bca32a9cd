"""What bench.train's parts share: the config of its runs, one trainer visit with its step records, and one
whole `bcd` run timed with its metrics records."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pipelines import training
from preinfer.batch_source import LiveSources
from preinfer.config import Config, load_config
from preinfer.metrics import Record, StepRecord, VisitRecord, read_metrics
from preinfer.run_dir import RunDir
from preinfer.trainer import Trainer


def base_config(args: argparse.Namespace, **sections) -> Config:
    overrides = dict(
        model=dict(name=args.model),
        data=dict(seq_len=args.seq_len, batch_size=args.batch_size),
        blocks=dict(ufp="1/3"),
        optim=dict(name="adam", lr=2e-3),
        run=dict(seed=0),
    )
    for section, values in sections.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    return load_config(overrides=overrides)


class Run:
    """One trainer visit of the top block; collects its step records."""

    def __init__(self):
        self.steps: list[dict] = []
        self.visit: VisitRecord | None = None
        self.tokens = 0

    def record(self, record: Record) -> None:
        if isinstance(record, StepRecord):
            tokens = record.tokens - self.tokens
            self.tokens = record.tokens
            self.steps.append(dict(loss=record.loss, wait_s=record.wait_s, step_s=tokens / record.tokens_per_s))
        elif isinstance(record, VisitRecord):
            self.visit = record

    def summary(self, warmup: int) -> dict:
        measured = self.steps[warmup:]
        step_s = sum(s["step_s"] for s in measured)
        wait_s = sum(s["wait_s"] for s in measured)
        return dict(steps=len(measured), step_s=step_s, steps_per_s=len(measured) / step_s, wait_s=wait_s,
                    wait_fraction=wait_s / step_s, first_step_s=self.steps[0]["step_s"],
                    first_wait_s=self.steps[0]["wait_s"], visit_wall_s=self.visit.wall_s,
                    losses=[s["loss"] for s in self.steps])


def train_once(staged, partition, active: int, config: Config, sources: LiveSources) -> Run:
    run = Run()
    torch.manual_seed(config.run.seed)
    trainer = Trainer(staged, partition, config, sources, None, None, on_record=run.record, active_block=active)
    try:
        trainer.fit()
    finally:
        for source in (sources.train, sources.eval):
            source.close()
    return run


def timed_run(config: Config, out: Path) -> tuple[dict, list[Record], float, float]:
    """A whole `bcd` run of `config` (its run directory `out`): its summary, its metrics records, and its wall and
    process CPU seconds."""
    started, cpu = time.perf_counter(), time.process_time()
    summary = training.run(config, quiet=True)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return summary, read_metrics(RunDir(out).metrics), wall, cpu
