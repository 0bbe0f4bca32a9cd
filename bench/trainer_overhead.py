"""Where the time of a `transformers.Trainer` step goes: BCD through `preinfer.hf` against `preinfer bcd`, and the
Trainer's own overhead, measured by full fine-tuning in the Trainer against a plain PyTorch loop.

One process, the same model (a preset, the run's seed, float32), batches and blocks as `bench.peers`'s; the
methods alternate for --repeats rounds, each from fresh weights:

- `preinfer`: `preinfer bcd --pre-inference off` run in this process (`pipelines.cli.main`);
- `hf-bcd`: `preinfer.hf.BlockCoordinateDescent` in `transformers.Trainer` (peers' `hf-trainer` settings);
- `plain-bcd`: peers' plain per-block loop (freeze, unfreeze the block, fresh Adam, forward/backward/step);
- `hf-full`: the Trainer training every weight with its own Adam (`optim="adamw_torch"`, no weight decay);
- `plain-full`: the plain loop over every weight with the same Adam.

Per method: the median step time (from the end of one step to the end of the next, within a visit: data,
forward, backward, optimizer, callbacks; a visit's first step and the switches left out) and steps/s (the steps
over those times). The clock is the process's CPU time (`time.process_time`; --clock wall for perf_counter): on a
shared machine the wall clock of a 20 ms step moves by 3x from one round to the next, the CPU time of a process
with one thread (OMP_NUM_THREADS=1) much less. `hf-full / plain-full` is the Trainer's own cost per step, which no
optimizer or callback of ours can remove. The process gets `preinfer`'s OpenMP setting (OMP_WAIT_POLICY=PASSIVE
unless set) before torch loads.

    python -m bench.trainer_overhead --repeats 5        # tiny-llama, fp32, seq 64 x 4, blocks 0-1,2-3, 20 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # `preinfer bcd`'s own (pipelines.cli), before torch loads

import torch

from bench.lib import runs
from bench.lib.common import OUT
from preinfer.config import ATTENTIONS

METHODS = ("preinfer", "hf-bcd", "plain-bcd", "hf-full", "plain-full")
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def trainer_stamps(model: torch.nn.Module, batches: list[dict], out: Path, bcd=None) -> list[float]:
    """Each step's end (perf_counter) of `transformers.Trainer` over `batches` in order: with `bcd` (a
    `BlockCoordinateDescent`) its optimizers and callback, else the Trainer's own Adam over every weight."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(clock())

    samples = [{key: value[i] for key, value in batch.items()} for batch in batches
               for i in range(len(batch["input_ids"]))]
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=len(batches[0]["input_ids"]),
                             max_steps=len(batches), train_sampling_strategy="sequential", max_grad_norm=0.0,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             use_cpu=True, seed=0, optim="adamw_torch", weight_decay=0.0, lr_scheduler_type="constant",
                             learning_rate=2e-3, adam_beta2=0.95)
    extra = dict(optimizers=bcd.optimizers, callbacks=[bcd.callback, Clock()]) if bcd else dict(callbacks=[Clock()])
    Trainer(model=model, args=args, train_dataset=samples, **extra).train()
    return ends


def plain_stamps(model: torch.nn.Module, batches: list[dict], groups: list[list[torch.nn.Parameter]]) -> list[float]:
    """Each step's end of the plain loop: per group (a block, or every weight), freeze the rest, a fresh Adam,
    then forward, backward, step over the group's share of `batches`."""
    ends, per_group = [], len(batches) // len(groups)
    model.train()
    for index, params in enumerate(groups):
        model.requires_grad_(False)
        for param in params:
            param.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=2e-3, betas=(0.9, 0.95))
        for batch in batches[index * per_group:(index + 1) * per_group]:
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            ends.append(clock())
    return ends


def preinfer_clock(flags: list[str]) -> list[float]:
    """Each step's end, of `preinfer bcd FLAGS` run in this process (the clock read as each step record is
    emitted)."""
    from pipelines.cli import main
    from preinfer.metrics import StepRecord
    from preinfer.trainer import Trainer

    ends, emit = [], Trainer.emit

    def stamped(self, record) -> None:
        if isinstance(record, StepRecord):
            ends.append(clock())
        emit(self, record)

    Trainer.emit = stamped
    try:
        if main(["bcd", *flags]) != 0:
            raise RuntimeError(f"preinfer bcd {' '.join(flags)} failed")
    finally:
        Trainer.emit = emit
    return ends


def step_times(ends: list[float], steps: int) -> list[float]:
    """The time of each step but a visit's first, from step ends (visits of `steps` steps)."""
    return [b - a for i, (a, b) in enumerate(zip(ends, ends[1:]), 1) if i % steps]


def run(method: str, config, flags: list[str], out: Path) -> list[float]:
    """Step times of one method's run from fresh weights."""
    from preinfer.hf import BlockCoordinateDescent

    steps = config.stop.steps_per_visit
    if method == "preinfer":
        return step_times(preinfer_clock(flags), steps)
    model, _, blocks, batches = runs.prepared(config)
    if method == "hf-bcd":
        bcd = BlockCoordinateDescent(model, ranges=config.blocks.ranges, steps_per_visit=steps, optimizer="adam",
                                     lr=config.optim.lr, betas=tuple(config.optim.betas), weight_decay=0.0,
                                     precision="fp32")
        return step_times(trainer_stamps(model, batches, out, bcd), steps)
    if method == "hf-full":
        return step_times(trainer_stamps(model, batches, out), steps)
    groups = [list(b.params) for b in blocks] if method == "plain-bcd" else [list(model.parameters())]
    return step_times(plain_stamps(model, batches, groups), steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.trainer_overhead", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ranges", default="0-1,2-3", help="the blocks, as inclusive layer ranges")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: the process's CPU time (use with OMP_NUM_THREADS=1); wall: perf_counter")
    p.add_argument("--attention", choices=ATTENTIONS,
                   help="every method's attention implementation [preinfer's default]")
    p.add_argument("--out", type=Path, default=OUT / "trainer_overhead.json")
    args = p.parse_args(argv)
    args.data, args.lr, args.precision, args.max_samples = "builtin:pydoc", 2e-3, "fp32", 400
    return args


def main(argv: list[str] | None = None) -> int:
    global clock
    args = parse_args(argv)
    clock = CLOCKS[args.clock]
    methods = args.methods.split(",")
    times: dict[str, list[float]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory(prefix="trainer-overhead-") as tmp:
        for round_ in range(args.repeats):
            for method in methods:
                out = Path(tmp) / f"{method}-{round_}"
                flags = runs.bcd_flags(args, out, args.steps, args.ranges, args.seq_len, args.batch_size)
                found = run(method, runs.parse_config(flags), flags, out)
                times[method] += found
                print(f"[overhead] round {round_} {method}: median step {statistics.median(found) * 1e3:.1f} ms",
                      flush=True)
    rows = {m: dict(median_ms=statistics.median(t) * 1e3, steps_per_s=len(t) / sum(t)) for m, t in times.items()}
    for mine, theirs in (("hf-bcd", "preinfer"), ("hf-bcd", "plain-bcd"), ("hf-full", "plain-full"),
                         ("plain-bcd", "preinfer")):
        if mine in rows and theirs in rows:
            rows[mine][f"x_{theirs}"] = rows[theirs]["median_ms"] / rows[mine]["median_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings={k: str(v) for k, v in vars(args).items()},
                                        omp_wait_policy=os.environ["OMP_WAIT_POLICY"],
                                        threads=torch.get_num_threads(), rows=rows), indent=1))
    for method, row in rows.items():
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith("x_"))
        print(f"{method:11s} {row['median_ms']:7.1f} ms/step {row['steps_per_s']:7.2f} steps/s  {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
