"""A whole BCD run: resolve the config into model, data, partition and sources, train, then write the run
directory (config.toml, metrics.jsonl, checkpoint/, export/, loss.png, summary.json)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import preinfer
from preinfer.config import Config, dump_toml
from preinfer.data import TokenDataset, load_data
from preinfer.errors import UsageError
from preinfer.meter import MemoryMeter
from preinfer.metrics import plot_losses, read_metrics
from preinfer.partition import Partition, make_partition, parse_ufp
from preinfer.tokenizers import load_tokenizer
from preinfer.trainer import LiveSources, SourcePlan, Trainer
from pipelines.models import resolve_model
from pipelines.sources import ReaderBatches, token_store


@dataclass
class Datasets:
    train: TokenDataset
    eval: TokenDataset


def load_datasets(config: Config) -> Datasets:
    tokenizer = load_tokenizer(config.model.tokenizer)
    d = config.data
    return Datasets(*(load_data(d.path, tokenizer, d.seq_len, split, d.eval_fraction) for split in ("train", "eval")))


def partition_for(staged: preinfer.StagedModel, config: Config) -> Partition:
    """Full mode is one block; otherwise ranges, then a block count, then UFP, whichever is set first."""
    b = config.blocks
    if config.run.mode == "full":
        return make_partition(staged, num_blocks=1)
    if config.run.mode != "bcd":
        raise UsageError(f"--mode '{config.run.mode}' is not one of bcd, full")
    if b.ranges is not None:
        return make_partition(staged, ranges=b.ranges, separate_ends=b.separate_ends)
    if b.blocks is not None:
        return make_partition(staged, num_blocks=b.blocks, separate_ends=b.separate_ends)
    return make_partition(staged, ufp=parse_ufp(b.ufp), separate_ends=b.separate_ends)


SHARD_BYTES = 64 * 2**20


def samples_per_shard(config: Config, staged: preinfer.StagedModel) -> int:
    """The configured shard size, or about SHARD_BYTES of hidden states in the compute dtype."""
    if config.data.samples_per_shard:
        return config.data.samples_per_shard
    sample_bytes = config.data.seq_len * staged.hidden_size * staged.compute_dtype.itemsize
    return max(1, SHARD_BYTES // sample_bytes)


def live_sources(data: Datasets, config: Config, shard: int) -> LiveSources:
    """Token batches read through the same reader (and so in the same order) as boundary stores would be."""
    batch, seed = config.data.batch_size, config.run.seed
    return LiveSources(
        ReaderBatches(token_store(data.train, shard), 0, batch, seed),
        ReaderBatches(token_store(data.eval, shard), 0, batch, seed, shuffle=False),
    )


def prepare_run_dir(out: Path, config: Config, resume: bool) -> None:
    """Create the run directory; refuse to overwrite another run unless resuming it."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if resume:
        if not (out / "checkpoint").is_dir():
            raise UsageError(f"--resume: {out} holds no checkpoint to resume from")
        return
    if (out / "config.toml").exists():
        raise UsageError(f"--out {out} already holds a run; pass --resume to continue it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(config))


def run_bcd(config: Config, resume: bool = False, plan: SourcePlan | None = None, quiet: bool = False) -> dict:
    """Train as configured and write the run directory; returns the summary."""
    torch.manual_seed(config.run.seed)
    out = Path(config.run.out)
    prepare_run_dir(out, config, resume)
    data = load_datasets(config)
    model = resolve_model(config.model.name, seed=config.run.seed).to(config.run.device)
    staged = preinfer.stage(model)
    partition = partition_for(staged, config)
    ui = ProgressUI(config, quiet)
    ui.note(partition.report())
    plan = plan or live_sources(data, config, samples_per_shard(config, staged))
    trainer = Trainer(staged, partition, config, plan, out, MemoryMeter(model),
                      on_record=ui.record)
    if resume:
        trainer.resume()
    started = time.perf_counter()
    trainer.fit()
    ui.close()
    return finish_run(trainer, out, time.perf_counter() - started)


def finish_run(trainer: Trainer, out: Path, wall_s: float) -> dict:
    """Export, plot and summarise a finished run."""
    model = trainer.staged.model
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out / "export")
    records = read_metrics(out / "metrics.jsonl")
    plot_losses({"BCD": records}, out / "loss.png", title=f"{trainer.config.model.name}: {out.name}")
    visits = trainer.progress.visits
    final = visits[-1]["eval_loss"] if visits else math.nan
    summary = {
        "final_eval_loss": final,
        "final_eval_ppl": math.exp(final) if final < 50 else math.inf,
        "tokens": trainer.progress.tokens,
        "steps": trainer.progress.global_step,
        "wall_s": wall_s,
        "peak_memory": {k: max(v["memory"].get(k, 0) for v in visits) for k in visits[0]["memory"]} if visits else {},
        "visits": visits,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


class ProgressUI:
    """A tqdm bar per visit and one line per finished visit."""

    def __init__(self, config: Config, quiet: bool):
        self.total = config.stop.steps_per_visit
        self.quiet = quiet
        self.bar = None
        self.key = None

    def note(self, text: str) -> None:
        if not self.quiet:
            tqdm.write(text)

    def record(self, record: dict) -> None:
        if self.quiet:
            return
        if record["kind"] == "visit":
            self.close()
            mem = record["memory"].get("tracked_peak", 0) / 2**20
            tqdm.write(
                f"sweep {record['sweep']} block {record['block']} ({record['label']}): eval loss "
                f"{record['eval_loss']:.4f} after {record['steps']} steps ({record['stop_reason']}), "
                f"{record['wall_s']:.1f} s, peak tracked memory {mem:.1f} MiB"
            )
            return
        key = (record["sweep"], record["block"])
        if key != self.key:
            self.close()
            self.key = key
            self.bar = tqdm(total=self.total, desc=f"sweep {key[0]} block {key[1]}", unit="step", leave=False)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar, self.key = None, None
