"""Training from a store of boundary states against training live (issue 5's training benchmark).

Everything in one run of one process, on `small-llama`, `builtin:pydoc`, seq 128, batch 8, float32, Adam lr 2e-3:

1. Steps/s training the top block of a UFP 1/3 partition (layers [k, L), k = 4 of 6 for small-llama) with the
   real `preinfer.trainer.Trainer`, (a) live: token batches from a `ReaderBatches` over the token store
   (boundary 0), the prefix (embedding + layers [0, k)) under `no_grad` every step; (b) from a store: a
   `ReaderBatches` over a zarr store at boundary k (built once with `pipelines.cache.cache_boundary`, dtype
   `auto` = float32, default codec; its build time is reported apart), the model a suffix from
   `pipelines.models.suffix.load_suffix` (the prefix is not in memory). The two alternate (live, store, live, store,
   ...) for --repeats repetitions, each a fresh trainer and reader for --warmup + --steps steps; steps/s is
   --steps over the summed step times of the steps after the warm-up ones; medians over repetitions. Both read
   the same samples in the same order, so their losses agree step by step (checked, reported).
2. The ideal speedup from the pieces of one step timed directly (alternating, medians over --piece-repeats):
   prefix forward under no_grad (embed + layers [0, k)) and suffix forward + backward (layers [k, L) + head +
   loss + backward of the active block); ideal = (prefix + suffix) / suffix. Achieved = store steps/s / live
   steps/s. Target: achieved >= 0.9 x ideal. (The Adam step is timed too and shown; it is not in the ideal.)
3. The share of the store runs' step time spent waiting for the reader (the trainer's per-step `wait_s` over
   the step time), over the measured steps; the first step of each visit (when the reader decodes its first
   shard) is shown apart. Target: <= 2%.
4. Whole `bcd` runs (`pipelines.training.run`) with `--pre-inference off` and `auto`, alternating, each
   --bcd-repeats times: UFP 1/3, --sweeps ascending sweeps, --bcd-samples samples per split, --bcd-epochs
   epochs per visit. Wall time, caching time (the `cache` records of metrics.jsonl), the auto rule's decisions
   with their numbers, the final eval losses (equal up to float noise: same sample order live and from stores).

Prints a table and writes bench/out/train.json.

5. With --scenarios, instead of 1-4: issue 16's scenario table. Whole `bcd` runs with `--pre-inference` auto
   against on and auto against off, each pair at the same time on one core each (so that both meet the same
   machine), --scenario-repeats times, auto over each mode the median of the pairs' ratios, for every scenario
   {ascending, descending} x {a tenth of an epoch, 1 epoch, 3 epochs per visit} x --sweeps sweeps on each of
   --scenario-models, UFP 1/3, --scenario-samples samples per split, float32 stores, each run in a process of its
   own (its times leave out the process's start and imports). Wall time of each run (and its process CPU
   time), auto over the better of on and off (the larger of the two ratios; target <= 1.05), the final eval
   losses (equal: float32 stores), the
   plans auto chose, and the cost model's predicted seconds against the measured ones (the `plan_outcome`
   records). Writes bench/out/train_scenarios.json.

    python -m bench.train              # about 8 min on 2 shared cores
    python -m bench.train --quick      # tiny-llama, seq 32, a few steps (seconds): a smoke test
    python -m bench.train --store-dtype float8_e4m3,float8_e5m2,int8 --trained RUN_DIR   # lossy stores (issue 14)
    python -m bench.train --scenarios  # the scenario table
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import preinfer
from bench.lib.common import OUT, ROOT, command_line, machine, module_command, run_side_by_side, table
from bench.lib.trained import cache_split, trained_model
from pipelines.cache import CacheOptions, cache_boundary, open_cache
from pipelines.models import resolve_model
from pipelines.data.batches import ReaderBatches
from pipelines.models.suffix import load_suffix, to_device
from pipelines import training
from pipelines.training import live_sources, load_datasets, partition_for, samples_per_shard
from preinfer.config import Config, load_config
from preinfer.metrics import (CacheRecord, PlanOutcomeRecord, PreInferenceRecord, Record, StepRecord,
                              SweepPlanRecord, VisitRecord, read_metrics)
from preinfer.optim import LR_DECAYS, build_optimizer
from preinfer.run_dir import RunDir
from preinfer.batch_source import LiveSources
from preinfer.staged import causal_lm_loss, supervised_tokens
from preinfer.trainer import Trainer

TARGETS = {"achieved_over_ideal": ">= 0.9", "wait_fraction": "<= 0.02"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="small-llama", help="[small-llama]")
    p.add_argument("--seq-len", type=int, default=128, help="[128]")
    p.add_argument("--batch-size", type=int, default=8, help="[8]")
    p.add_argument("--steps", type=int, default=60, help="measured steps per throughput run [60]")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps before them [5]")
    p.add_argument("--repeats", type=int, default=3, help="live/store throughput repetitions [3]")
    p.add_argument("--piece-repeats", type=int, default=60, help="timings of each piece of one step [60]")
    p.add_argument("--bcd-samples", type=int, default=200, help="max_samples of each split in the bcd runs [200]")
    p.add_argument("--bcd-epochs", type=float, default=3.0,
                   help="epochs_per_visit of the bcd runs [3]: long enough that auto picks stores")
    p.add_argument("--sweeps", type=int, default=2, help="sweeps of the bcd runs [2]")
    p.add_argument("--bcd-repeats", type=int, default=1, help="off/auto pairs of bcd runs [1]; 0 skips them")
    p.add_argument("--samples", type=int, default=0, help="max_samples of each split in part 1 (0: all) [0]")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch intra-op threads [half the cores: the other half is left to the reader's decoding "
                        "threads; see docs/results.md for why not all of them]")
    p.add_argument("--dir", default=None, help="where stores and run directories go [a temporary directory]")
    p.add_argument("--out", type=Path, default=OUT / "train.json")
    p.add_argument("--scenarios", action="store_true", help="run the scenario table (5) instead of 1-4")
    p.add_argument("--scenario-models", default="small-llama,medium-llama", help="[small-llama,medium-llama]")
    p.add_argument("--scenario-samples", type=int, default=80,
                   help="max_samples of each split in the scenario runs [80: 10 steps per epoch at batch 8]")
    p.add_argument("--scenario-repeats", type=int, default=2,
                   help="pairs (auto, on) and (auto, off) per scenario, run side by side; medians [2]")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-llama, seq 32, batch 2, a few steps")
    p.add_argument("--scenario-worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--store-dtype", dest="store_dtypes", metavar="DTYPES",
                   help="instead: train the top block of --trained from a store in each of these comma-separated "
                        "store dtypes and from the exact store (float32), same seed, steps and sample order; final "
                        "eval loss (on the exact eval states) and reader wait (bench/out/train_store_dtypes.json)")
    p.add_argument("--trained", metavar="RUN_DIR", help="the trained BCD run of --store-dtype")
    p.add_argument("--dtype-steps", type=int, default=150, help="steps of each --store-dtype run [150]")
    p.add_argument("--dtype-lr-decay", default="cosine", choices=LR_DECAYS,
                   help="the --store-dtype runs' learning-rate decay over the visit [cosine: the final loss is that "
                        "of a trained model, not a snapshot of a trajectory still moving at the full rate]")
    p.add_argument("--dtype-seeds", default="0",
                   help="comma-separated seeds (sample order) of the --store-dtype runs, each dtype against the exact "
                        "store with the same seed [0]; more than one writes bench/out/train_store_dtypes_seeds.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.batch_size = "tiny-llama", 32, 2
        args.steps, args.warmup, args.repeats, args.piece_repeats, args.samples = 3, 1, 1, 3, 64
        args.bcd_samples, args.bcd_epochs, args.sweeps = 16, 1.0, 2
        args.scenario_models, args.scenario_samples = "tiny-llama", 20
    if args.scenarios and args.out == OUT / "train.json":
        args.out = args.out.with_name("train_scenarios.json")
    return args




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


# ---- 1 and 3: steps/s live and from a store ------------------------------------------------------------------


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


def throughput(args: argparse.Namespace, root: Path) -> dict:
    config = base_config(args, data=dict(eval_tokens=args.seq_len * args.batch_size, max_samples=args.samples),
                         stop=dict(steps_per_visit=args.warmup + args.steps),
                         pre_inference=dict(mode="off"))
    data = load_datasets(config)
    model = resolve_model(args.model, seed=0)
    staged = preinfer.stage(model)
    ufp_partition, _ = partition_for(staged, config)
    top = ufp_partition.blocks[-1]
    k, num_layers = top.start, staged.num_layers
    config.blocks.active = f"{k}-{num_layers - 1}"
    partition, active = partition_for(staged, config)
    shard = samples_per_shard(config, staged)

    started = time.perf_counter()
    built = cache_boundary(staged, {"train": data.train, "eval": data.eval}, data.tokenizer, k, root / f"store-{k}",
                           CacheOptions(samples_per_shard=shard, mode="overwrite", progress=False,
                                        model_name=args.model))
    build_s = time.perf_counter() - started
    stores = open_cache(root / f"store-{k}", splits=["train", "eval"])
    store_bytes = sum(s.stored_bytes for s in built.splits.values())

    suffix = load_suffix(args.model, k, seed=0)
    suffix_staged = preinfer.stage(to_device(suffix.model, "cpu"))
    suffix_partition, suffix_active = partition_for(suffix_staged, config, first_layer=k)

    def store_sources() -> LiveSources:
        b, seed = config.data.batch_size, config.run.seed
        return LiveSources(ReaderBatches(stores["train"], k, b, seed),
                           ReaderBatches(stores["eval"], k, b, seed, shuffle=False))

    runs: dict[str, list[dict]] = {"live": [], "store": []}
    for rep in range(args.repeats):
        for name in ("live", "store"):
            if name == "live":
                run = train_once(staged, partition, active, config, live_sources(data, config, shard))
            else:
                run = train_once(suffix_staged, suffix_partition, suffix_active, config, store_sources())
            runs[name].append(run.summary(args.warmup))
            r = runs[name][-1]
            print(f"[train] rep {rep} {name}: {r['steps_per_s']:.2f} steps/s, wait {100 * r['wait_fraction']:.2f}%,"
                  f" first step {r['first_step_s']:.3f} s (wait {r['first_wait_s']:.3f} s)", flush=True)
    loss_diff = max(abs(a - b) / abs(a) for live, store in zip(runs["live"], runs["store"])
                    for a, b in zip(live["losses"], store["losses"]))
    median = {name: statistics.median(r["steps_per_s"] for r in rs) for name, rs in runs.items()}
    store_runs = runs["store"]
    return dict(
        boundary=k, num_layers=num_layers, active=config.blocks.active, samples_per_shard=shard,
        train_samples=len(data.train), eval_samples=len(data.eval),
        store=dict(build_s=build_s, job_seconds=built.seconds, stored_MiB=store_bytes / 2**20),
        live_steps_per_s=median["live"], store_steps_per_s=median["store"],
        achieved=median["store"] / median["live"],
        wait_fraction=statistics.median(r["wait_fraction"] for r in store_runs),
        wait_fraction_with_first=statistics.median(
            (r["wait_s"] + r["first_wait_s"]) / (r["step_s"] + r["first_step_s"]) for r in store_runs),
        live_wait_fraction=statistics.median(r["wait_fraction"] for r in runs["live"]),
        max_rel_loss_diff=loss_diff, runs={n: [{k2: v for k2, v in r.items() if k2 != "losses"} for r in rs]
                                           for n, rs in runs.items()},
        staged=staged, partition=partition, active_index=active, data=data,
    )


# ---- 2: the pieces of one step -------------------------------------------------------------------------------


def pieces(args: argparse.Namespace, staged, partition, active: int, data) -> dict:
    """Median seconds of the prefix forward (no_grad), the suffix forward + backward and the Adam step."""
    block = partition.blocks[active]
    k, num_layers = block.start, staged.num_layers
    model = staged.model
    model.requires_grad_(False)
    for param in block.params:
        param.requires_grad_(True)
    model.train()
    for module in staged.prefix_modules(k):
        module.eval()
    optimizer = build_optimizer(list(block.params), base_config(args).optim)
    rows = data.train[: args.batch_size]
    ids, mask, labels = rows["input_ids"], rows["attention_mask"], rows["labels"]
    count = supervised_tokens(labels)

    def prefix():
        with torch.no_grad():
            return staged.run(staged.embed(ids, mask, labels), 0, k)

    state = prefix()

    def suffix():
        out = staged.run(state, k, num_layers)
        loss = causal_lm_loss(staged.logits(out), out.labels, reduction="sum") / count
        loss.backward()
        loss.item()

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"prefix": [], "suffix": [], "adam": []}
    for index in range(args.piece_repeats + 3):  # 3 warm-up rounds
        for name, fn in (("prefix", prefix), ("suffix", suffix), ("adam", step)):
            t0 = time.perf_counter()
            fn()
            if index >= 3:
                times[name].append(time.perf_counter() - t0)
    model.requires_grad_(False)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return dict(prefix_s=med["prefix"], suffix_s=med["suffix"], adam_s=med["adam"],
                ideal=(med["prefix"] + med["suffix"]) / med["suffix"],
                ideal_with_adam=(med["prefix"] + med["suffix"] + med["adam"]) / (med["suffix"] + med["adam"]),
                repeats=args.piece_repeats)


# ---- 4: whole bcd runs ---------------------------------------------------------------------------------------


def bcd_run(args: argparse.Namespace, mode: str, out: Path) -> dict:
    config = base_config(args, data=dict(max_samples=args.bcd_samples),
                         blocks=dict(sweeps=args.sweeps, order="ascending"),
                         stop=dict(epochs_per_visit=args.bcd_epochs),
                         run=dict(out=str(out)), pre_inference=dict(mode=mode, store_dir=str(out.parent / f"{out.name}-stores")))
    started, cpu = time.perf_counter(), time.process_time()
    summary = training.run(config, quiet=True)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    records = read_metrics(RunDir(out).metrics)
    caches = [r.to_dict() for r in records if isinstance(r, CacheRecord)]
    decisions = [{k: r.to_dict()[k] for k in ("block", "boundary", "decision", "steps", "prefix_per_step",
                                             "read_per_step", "build", "build_from", "saving_s")}
                 for r in records if isinstance(r, PreInferenceRecord)]
    visits = [dict(sweep=v["sweep"], block=v["block"], steps=v["steps"], source_boundary=v["source_boundary"],
                   eval_loss=v["eval_loss"], wall_s=v["wall_s"]) for v in summary["visits"]]
    return dict(mode=mode, wall_s=wall, fit_s=summary["wall_s"], steps=summary["steps"],
                caching_s=sum(r["seconds"] for r in caches),
                caches=[{k: r.get(k) for k in ("boundary", "how", "from", "seconds", "bytes")} for r in caches
                        if r["how"] != "deleted"],
                decisions=decisions, visits=visits, final_eval_loss=summary["final_eval_loss"])


def bcd(args: argparse.Namespace, root: Path) -> dict:
    runs: dict[str, list[dict]] = {"off": [], "auto": []}
    for rep in range(args.bcd_repeats):
        for mode in ("off", "auto"):
            result = bcd_run(args, mode, root / f"bcd-{mode}-{rep}")
            runs[mode].append(result)
            print(f"[train] bcd rep {rep} {mode}: {result['wall_s']:.1f} s wall, caching {result['caching_s']:.1f} s, "
                  f"final eval loss {result['final_eval_loss']:.6f}, decisions "
                  f"{[(d['block'], d['decision']) for d in result['decisions']]}", flush=True)
    off_wall = statistics.median(r["wall_s"] for r in runs["off"])
    auto_wall = statistics.median(r["wall_s"] for r in runs["auto"])
    losses = [(a["final_eval_loss"], b["final_eval_loss"]) for a, b in zip(runs["off"], runs["auto"])]
    return dict(off_wall_s=off_wall, auto_wall_s=auto_wall, speedup=off_wall / auto_wall,
                max_rel_eval_loss_diff=max(abs(a - b) / abs(a) for a, b in losses), runs=runs,
                settings=dict(max_samples=args.bcd_samples, epochs_per_visit=args.bcd_epochs, sweeps=args.sweeps,
                              ufp="1/3", optimizer="adam", lr=2e-3, order="ascending"))


# ---- store dtypes: training the top block from exact and lossy stores (issue 14) ---------------------------------


def store_dtype_runs(args: argparse.Namespace, root: Path) -> dict:
    """The top block of a trained run trained from a store in each dtype: final eval loss, reader wait."""
    staged, data = trained_model(args.trained)
    config = base_config(args, stop=dict(steps_per_visit=args.warmup + args.dtype_steps),
                         pre_inference=dict(mode="off"), optim=dict(decay=args.dtype_lr_decay))
    k = partition_for(staged, config)[0].blocks[-1].start
    config.blocks.active = f"{k}-{staged.num_layers - 1}"
    stores = {}
    for dtype in ["float32", *args.store_dtypes.split(",")]:
        cache_split(staged, data, k, root / dtype, dtype)
        stores[dtype] = open_cache(root / dtype, splits=["train", "eval"])
    rows = []
    for seed in [int(s) for s in args.dtype_seeds.split(",")]:
        config.run.seed = seed
        for dtype, split_stores in stores.items():
            suffix = preinfer.stage(to_device(load_suffix(args.trained, k, seed=0).model, "cpu"))
            partition, active = partition_for(suffix, config, first_layer=k)
            b = config.data.batch_size
            sources = LiveSources(ReaderBatches(split_stores["train"], k, b, seed),
                                  ReaderBatches(stores["float32"]["eval"], k, b, seed, shuffle=False))
            run = train_once(suffix, partition, active, config, sources)
            summary = run.summary(args.warmup)
            rows.append(dict(seed=seed, dtype=dtype, final_eval_loss=run.visit.eval_loss,
                             wait_fraction=summary["wait_fraction"], steps_per_s=summary["steps_per_s"],
                             first_wait_s=summary["first_wait_s"]))
        exact = rows[-len(stores)]["final_eval_loss"]
        for row in rows[-len(stores):]:
            row["rel_eval_loss_diff"] = (row["final_eval_loss"] - exact) / exact
            print(table([row], list(row)).splitlines()[-1], flush=True)
    by_dtype = {}
    for dtype in stores:
        diffs = [r["rel_eval_loss_diff"] for r in rows if r["dtype"] == dtype]
        waits = [r["wait_fraction"] for r in rows if r["dtype"] == dtype]
        by_dtype[dtype] = dict(seeds=len(diffs), mean_rel_eval_loss_diff=statistics.mean(diffs),
                               max_rel_eval_loss_diff=max(diffs), median_wait_fraction=statistics.median(waits))
    return dict(boundary=k, active=config.blocks.active, steps=args.dtype_steps, warmup=args.warmup,
                lr_decay=args.dtype_lr_decay, seq_len=args.seq_len, batch_size=args.batch_size, trained=args.trained,
                rows=rows, summary=by_dtype,
                eval="the exact (float32) eval store for every run; each seed's runs against that seed's exact run",
                targets=dict(rel_eval_loss_diff="<= 0.005", wait_fraction="<= 0.01"))

# ---- 5: the scenario table -----------------------------------------------------------------------------------

SCENARIO_EPOCHS = (0.1, 1.0, 3.0)
SCENARIO_MODES = ("auto", "on", "off")


def scenario_run(args: argparse.Namespace, model: str, order: str, epochs: float, mode: str, out: Path) -> dict:
    """One whole bcd run of a scenario: wall time, final eval loss, auto's plans and the model's prediction."""
    config = base_config(argparse.Namespace(**{**vars(args), "model": model}),
                         data=dict(max_samples=args.scenario_samples), blocks=dict(sweeps=args.sweeps, order=order),
                         stop=dict(epochs_per_visit=epochs), run=dict(out=str(out)),
                         pre_inference=dict(mode=mode, store_dir=str(out.parent / f"{out.name}-stores")))
    started, cpu = time.perf_counter(), time.process_time()
    summary = training.run(config, quiet=True)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    records = read_metrics(RunDir(out).metrics)
    plans = [r for r in records if isinstance(r, SweepPlanRecord)]
    outcome = [r for r in records if isinstance(r, PlanOutcomeRecord)]
    return dict(mode=mode, wall_s=wall, cpu_s=cpu, load_average=os.getloadavg()[0], fit_s=summary["wall_s"],
                final_eval_loss=summary["final_eval_loss"],
                steps=summary["steps"], sources=[v["source_boundary"] for v in summary["visits"]],
                plans=[dict(sweep=p.sweep, reason=p.reason, chosen=p.chosen, predicted_s=p.predicted_s,
                            alternative=p.alternative, alternative_s=p.alternative_s, live_s=p.live_s,
                            note=p.note) for p in plans],
                predicted_s=outcome[-1].run_predicted_s if outcome else None,
                measured_s=outcome[-1].run_measured_s if outcome else None)


def scenario_command(args: argparse.Namespace, model: str, order: str, epochs: float, mode: str,
                     out: Path) -> tuple[list[str], Path]:
    """The command that runs `scenario_run` in a Python process of its own, as a user's `preinfer bcd` runs
    (nothing carried over from the runs before it: allocator state, threads, opened stores, warmed code paths; its
    times leave out the process's start and imports), and the file it writes its result to."""
    result = out.parent / f"{out.name}.json"
    spec = dict(model=model, order=order, epochs=epochs, mode=mode, out=str(out))
    command = [*module_command("train"), "--seq-len", str(args.seq_len), "--batch-size",
               str(args.batch_size), "--scenario-samples", str(args.scenario_samples), "--sweeps", str(args.sweeps),
               "--threads", "1", "--scenario-worker", json.dumps(spec), "--result", str(result)]
    return command, result


def scenario_worker(args: argparse.Namespace) -> None:
    spec = json.loads(args.scenario_worker)
    run = scenario_run(args, spec["model"], spec["order"], spec["epochs"], spec["mode"], Path(spec["out"]))
    args.result.write_text(json.dumps(run))


def scenario_pair(args: argparse.Namespace, model: str, order: str, epochs: float, modes: tuple[str, str],
                  out: Path) -> dict[str, dict]:
    """The runs of two modes of a scenario side by side, the first mode on core 0 (`run_side_by_side`)."""
    commands = {mode: scenario_command(args, model, order, epochs, mode, out / mode) for mode in modes}
    out.mkdir(parents=True, exist_ok=True)
    run_side_by_side([command for command, _ in commands.values()], ROOT)
    return {mode: json.loads(result.read_text()) for mode, (_, result) in commands.items()}


def scenarios(args: argparse.Namespace, root: Path, on_row=lambda rows: None) -> list[dict]:
    """Every scenario: auto against on and auto against off, each pair side by side (one core and one thread
    each; auto on core 0 in even repeats, core 1 in odd ones), --scenario-repeats times, after one untimed pair per
    model (the disk's caches). Auto over each mode: the median over repeats of the pair's ratio; auto over the
    better of the two: the larger of those (auto <= 1.05 x min(on, off) iff both ratios are <= 1.05). `on_row`
    sees the rows so far after each scenario."""
    rows = []
    for model in args.scenario_models.split(","):
        scenario_pair(args, model, "ascending", SCENARIO_EPOCHS[0], ("on", "off"), root / f"warm-up-{model}")
        for order in ("ascending", "descending"):
            for epochs in SCENARIO_EPOCHS:
                name = f"{model}-{order}-{epochs:g}"
                repeats: dict[str, list[dict]] = {mode: [] for mode in SCENARIO_MODES}
                ratios: dict[str, dict[str, list[float]]] = {m: {"wall_s": [], "cpu_s": []} for m in ("on", "off")}
                for r in range(args.scenario_repeats):
                    for other in ("on", "off"):
                        modes = ("auto", other) if r % 2 == 0 else (other, "auto")
                        done = scenario_pair(args, model, order, epochs, modes, root / f"{name}-{other}-{r}")
                        for mode in modes:
                            repeats[mode].append(done[mode])
                        for key, values in ratios[other].items():
                            values.append(done["auto"][key] / done[other][key])
                runs = {mode: dict(runs[0], wall_s=statistics.median(r["wall_s"] for r in runs),
                                   walls_s=[r["wall_s"] for r in runs],
                                   cpu_s=statistics.median(r["cpu_s"] for r in runs),
                                   predicted_s=_median_or_none([r["predicted_s"] for r in runs]),
                                   measured_s=_median_or_none([r["measured_s"] for r in runs]),
                                   repeats=runs[1:])
                        for mode, runs in repeats.items()}
                over = {m: {key: statistics.median(v) for key, v in r.items()} for m, r in ratios.items()}
                losses = [r["final_eval_loss"] for mode in SCENARIO_MODES for r in repeats[mode]]
                row = dict(model=model, order=order, epochs_per_visit=epochs, runs=runs, pair_ratios=ratios,
                           auto_over_on=over["on"]["wall_s"], auto_over_off=over["off"]["wall_s"],
                           auto_over_best=max(over["on"]["wall_s"], over["off"]["wall_s"]),
                           auto_over_best_cpu=max(over["on"]["cpu_s"], over["off"]["cpu_s"]),
                           max_rel_eval_loss_diff=max(abs(a - losses[-1]) / abs(losses[-1]) for a in losses))
                rows.append(row)
                on_row(rows)
                print(f"[train] {name}: " + ", ".join(
                    f"{m} {r['wall_s']:.1f} s ({' '.join(f'{w:.1f}' for w in r['walls_s'])})" for m, r in runs.items())
                      + f"; auto / on {row['auto_over_on']:.3f}, auto / off {row['auto_over_off']:.3f}", flush=True)
    return rows


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def scenario_report(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        runs = row["runs"]
        auto, on = runs["auto"], runs["on"]
        lines.append(dict(
            model=row["model"], order=row["order"], epochs=f"{row['epochs_per_visit']:g}",
            auto_s=auto["wall_s"], on_s=on["wall_s"], off_s=runs["off"]["wall_s"],
            auto_over_on=f"{row['auto_over_on']:.3f}", auto_over_off=f"{row['auto_over_off']:.3f}",
            auto_over_best=f"{row['auto_over_best']:.3f}", cpu_auto_over_best=f"{row['auto_over_best_cpu']:.3f}",
            auto_sources=" ".join(map(str, auto["sources"])),
            on_sources=" ".join(map(str, on["sources"])),
            auto_predicted_s=auto["predicted_s"], auto_measured_s=auto["measured_s"],
            on_predicted_s=on["predicted_s"], on_measured_s=on["measured_s"],
            loss_diff=f"{row['max_rel_eval_loss_diff']:.1e}"))
    return table(lines, list(lines[0]) if lines else [])


def scenario_main(args: argparse.Namespace, root: Path) -> dict:
    load = [os.getloadavg()[0]]
    started = time.perf_counter()

    def partial(rows: list[dict]) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps(rows, indent=1))

    rows = scenarios(args, root, partial)
    load.append(os.getloadavg()[0])
    return dict(
        benchmark="train scenarios", command=command_line("train", sys.argv[1:]),
        machine=machine(), load_average=load, wall_s=time.perf_counter() - started,
        settings=dict(models=args.scenario_models, data="builtin:pydoc", seq_len=args.seq_len,
                      batch_size=args.batch_size, max_samples=args.scenario_samples, sweeps=args.sweeps, ufp="1/3",
                      repeats=args.scenario_repeats, optimizer="adam", lr=2e-3, store="zarr, float32",
                      threads=torch.get_num_threads()),
        target="auto_over_best <= 1.05", scenarios=rows,
        targets_met=all(r["auto_over_best"] <= 1.05 for r in rows),
    )


# ---- report --------------------------------------------------------------------------------------------------


def report(result: dict) -> str:
    t, p = result["throughput"], result["pieces"]
    rows = [
        dict(quantity="live steps/s (median)", value=f"{t['live_steps_per_s']:.2f}", target=""),
        dict(quantity=f"store steps/s (median, boundary {t['boundary']})", value=f"{t['store_steps_per_s']:.2f}",
             target=""),
        dict(quantity="prefix forward, no_grad (ms)", value=f"{1e3 * p['prefix_s']:.1f}", target=""),
        dict(quantity="suffix forward+backward (ms)", value=f"{1e3 * p['suffix_s']:.1f}", target=""),
        dict(quantity="Adam step of the block (ms, not in ideal)", value=f"{1e3 * p['adam_s']:.1f}", target=""),
        dict(quantity="ideal speedup", value=f"{p['ideal']:.3f}", target=""),
        dict(quantity="achieved speedup (store / live)", value=f"{t['achieved']:.3f}", target=""),
        dict(quantity="achieved / ideal", value=f"{result['achieved_over_ideal']:.3f}", target=">= 0.9"),
        dict(quantity="reader wait, store runs (measured steps)", value=f"{100 * t['wait_fraction']:.2f}%",
             target="<= 2%"),
        dict(quantity="reader wait incl. each visit's first step", value=f"{100 * t['wait_fraction_with_first']:.2f}%",
             target=""),
        dict(quantity="store build, train+eval (s)", value=f"{t['store']['build_s']:.1f}", target=""),
        dict(quantity="store size (MiB)", value=f"{t['store']['stored_MiB']:.0f}", target=""),
        dict(quantity="max rel. loss diff live vs store, per step", value=f"{t['max_rel_loss_diff']:.1e}", target=""),
    ]
    text = table(rows, ["quantity", "value", "target"])
    if "bcd" in result:
        b = result["bcd"]
        bcd_rows = []
        for mode in ("off", "auto"):
            for i, r in enumerate(b["runs"][mode]):
                bcd_rows.append(dict(
                    run=f"{mode} #{i}", wall_s=r["wall_s"], caching_s=r["caching_s"], steps=r["steps"],
                    decisions=" ".join(f"b{d['block']}:{d['decision']}" for d in r["decisions"]) or "-",
                    final_eval_loss=f"{r['final_eval_loss']:.6f}"))
        text += "\n\n" + table(bcd_rows, ["run", "wall_s", "caching_s", "steps", "decisions", "final_eval_loss"])
        text += (f"\nbcd wall time off / auto (medians): {b['off_wall_s']:.1f} / {b['auto_wall_s']:.1f} s = "
                 f"{b['speedup']:.3f}x; max rel. final eval loss difference {b['max_rel_eval_loss_diff']:.1e}")
    return text


def in_root(args: argparse.Namespace, work):
    """`work(root)` in --dir, or in a temporary directory removed afterwards."""
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="preinfer-bench-train-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return work(root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.scenario_worker:
        scenario_worker(args)
        return 0
    if args.store_dtypes:
        result = in_root(args, lambda root: store_dtype_runs(args, root))
        out = args.out.with_name("train_store_dtypes.json" if "," not in args.dtype_seeds
                                 else "train_store_dtypes_seeds.json")
        write(out, result)
        print(f"wrote {out}")
        return 0
    if args.scenarios:
        result = in_root(args, lambda root: scenario_main(args, root))
        write(args.out, result)
        print(scenario_report(result["scenarios"]))
        print(f"auto within 1.05x of the better of on and off in every scenario: {result['targets_met']}")
        print(f"wrote {args.out} in {result['wall_s']:.0f} s")
        return 0
    started = time.perf_counter()
    load = [os.getloadavg()[0]]

    def measure(root: Path) -> dict:
        t = throughput(args, root)
        p = pieces(args, t.pop("staged"), t.pop("partition"), t.pop("active_index"), t.pop("data"))
        load.append(os.getloadavg()[0])
        result = dict(
            benchmark="train", command=command_line("train", argv if argv is not None else sys.argv[1:]),
            machine=machine(),
            settings=dict(model=args.model, data="builtin:pydoc", seq_len=args.seq_len, batch_size=args.batch_size,
                          dtype="float32", store="zarr, dtype auto, default codec", optimizer="adam", lr=2e-3,
                          steps=args.steps, warmup=args.warmup, repeats=args.repeats, samples=args.samples,
                          threads=torch.get_num_threads(),
                          omp_wait_policy=os.environ.get("OMP_WAIT_POLICY")),
            targets=TARGETS, throughput=t, pieces=p, achieved_over_ideal=t["achieved"] / p["ideal"],
        )
        if args.bcd_repeats > 0:
            result["bcd"] = bcd(args, root)
            load.append(os.getloadavg()[0])
        return result

    result = in_root(args, measure)
    result["targets_met"] = dict(achieved_over_ideal=result["achieved_over_ideal"] >= 0.9,
                                 wait_fraction=result["throughput"]["wait_fraction"] <= 0.02)
    result["load_average"] = load
    result["wall_s"] = time.perf_counter() - started
    write(args.out, result)
    print(f"{args.model}, seq {args.seq_len}, batch {args.batch_size}, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in load)}")
    print(report(result))
    print(f"targets met: {result['targets_met']}")
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
