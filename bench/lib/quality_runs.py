"""bench.quality's runs: each method's config (full Adam, BCD-Adam, BCD-SGD, expert-granular BCD-Adam, in each
precision), and one method trained by the real Trainer with its eval curve (the worker of one process)."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from bench.lib.curves import plateau_point

ADAM = dict(name="adam", lr=2e-3, betas=[0.9, 0.95], weight_decay=0.0, grad_clip=1.0)
SGD = dict(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-5, grad_clip=0.0)  # the paper's defaults


def method_precision(key: str) -> tuple[str, str]:
    """(method, precision) of a run named METHOD or METHOD@PRECISION."""
    name, _, precision = key.partition("@")
    return name, precision or "fp32"


def method_overrides(key: str, args: argparse.Namespace, steps: int) -> dict:
    """Config overrides of one method (in one precision) trained for `steps` optimizer steps."""
    name, precision = method_precision(key)
    overrides = _method_overrides(name, args, steps)
    overrides["run"] = {**overrides["run"], "precision": precision}
    return overrides


def _method_overrides(name: str, args: argparse.Namespace, steps: int) -> dict:
    per_visit = args.steps_per_visit
    if name == "full-adam":
        return dict(optim=dict(**ADAM, warmup_steps=args.full_warmup), stop=dict(steps_per_visit=steps),
                    blocks=dict(ufp="1", sweeps=1), run=dict(mode="full"))
    sweeps = max(1, round(steps / (3 * per_visit)))
    bcd = dict(blocks=dict(ufp="1/3", sweeps=sweeps, order="ascending"), stop=dict(steps_per_visit=per_visit),
               run=dict(mode="bcd"))
    if name == "bcd-adam":
        return dict(optim=dict(**ADAM, warmup_steps=args.visit_warmup), **bcd)
    if name == "bcd-sgd":
        return dict(optim=dict(**SGD, warmup_steps=0), **bcd)
    if name == "bcd-experts":
        return dict(optim=dict(**ADAM, warmup_steps=args.visit_warmup),
                    **{**bcd, "blocks": {**bcd["blocks"], "experts": args.experts}})
    if name == "bcd-sgd-tuned":
        return dict(optim=dict(**{**SGD, "lr": args.sgd_lr}, warmup_steps=0), **bcd)
    raise SystemExit(f"unknown method '{name}'")


# ---------------------------------------------------------------------------------------------------------------
# The worker: one method in one process.


class Plateaued(Exception):
    """Raised from the evaluation callback to end a run whose eval loss has plateaued (--until-plateau)."""


def run_method(args: argparse.Namespace, name: str, steps: int, run_dir: Path) -> dict:
    """Train one method with the real Trainer, evaluating on the whole eval split every `eval_every` steps."""
    import preinfer
    from pipelines.models import resolve_model
    from pipelines.training import live_sources, load_datasets, prepare_run_dir, samples_per_shard
    from preinfer.config import load_config
    from preinfer.memory.meter import MemoryMeter
    from preinfer.metrics import Record, StepRecord
    from preinfer.partition import make_partition, parse_ufp
    from preinfer.precision import apply_precision
    from preinfer.run_dir import RunDir
    from preinfer.evaluation import evaluate
    from preinfer.trainer import Trainer

    overrides = method_overrides(name, args, steps)
    overrides["model"] = dict(name=args.model)
    overrides["data"] = dict(seq_len=args.seq_len, batch_size=args.batch_size,
                             eval_tokens=args.eval_batches * args.seq_len * args.batch_size)  # 0: the whole split
    overrides["run"] = {**overrides["run"], "seed": args.seed, "out": str(run_dir)}
    config = load_config(overrides=overrides)
    shutil.rmtree(run_dir, ignore_errors=True)
    run = RunDir(run_dir)
    prepare_run_dir(run, config, resume=False)
    torch.manual_seed(config.run.seed)
    data = load_datasets(config)
    model = resolve_model(config.model.name, seed=config.run.seed)
    staged = preinfer.stage(model)
    if config.run.mode == "full":
        partition = make_partition(staged, num_blocks=1)
    else:
        partition = make_partition(staged, ufp=parse_ufp(config.blocks.ufp))
    sources = live_sources(data, config, samples_per_shard(config, staged))  # float32's: one order for all
    apply_precision(model, config.run.precision)
    device = torch.device("cpu")
    tokens_per_epoch = len(data.train) * config.data.seq_len
    curve: list[dict] = []
    clock = dict(start=time.perf_counter(), eval_s=0.0)

    def measure(step: int, tokens: int) -> None:
        t0 = time.perf_counter()
        train_wall = t0 - clock["start"] - clock["eval_s"]
        loss = evaluate(staged, sources.eval, device, args.eval_batches or None)  # 0: the whole eval split
        clock["eval_s"] += time.perf_counter() - t0
        curve.append(dict(step=step, tokens=tokens, epochs=tokens / tokens_per_epoch, eval_loss=loss,
                          train_wall_s=train_wall))
        print(f"[{name}] step {step} tokens {tokens} eval {loss:.4f}", flush=True)

    def on_record(record: Record) -> None:
        if isinstance(record, StepRecord) and record.step % args.eval_every == 0:
            measure(record.step, record.tokens)
            if args.until_plateau and plateau_point(curve, args.plateau_rel, args.plateau_window) is not None:
                raise Plateaued

    measure(0, 0)
    trainer = Trainer(staged, partition, config, sources, run, MemoryMeter(model), on_record=on_record)
    try:
        trainer.fit()
    except Plateaued:
        print(f"[{name}] plateaued at step {curve[-1]['step']}", flush=True)
    p = trainer.position
    if not curve or curve[-1]["step"] != p.global_step:
        measure(p.global_step, p.tokens)
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(c) + "\n" for c in curve))
    peak = max(visit["memory"].get("tracked_peak", 0) for visit in p.visits) if p.visits else 0
    return dict(method=name, config=config.to_dict(), partition=partition.report(), steps=p.global_step,
                precision=trainer.precision, skipped_steps=trainer.scaler.skipped,
                peak_tracked_bytes=peak,
                tokens=p.tokens, tokens_per_epoch=tokens_per_epoch, curve=curve,
                train_wall_s=time.perf_counter() - clock["start"] - clock["eval_s"], eval_s=clock["eval_s"])

