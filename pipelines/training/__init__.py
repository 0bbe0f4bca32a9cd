"""A whole BCD run: resolve the config into model, data, partition and sources, train, then write the run
directory (its layout is `preinfer.run_dir.RunDir`). Everything a bad input can trip on is resolved before the
run directory is created, so a refused run leaves nothing behind.

SIGINT and SIGTERM during training finish the current step, write a checkpoint and end the process with exit code
128 + the signal number (130, 143) and one line saying how to resume; `--resume` then ends with the same weights
as an uninterrupted run. A second signal acts as usual."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import storage

import preinfer
from preinfer.budget import budget_line, budget_settings, plan_budget, visit_against_budget
from preinfer.config import BlockConfig, Config, dump_toml
from preinfer.errors import UsageError
from preinfer.memory_model import GPUS, Settings, shape_from_config
from preinfer.meter import MemoryMeter
from preinfer.metrics import (
    BudgetPlanRecord, CacheRecord, PlanOutcomeRecord, PreInferenceRecord, Record, SweepPlanRecord, VisitRecord,
    plot_losses, read_metrics,
)
from preinfer.partition import Partition, make_partition, parse_ranges, parse_ufp
from preinfer.precision import apply_precision, describe, resolve_precision, weights_dtype
from preinfer.run_dir import RunDir
from preinfer.batch_source import LiveSources, VisitSources
from pipelines.data.tokenizers import Tokenizer
from pipelines.data.tokenizer_choice import announce, model_tokenizer
from preinfer.trainer import Trainer
from pipelines.data import batches as sources
from pipelines.arguments import parse_size
from pipelines.cache import default_samples_per_shard, open_cache
from pipelines.models import resolve_model
from pipelines.training.pre_inference import PreInference
from pipelines.data.batches import ReaderBatches
from pipelines.models.suffix import Suffix, export_full, load_suffix, to_device
from pipelines.data.token_store import TokenStoreDataset
from pipelines.data.token_store.resolve import eval_samples, token_splits


@dataclass
class Datasets:
    train: TokenStoreDataset
    eval: TokenStoreDataset  # capped by --eval-tokens
    tokenizer: Tokenizer


def load_datasets(config: Config, quiet: bool = False) -> Datasets:
    """The run's splits, read lazily from the token store of --data (built first if need be: by rank 0 alone
    while the other ranks wait). --max-samples takes each split's first samples, --eval-tokens caps eval."""
    choice = model_tokenizer(config.model.tokenizer, config.model.name, config.model.chat_template)
    tokenizer, d = choice.tokenizer, config.data

    first = not dist.is_initialized() or dist.get_rank() == 0
    if not first:
        dist.barrier()
    found = token_splits(d.path, tokenizer, d.seq_len, d.eval_fraction, ["train", "eval"], d.token_store,
                         progress=not quiet)
    if first and dist.is_initialized():
        dist.barrier()
    announce(choice, found, quiet or not first)
    train, evaluation = found["train"], found["eval"]
    if d.max_samples:
        train, evaluation = train.head(d.max_samples), evaluation.head(d.max_samples)
    capped = eval_samples(d.eval_tokens, d.seq_len)
    if capped is not None and capped < len(evaluation):
        evaluation = evaluation.head(capped)
    return Datasets(train, evaluation, tokenizer)


def partition_for(staged: preinfer.StagedModel, config: Config, first_layer: int = 0,
                  precision: str = "fp32") -> tuple[Partition, int | None]:
    """The blocks of the run and the one to train alone (`blocks.active`) or None. Full mode is one block;
    otherwise ranges, then a block count, then UFP, whichever is set first; UFP auto plans the fewest blocks
    that fit the memory budget in `precision` (see `budget_partition`)."""
    b = config.blocks
    if config.run.mode not in ("bcd", "full"):
        raise UsageError(f"--mode '{config.run.mode}' is not one of bcd, full")
    if b.ufp != "auto" and (b.memory_budget is not None or b.gpu is not None):
        raise UsageError("--memory-budget and --gpu choose the blocks with --ufp auto; give --ufp auto or drop them")
    if b.active is not None:
        ranges, active = _active_ranges(b.active, first_layer, staged.num_layers)
        return make_partition(staged, ranges=ranges, first_layer=first_layer), active
    if config.run.mode == "full":
        return make_partition(staged, num_blocks=1, first_layer=first_layer), None
    common = dict(separate_ends=b.separate_ends, first_layer=first_layer)
    if b.ranges is not None:
        return make_partition(staged, ranges=b.ranges, **common), None
    if b.blocks is not None:
        return make_partition(staged, num_blocks=b.blocks, **common), None
    if b.ufp == "auto":
        return budget_partition(staged, config, first_layer, precision), None
    return make_partition(staged, ufp=parse_ufp(b.ufp), **common), None


def budget_partition(staged: preinfer.StagedModel, config: Config, first_layer: int, precision: str) -> Partition:
    """The fewest blocks whose every live visit fits the memory budget by the planner of `preinfer plan` (same
    precision, recomputation, sequence length and micro-batch), the plan attached; exit 2 naming what would fit
    when even one layer per block does not."""
    if first_layer:
        raise UsageError("--ufp auto plans whole-model runs (preinfer bcd); give --ufp or --blocks to train from "
                         "a store")
    if config.blocks.separate_ends:
        raise UsageError("--ufp auto plans blocks whose first holds the embedding and last the head; drop "
                         "--separate-ends or give --blocks")
    shape = shape_from_config(staged.model.config)
    settings = budget_settings(memory_budget(config.blocks), precision, config.data.seq_len,
                               config.data.batch_size, config.run.recompute)
    plan = plan_budget(shape, settings, precision)
    return replace(make_partition(staged, num_blocks=plan.blocks), budget=plan)


def memory_budget(blocks: BlockConfig) -> int:
    """Bytes of [blocks] memory_budget, or the planner's usable memory of [blocks] gpu."""
    if (blocks.memory_budget is None) == (blocks.gpu is None):
        raise UsageError("--ufp auto needs exactly one of --memory-budget SIZE and --gpu NAME")
    if blocks.gpu is not None:
        if blocks.gpu not in GPUS:
            raise UsageError(f"[blocks] gpu = {blocks.gpu!r} is not one of {', '.join(GPUS)}")
        return Settings(gpu=blocks.gpu).capacity()
    try:
        return parse_size(str(blocks.memory_budget))
    except ValueError as error:
        raise UsageError(f"[blocks] memory_budget: {error}") from None


def _active_ranges(active: str, first: int, num_layers: int) -> tuple[str, int]:
    """`--active a-b` as a partition of layers [first, L) whose block number `index` is exactly a..b."""
    found = parse_ranges(active, num_layers, first=first, cover=False)
    if len(found) != 1:
        raise UsageError(f"--active '{active}' must be one layer range such as 4-5")
    lo, hi = found[0]
    pieces = [(a, b) for a, b in ((first, lo), (lo, hi), (hi, num_layers)) if b > a]
    return ",".join(f"{a}-{b - 1}" for a, b in pieces), pieces.index((lo, hi))


def samples_per_shard(config: Config, staged: preinfer.StagedModel) -> int:
    """The configured shard size, or the caching job's default for boundary states in the compute dtype (the
    same as `preinfer cache` picks, so live and stored runs read in the same order)."""
    if config.data.samples_per_shard:
        return config.data.samples_per_shard
    return default_samples_per_shard(config.data.seq_len, staged.hidden_size, staged.compute_dtype)


def live_sources(data: Datasets, config: Config, shard: int, rank: int = 0, world: int = 1) -> LiveSources:
    """The run's token batches (see `pipelines.data.batches.live_sources`)."""
    return sources.live_sources(data.train, data.eval, config.data.batch_size, shard, config.run.seed, rank, world)


def check_run_dir(run: RunDir, resume: bool) -> None:
    """Refuse an --out that is a file, that holds another run (unless resuming it), or nothing to resume."""
    out = run.path
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if resume:
        if not run.checkpoint.is_dir():
            raise UsageError(f"--resume: {out} holds no checkpoint to resume from")
        return
    if run.holds_run():
        raise UsageError(f"--out {out} already holds a run; pass --resume to continue it or choose another --out")


def prepare_run_dir(run: RunDir, config: Config, resume: bool) -> None:
    """Create the run directory with its config (a resumed run keeps its own); refusals as `check_run_dir`."""
    check_run_dir(run, resume)
    if not resume:
        run.path.mkdir(parents=True, exist_ok=True)
        run.config.write_text(dump_toml(config))


def init_distributed(device: str) -> tuple[int, int]:
    """(rank, world size); under torchrun, joins the process group (NCCL on GPUs, gloo on CPU). With `--device
    cuda` (no index) each rank makes its local rank's GPU its current one, so that `cuda` means its own GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def run_bcd(config: Config, resume: bool = False, quiet: bool = False) -> dict:
    """Train a whole model as configured (prefix live, or from stores with pre-inference) and write the run
    directory; returns the summary."""
    run = RunDir(config.run.out)
    rank, world = init_distributed(config.run.device)
    if rank == 0:
        check_run_dir(run, resume)
    model = resolve_model(config.model.name, seed=config.run.seed).to(config.run.device)
    notes = [set_precision(model, config)]
    data = load_datasets(config, quiet)
    staged = preinfer.stage(model)
    partition, active = partition_for(staged, config, precision=resolve_precision(config.run.precision,
                                                                                  weights_dtype(model)))
    shard = samples_per_shard(config, staged)
    chosen: VisitSources = live_sources(data, config, shard, rank, world)
    if config.pre_inference.mode != "off":
        datasets = {"train": data.train, "eval": data.eval}
        chosen = PreInference(staged, datasets, data.tokenizer, config, chosen, shard, rank, world)
    trainer = train(config, staged, partition, active, chosen, resume, quiet, notes, command="bcd")

    def export(directory: Path) -> None:
        model.save_pretrained(directory)
        data.tokenizer.save(directory)

    return finish_run(trainer, run, export)


def run_from_store(config: Config, resume: bool = False, quiet: bool = False) -> dict:
    """Train the blocks above a cache's boundary from its stores; the prefix is never loaded."""
    run = RunDir(config.run.out)
    rank, world = init_distributed(config.run.device)
    if rank == 0:
        check_run_dir(run, resume)
    stores = open_cache(config.store.path, splits=["train", "eval"])
    boundary = int(stores["train"].fingerprint.parts["boundary"])
    tokenizer = model_tokenizer(config.model.tokenizer, config.model.name, config.model.chat_template).tokenizer
    suffix = load_suffix(config.model.name, boundary, seed=config.run.seed)
    notes = [check_prefix(stores["train"], suffix, config)]
    staged = preinfer.stage(to_device(suffix.model, config.run.device))
    notes.insert(0, set_precision(suffix.model, config))
    partition, active = partition_for(staged, config, first_layer=boundary)
    batch, seed = config.data.batch_size, config.run.seed
    chosen = LiveSources(
        ReaderBatches(stores["train"], boundary, batch, seed, rank, world),
        ReaderBatches(stores["eval"], boundary, batch, seed, shuffle=False,
                      limit=eval_samples(config.data.eval_tokens, stores["eval"].fields["labels"].shape[0])),
    )
    trainer = train(config, staged, partition, active, chosen, resume, quiet, notes, command="train")

    def export(directory: Path) -> None:
        if export_full(suffix, directory):
            save_store_tokenizer(tokenizer, stores["train"], directory)

    return finish_run(trainer, run, export)


def save_store_tokenizer(tokenizer: Tokenizer, store: storage.Store, directory: Path) -> None:
    """Save `tokenizer` beside an export trained from `store` if the store was made with it; otherwise say in
    the export's README.md which tokenizer is missing."""
    made_with = str(store.fingerprint.parts.get("tokenizer", ""))
    if tokenizer.fingerprint() == made_with:
        tokenizer.save(directory)
        return
    (directory / "README.md").write_text(
        f"# No tokenizer saved\n\nThe store this model was trained from ({store.path}) was tokenised with a "
        f"tokenizer other than `{tokenizer.name}` (tokenizer fingerprint {made_with[:12]} in the store). Save that "
        f"tokenizer here (`tokenizer.save_pretrained(...)`) before loading this directory with `AutoTokenizer` or "
        f"`pipeline`, or train with `preinfer train --tokenizer DIR` naming it.\n")


def check_prefix(store: storage.Store, suffix: Suffix, config: Config) -> str:
    """Refuse a store made from other prefix weights than the model's (unless store.trust); says why it
    was accepted."""
    made_from = str(store.fingerprint.parts.get("prefix", ""))
    model = config.model.name
    if suffix.prefix_digest is None:
        return (f"{model} holds no weights below boundary {suffix.boundary}: the store {store.path} stands in for "
                f"them on its own fingerprint")
    if suffix.prefix_digest == made_from:
        return f"store {store.path} matches {model}'s layers below boundary {suffix.boundary}"
    message = (f"store {store.path} was made from other weights than {model}'s layers below boundary "
               f"{suffix.boundary} (prefix digest {made_from[:12]} in the store, {suffix.prefix_digest[:12]} in "
               f"the model)")
    if not config.store.trust:
        raise storage.StaleStoreError(f"{message}; rebuild it with `preinfer cache`, or pass --trust-store")
    return f"{message}; used anyway (--trust-store)"


def set_precision(model: torch.nn.Module, config: Config) -> str:
    """Cast the model's weights to the run's precision (`run.precision`, auto: the weights' own); returns the
    line the run starts with."""
    loaded = weights_dtype(model)
    return describe(apply_precision(model, config.run.precision), loaded)


def train(config: Config, staged: preinfer.StagedModel, partition: Partition, active: int | None,
          chosen: VisitSources, resume: bool, quiet: bool, notes: list[str] = (), command: str = "bcd",
          make: Callable[..., Trainer] = Trainer) -> Trainer:
    """Build the trainer with `make` (with its memory meter and progress display, shown by rank 0 only; it
    checks the block order), create the run directory (rank 0), resume if asked, and run it; a signal stops it
    with `RunStopped` after a checkpoint."""
    torch.manual_seed(config.run.seed)
    ui = ProgressUI(config, quiet or (dist.is_initialized() and dist.get_rank() != 0))
    run = RunDir(config.run.out)
    trainer = make(staged, partition, config, chosen, run, MemoryMeter(staged.model), on_record=ui.record,
                   active_block=active)
    if trainer.rank == 0:
        prepare_run_dir(run, config, resume)
    if partition.budget is not None:
        trainer.emit(partition.budget)
    for note in [*notes, partition.report()]:
        ui.note(note)
    if resume:
        trainer.resume()
    started = time.perf_counter()
    with StopOnSignals(trainer) as signals:
        trainer.fit()
    trainer.wall_s = time.perf_counter() - started
    ui.close()
    if trainer.stopped:
        signum = signals.received or signal.SIGTERM  # a rank stopped because another rank got the signal
        print(f"preinfer {command}: stopped by {signal.Signals(signum).name} after step "
              f"{trainer.progress.global_step}; checkpoint written; resume with "
              f"`preinfer {command} --out {config.run.out} --resume`", file=sys.stderr)
        raise RunStopped(128 + signum)
    return trainer


class RunStopped(SystemExit):
    """A run stopped by a signal after writing its checkpoint; its code is 128 + the signal number (a SystemExit,
    so that the command line ends with that code without a handler of its own)."""


class StopOnSignals:
    """While training, SIGINT and SIGTERM ask the trainer to stop after its current step (it checkpoints first);
    the first signal puts the previous handlers back, so a second one interrupts or kills as usual."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.received: int | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self.previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signum
        self.trainer.stop_requested = True
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def __exit__(self, *exc: object) -> None:
        self._restore()


def finish_run(trainer: Trainer, run: RunDir, export: Callable[[Path], object]) -> dict:
    """Export, plot and summarise a finished run (rank 0 writes; other ranks return the summary only)."""
    visits = trainer.progress.visits
    final = visits[-1]["eval_loss"] if visits else math.nan
    summary = {
        "final_eval_loss": final,
        "final_eval_ppl": math.exp(final) if final < 50 else math.inf,
        "tokens": trainer.progress.tokens,
        "steps": trainer.progress.global_step,
        "wall_s": trainer.wall_s,
        "eval_s": sum(visit.get("eval_s", 0.0) for visit in visits),
        "peak_memory": {k: max(v["memory"].get(k, 0) for v in visits) for k in visits[0]["memory"]} if visits else {},
        "visits": visits,
    }
    if trainer.rank != 0:
        return summary
    export(run.export)
    records = read_metrics(run.metrics)
    plot_losses({"BCD": records}, run.loss_plot, title=f"{trainer.config.model.name}: {run.path.name}")
    run.summary.write_text(json.dumps(summary, indent=1))
    return summary


class ProgressUI:
    """A tqdm bar per visit and one line per finished visit."""

    def __init__(self, config: Config, quiet: bool):
        self.total = config.stop.steps_per_visit
        self.quiet = quiet
        self.bar = None
        self.key = None
        self.budget: int | None = None  # bytes, once a budget plan is recorded

    def note(self, text: str) -> None:
        if not self.quiet:
            tqdm.write(text)

    def record(self, record: Record) -> None:
        if self.quiet:
            return
        if isinstance(record, CacheRecord):
            self.close()
            if record.how in ("input", "roll_forward"):
                source = "the input" if record.how == "input" else f"the store at boundary {record.from_}"
                tqdm.write(f"store at boundary {record.boundary}: made from {source} in "
                           f"{record.seconds:.1f} s ({record.bytes / 2**20:.1f} MiB)")
            elif record.how == "probe":
                tqdm.write(f"pre-inference: timed the stores' disk with a {record.bytes / 2**20:.1f} MiB store at "
                           f"boundary 1 in {record.seconds:.1f} s (deleted)")
            return
        if isinstance(record, BudgetPlanRecord):
            self.budget = record.budget
            tqdm.write(budget_line(record))
            return
        if isinstance(record, (SweepPlanRecord, PlanOutcomeRecord)):
            self.close()
            tqdm.write(record.line())
            return
        if isinstance(record, PreInferenceRecord):
            self.close()
            tqdm.write(f"block {record.block}: {record.decision} (pre-inference would save "
                       f"{record.saving_s:.1f} s over {record.steps} steps)")
            return
        if isinstance(record, VisitRecord):
            self.close()
            peak = record.memory.get("tracked_peak", 0)
            against = f" ({visit_against_budget(peak, self.budget)})" if self.budget and peak else ""
            tqdm.write(
                f"sweep {record.sweep} block {record.block} ({record.label}): eval loss "
                f"{record.eval_loss:.4f} after {record.steps} steps ({record.stop_reason}), "
                f"{record.wall_s:.1f} s + eval {record.eval_s:.1f} s, peak tracked memory {peak / 2**20:.1f} MiB{against}"
            )
            return
        key = (record.sweep, record.block)
        if key != self.key:
            self.close()
            self.key = key
            self.bar = tqdm(total=self.total, desc=f"sweep {key[0]} block {key[1]}", unit="step", leave=False)
        self.bar.set_postfix(loss=f"{record.loss:.3f}", tok_s=f"{record.tokens_per_s:.0f}", refresh=False)
        self.bar.update(1)  # redraws at most every 0.1 s (tqdm's mininterval), the postfix with it

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar, self.key = None, None
