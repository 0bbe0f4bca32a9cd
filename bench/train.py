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
   --scenario-orders x --scenario-epochs per visit (by default {ascending, descending} x {a tenth of an epoch, 1
   epoch, 3 epochs}) x --sweeps sweeps on each of
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
    python -m bench.train --scenarios --scenario-models small-llama,tiny-gpt2 --scenario-orders ascending \
        --scenario-epochs 2 --sweeps 1 --scenario-repeats 3   # one sweep of 20-step visits (issue 47)
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

from bench.lib.common import OUT, command_line, machine, table
from bench.lib.from_store import pieces, store_dtype_runs, throughput
from bench.lib.scenarios import scenario_main, scenario_report, scenario_run
from bench.lib.train_runs import base_config, timed_run
from preinfer.metrics import CacheRecord, PreInferenceRecord
from preinfer.config import LR_DECAYS

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
    p.add_argument("--scenario-orders", default="ascending,descending", help="[ascending,descending]")
    p.add_argument("--scenario-epochs", default="0.1,1,3", help="epochs a visit of the scenarios [0.1,1,3]")
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


# ---- 4: whole bcd runs ---------------------------------------------------------------------------------------


def bcd_run(args: argparse.Namespace, mode: str, out: Path) -> dict:
    config = base_config(args, data=dict(max_samples=args.bcd_samples),
                         blocks=dict(sweeps=args.sweeps, order="ascending"),
                         stop=dict(epochs_per_visit=args.bcd_epochs),
                         run=dict(out=str(out)), pre_inference=dict(mode=mode, store_dir=str(out.parent / f"{out.name}-stores")))
    summary, records, wall, _ = timed_run(config, out)
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


# ---- 5: the scenario table's worker process ------------------------------------------------------------------


def scenario_worker(args: argparse.Namespace) -> None:
    spec = json.loads(args.scenario_worker)
    run = scenario_run(args, spec["model"], spec["order"], spec["epochs"], spec["mode"], Path(spec["out"]))
    args.result.write_text(json.dumps(run))


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
