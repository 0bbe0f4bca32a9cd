"""Training a staged model as configured: the trainer built with its meter and progress display, the run
directory created, a checkpoint resumed if asked, and the fit stopped cleanly by a signal."""

from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

import preinfer
from preinfer.batch_source import VisitSources
from preinfer.config import Config, load_config, resume_changes
from preinfer.errors import CheckpointWriteError, PreinferError, remedy
from preinfer.layout import Layout
from preinfer.memory.meter import MemoryMeter
from preinfer.metrics import ResolvedRecord, ResumeRecord
from preinfer.partition import Partition
from preinfer.config.resolved import ResolvedRun
from preinfer.precision import Precision
from preinfer.run_dir import RunDir
from preinfer.trainer import Trainer
from pipelines.data.corpus import CorpusDigest
from pipelines.progress import Progress
from pipelines.training.run_directory import prepare_run_dir
from pipelines.training.trackers import Trackers
from pipelines.training.signals import RunStopped, StopOnSignals


def train(config: Config, staged: preinfer.StagedModel, partition: Partition, active: int | None,
          chosen: VisitSources, resume: bool, quiet: bool, notes: list[str] = (), command: str = "bcd",
          layout: Layout | None = None, precision: Precision | None = None,
          corpus: CorpusDigest | None = None, resolved: ResolvedRun | None = None) -> Trainer:
    """Build the trainer on `layout` in `precision` (defaults: `Trainer`'s), with its memory meter and progress
    display (shown by rank 0 only; it checks the block order), create the run directory (rank 0), resume if asked,
    and run it; a signal stops it with `RunStopped` after a checkpoint."""
    torch.manual_seed(config.run.seed)
    ui = Progress(quiet or (dist.is_initialized() and dist.get_rank() != 0), config.stop.steps_per_visit)
    run = RunDir(config.run.out)
    trainer = Trainer(staged, partition, config, chosen, run, MemoryMeter(staged.model), on_record=ui.record,
                      active_block=active, layout=layout, precision=precision)
    if trainer.rank == 0:
        prepare_run_dir(run, config, resume, corpus)
    trackers = Trackers.open(config, run.path, trainer.rank)
    trainer.on_record = lambda record: (ui.record(record), trackers.record(record))
    if partition.budget is not None:
        trainer.emit(partition.budget)
    for note in [*notes, partition.report()]:
        ui.note(note)
    if resume:
        resume_run(trainer, run, config)
    started = time.perf_counter()
    with StopOnSignals(trainer) as signals:
        try:
            if resolved is not None:  # after a resume's checks: a refused checkpoint leaves metrics.jsonl as it was
                trainer.emit(ResolvedRecord(**resolved.to_dict()))
            trainer.fit()
        except (OSError, CheckpointWriteError) as err:
            raise stopped_writing(err, command, run) from None
        finally:
            ui.close()  # a failure's one line starts a line of its own
            trackers.close()
    trainer.wall_s = time.perf_counter() - started
    if trainer.stopped:
        signum = signals.received or signal.SIGTERM  # a rank stopped because another rank got the signal
        print(f"preinfer {command}: stopped by {signal.Signals(signum).name} after step "
              f"{trainer.position.global_step}; checkpoint written; resume with "
              f"`preinfer {command} --out {config.run.out} --resume`", file=sys.stderr)
        raise RunStopped(128 + signum)
    return trainer


def stopped_writing(err: OSError | CheckpointWriteError, command: str, run: RunDir) -> PreinferError:
    """The one line of a run a full disk (or a failing one) stopped: what failed, and what continues the run:
    resuming from its last complete checkpoint, or (none written yet) the same command again."""
    what = str(err) if isinstance(err, CheckpointWriteError) else \
        f"the run in {run.path} stopped ({err.strerror or err}{f' at {err.filename}' if err.filename else ''})"
    first = remedy(err)
    then = f"run `preinfer {command} --out {run.path} --resume`" if run.has_checkpoint() else \
        "run the same command again (no checkpoint was written: it starts the run over)"
    return PreinferError(f"{what}; {first}, then {then}")


def resume_run(trainer: Trainer, run: RunDir, config: Config) -> None:
    """Restore the checkpoint, drop what the log holds past it, and record the resume with the config keys the
    command changed (`preinfer.config.RESUMABLE_KEYS`)."""
    trainer.resume()
    p = trainer.position
    trainer.log.rewind(p.global_step, len(p.visits))
    trainer.emit(ResumeRecord(step=p.global_step, changed=resume_changes(load_config(run.config), config)))
