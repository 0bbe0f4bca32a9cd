"""Peers side by side (issue 12): BAdam's `BlockOptimizer`, a plain per-block PyTorch loop and `preinfer bcd`.

Every method trains the same model (a preset, random initialisation with the run's seed, cast to the resident
dtype of --precision, running the attention implementation of --attention), on the same batches in the same order (the token batches `preinfer bcd` reads:
`pipelines.data.batches.token_batches` of the run's training split, same seed and shard size), the same blocks (the
layer ranges of --ranges; the embedding with the first block, the final norm and head with the last), in
ascending order, for the same steps per block, with Adam (lr, betas, no weight decay, no warmup, no clipping):

- `plain`: a plain PyTorch loop, per block: freeze everything, unfreeze the block, build a fresh Adam (under
  bf16-mixed over fp32 master copies of the block: the bf16 gradients are cast into them after backward and the
  masters are copied back into the bf16 weights after each step), then step; the forward is the framework's own
  (`model(input_ids, attention_mask, labels).loss`). Its batches are read into memory before the clock starts.
- `badam`: BAdam's `BlockOptimizer` (`pip install badam`, a benchmark-only extra: `pip install -e .[peers]`)
  wrapping the same Adam, with `block_prefix_list` naming each block's parameters, `switch_mode="ascending"`,
  `switch_block_every` = the steps per block; the same loop and batches as `plain` otherwise.
- `hf-trainer`: `preinfer.hf.BlockCoordinateDescent` (docs/trainer.md) in `transformers.Trainer`, over the same
  batches (their samples in order, `train_sampling_strategy="sequential"`, the same batch size) and blocks, with
  the same Adam and no clipping; steps/s from each visit's first step's start to its last step's end (Trainer's
  callbacks), tracked peak from the integration's own meter. Target: at least 0.95x `preinfer` (x_preinfer).
- `preinfer`: the real command line, `python -m pipelines.cli bcd ... --pre-inference off --expand none` in its
  own process (the settings above as flags); `preinfer-auto`: the same with `--pre-inference auto`;
  `preinfer-defaults`: the same with `bcd`'s default expansion (`--expand auto`: lowrank over the layers above the
  block), which the peers do not make.

Goals (issue 47), checked after every comparison that has BAdam beside them: `preinfer` at least 1.0x BAdam's
steps/s, `preinfer-defaults` at least 0.95x (`X_BADAM_GOALS`). A missed goal is a line on stderr naming the method,
its ratio and the goal, and the exit status is 1, so that `python -m bench.peers --guard` (BAdam, `preinfer` and
`preinfer-defaults`, bf16-mixed, 3 rounds, no long visit) fails loudly: run it before every stop that touches the
trainer's step.

Each run is a process of its own, with the command line's own environment (`pipelines.cli.PROCESS_ENVIRONMENT`:
`OMP_WAIT_POLICY=PASSIVE` unless the environment sets it), which `preinfer bcd` sets for itself: without it the
workers' OpenMP threads spin while they wait, and on busy cores a tiny-llama step of the Trainer or the plain loop
took 100-3000 ms against preinfer's 20 ms (docs/trainer.md, "Speed"). The methods alternate (A B C A B C ...) for --repeats rounds and the table
shows medians, because the machine is shared. Measured per run:

- steps/s: the steps over the training time, which is, per block, from the start of the visit (plain, badam:
  the optimizer is built inside it) to the end of its last step, summed over the blocks; evaluation and model
  loading are outside it. For `preinfer` that is the sum of its visits' `wall_s` (metrics.jsonl); for
  `preinfer-auto` the time spent building stores (its `cache` records) is added.
- tracked peak memory: `preinfer.memory.meter.MemoryMeter` on the same steps for every method (the steps the trainer
  meters, `MemoryMeter.due`): weights, master copies, gradients (sampled after the optimizer step, where
  they and the optimizer state are all present), optimizer state and saved activations.
- final eval loss: one function for all (`eval_loss`): each run's final weights, saved with `save_pretrained`
  (preinfer: its export), loaded by `transformers.AutoModelForCausalLM`, cast to float32, mean next-token loss of
  the framework's forward over the first --eval-batches batches of the eval split.

The long visit (--long-steps, 0 to skip): one block (the first of --ranges) trained by preinfer for that many
steps (`--active`), in windows of --window steps, against the plain loop over the same seconds of the clock. The
plain loop paces it: it runs at the same time with one thread, starts stepping before the trainer's process
starts and keeps stepping over its batches until that process has ended (`bench.lib.common.run_paced`). A window's
ratio is the trainer's tokens/s over its steps (their end times on the clock: the step records' `time`) against
the plain loop's tokens/s over the same seconds (its steps counted between its step ends), so both meet the same
machine at the same moments: a shared machine's speed moves by tens of percent within minutes, more than the 3%
to be judged. By default (--long-cores shared) both run on core 0 and share it: the kernel's scheduler gives each
half of it, so a window's ratio is the two loops' work per CPU-second on the same core at the same moments (one
core's own slowdowns, which a core of its own each would not share, cancel too); --long-cores own gives each a
core of its own, swapped from one round to the next. Target: in every window the trainer at least 0.97x the
plain loop (median over the rounds of each window's ratio).

    python -m bench.peers                                  # bf16-mixed, all four, the long visit
    python -m bench.peers --precision fp32 --methods plain,preinfer --long-steps 0     # the hot path alone
    python -m bench.peers --quick                          # tiny-llama, a few steps, plain and preinfer (~1.5 min)
    python -m bench.peers --guard                          # the goals against BAdam; exit 1 when one is missed

bf16 matmuls are 5-25x slower than float32 on CPUs without AVX-512 BF16 or AMX (a small-llama step at seq 128 x 8:
28 s against 1.1 s on the 2-core machine of docs/results.md), where the default bf16-mixed run takes hours:
there, time the hot path with --precision fp32 and compare the peers in bf16-mixed at a small --seq-len and
--batch-size (the commands in docs/results.md).

Prints tables and writes bench/out/peers.json (--out). On a shared machine, run it when no other benchmark
runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.lib.common import OUT, ROOT, command_line, machine, module_command, run_paced, table
from bench.lib.peer_loops import run_worker
from bench.lib.runs import bcd_flags, eval_loss, preinfer_result, split_batches
from pipelines.cli import set_process_environment
from preinfer.config import ATTENTIONS

METHODS = ("plain", "badam", "hf-trainer", "preinfer", "preinfer-auto", "preinfer-defaults")
# Each method's least steps/s against BAdam's on the same work (median over rounds of the same round's ratio).
X_BADAM_GOALS = {"preinfer": 1.0, "preinfer-defaults": 0.95}
TARGETS = dict(steps_per_s=1.0, window=0.97, eval_loss=0.01, hf_trainer_x_preinfer=0.95, x_badam=X_BADAM_GOALS)
GUARD_METHODS = "badam,preinfer,preinfer-defaults"


# ---------------------------------------------------------------------------------------------------------------
# One run of each method, as a process of its own.


def method_command(method: str, flags: list[str], scratch: Path,
                   pace: tuple[Path, Path] | None = None) -> tuple[list[str], Callable[[], dict]]:
    """The command that runs `method` with the bcd `flags` (`pace`: the plain loop as a pacer, see
    `plain_worker`), and what reads its result once it has ended: steps, training seconds, per-step stamps and
    clock times, tracked peak, model dir."""
    if method.startswith("preinfer"):
        out = Path(flags[flags.index("--out") + 1])
        return [sys.executable, "-m", "pipelines.cli", "bcd", *flags], lambda: preinfer_result(out)
    result = scratch / f"{method}.json"
    command = [*module_command("peers"), "--worker", method, "--result", str(result)]
    if pace is not None:
        command += ["--ready", str(pace[0]), "--until", str(pace[1])]
    return [*command, "--", *flags], lambda: json.loads(result.read_text())


def run_method(method: str, flags: list[str], scratch: Path) -> dict:
    """Run `method` with the bcd `flags` alone on the machine."""
    command, result = method_command(method, flags, scratch)
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # BAdam prints its blocks
    return result()


def eval_batches(args: argparse.Namespace, flags: list[str]) -> list[dict]:
    """The first --eval-batches batches of the run's eval split, in order."""
    return split_batches(flags, "eval", args.eval_batches)


# ---------------------------------------------------------------------------------------------------------------
# The comparison.


def compare(args: argparse.Namespace, scratch: Path) -> dict:
    """Every method, alternating for --repeats rounds: medians of steps/s, tracked peak, final eval loss."""
    methods = args.methods.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    batches = None
    for round_ in range(args.repeats):
        for method in methods:
            out = scratch / f"{method}-{round_}"
            flags = bcd_flags(args, out, args.steps, args.ranges, args.seq_len, args.batch_size,
                              pre_inference="auto" if method == "preinfer-auto" else "off",
                              expand="auto" if method == "preinfer-defaults" else "none")
            batches = batches or eval_batches(args, flags)
            run = run_method(method, flags, scratch)
            run["eval_loss"] = eval_loss(run.pop("model_dir"), batches)
            run["steps_per_s"] = run["steps"] / run["train_s"]
            runs[method].append(run)
            print(f"[peers] round {round_} {method}: {run['steps_per_s']:.3f} steps/s, tracked peak "
                  f"{run['tracked_peak'] / 2**20:.1f} MiB, eval loss {run['eval_loss']:.5f}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    rows = []
    for method, done in runs.items():
        rows.append(dict(method=method, steps=done[0]["steps"],
                         steps_per_s=statistics.median(r["steps_per_s"] for r in done),
                         steps_per_s_runs=[r["steps_per_s"] for r in done],
                         tracked_peak_mib=statistics.median(r["tracked_peak"] for r in done) / 2**20,
                         eval_loss=statistics.median(r["eval_loss"] for r in done),
                         caching_s=statistics.median(r.get("caching_s", 0.0) for r in done),
                         sources=done[0].get("sources")))
    add_ratios(rows, runs)
    return dict(rows=rows, runs={m: [{k: v for k, v in r.items() if k != "stamps"} for r in done]
                                 for m, done in runs.items()})


def add_ratios(rows: list[dict], runs: dict[str, list[dict]]) -> None:
    """Each method's steps/s over plain's, BAdam's and preinfer's (median over rounds of the same round's ratio), peak over
    BAdam's, eval loss against plain's."""
    for row in rows:
        mine = runs[row["method"]]
        for peer in ("plain", "badam", "preinfer"):
            if peer in runs:
                theirs = runs[peer]
                row[f"x_{peer}"] = statistics.median(a["steps_per_s"] / b["steps_per_s"] for a, b in zip(mine, theirs))
        if "badam" in runs:
            row["peak_x_badam"] = row["tracked_peak_mib"] / (statistics.median(r["tracked_peak"] for r in runs["badam"]) / 2**20)
        if "plain" in runs:
            plain = statistics.median(r["eval_loss"] for r in runs["plain"])
            row["eval_vs_plain"] = row["eval_loss"] / plain - 1


def missed_goals(rows: list[dict]) -> list[str]:
    """One line per method below its goal against BAdam (`X_BADAM_GOALS`; rows without BAdam beside them are not
    judged)."""
    missed = [row for row in rows if row["method"] in X_BADAM_GOALS and "x_badam" in row
              and row["x_badam"] < X_BADAM_GOALS[row["method"]]]
    return [f"bench.peers: goal missed: {row['method']} ran at {row['x_badam']:.3f}x BAdam's steps/s, below the "
            f"goal of {X_BADAM_GOALS[row['method']]:.2f}x (its rounds: "
            f"{', '.join(f'{v:.3f}' for v in row['steps_per_s_runs'])} steps/s)" for row in missed]


def aligned_windows(trainer: dict, plain: dict, size: int, tokens_per_step: int) -> list[tuple[float, float]]:
    """(trainer, plain) tokens/s of each full window of `size` of the trainer's steps: the trainer's over its
    steps, the plain loop's over the same seconds of the clock (its steps done, interpolated between its step
    ends)."""
    edges = [trainer["times"][0] - trainer["stamps"][0], *trainer["times"]]  # the visit's start, each step's end
    clock = plain["times"]
    if clock[0] > edges[0] or clock[-1] < edges[-1]:
        raise RuntimeError(f"the plain loop paced {clock[0]:.1f}-{clock[-1]:.1f} on the clock, not all of the "
                           f"trainer's visit, {edges[0]:.1f}-{edges[-1]:.1f}")

    def done(t: float) -> float:
        return float(np.interp(t, clock, np.arange(1, len(clock) + 1)))

    out = []
    for start in range(0, len(edges) - size, size):
        begin, end = edges[start], edges[start + size]
        seconds = end - begin
        out.append((size * tokens_per_step / seconds, (done(end) - done(begin)) * tokens_per_step / seconds))
    return out


def long_visit(args: argparse.Namespace, scratch: Path) -> dict:
    """One block for --long-steps steps of preinfer, paced by the plain loop: tokens/s per window of both."""
    first = args.ranges.split(",")[0]
    per_step = args.long_seq_len * args.long_batch_size
    found: dict[str, list[list[float]]] = {"plain": [], "preinfer": []}
    for round_ in range(args.long_repeats):
        ready, done = scratch / f"long-ready-{round_}", scratch / f"long-done-{round_}"
        (pacer, plain), (measured, trainer) = (
            method_command(method, bcd_flags(args, scratch / f"long-{method}-{round_}", args.long_steps, args.ranges,
                                             args.long_seq_len, args.long_batch_size, active=first), scratch, pace)
            for method, pace in (("plain", (ready, done)), ("preinfer", None)))
        cores = (0, 0) if args.long_cores == "shared" else (0, 1) if round_ % 2 == 0 else (1, 0)
        run_paced(pacer, measured, ROOT, ready, done, cores=cores)
        pairs = aligned_windows(trainer(), plain(), args.window, per_step)
        found["preinfer"].append([mine for mine, _ in pairs])
        found["plain"].append([theirs for _, theirs in pairs])
        print(f"[peers] long visit round {round_}: tokens/s by window, preinfer / plain at the same time: "
              f"{', '.join(f'{a:.0f}/{b:.0f}' for a, b in pairs)}", flush=True)
        for method in found:
            shutil.rmtree(scratch / f"long-{method}-{round_}", ignore_errors=True)
    count = len(found["preinfer"][0])
    rows = []
    for i in range(count):
        plain = [w[i] for w in found["plain"]]
        mine = [w[i] for w in found["preinfer"]]
        ratio = statistics.median(a / b for a, b in zip(mine, plain))
        rows.append(dict(window=f"{i * args.window + 1}-{(i + 1) * args.window}", plain=statistics.median(plain),
                         preinfer=statistics.median(mine), ratio=ratio, holds=ratio >= TARGETS["window"]))
    decay = {m: statistics.median(w[count - 1] / w[0] - 1 for w in runs) for m, runs in found.items()}
    return dict(block=first, steps=args.long_steps, seq_len=args.long_seq_len, batch_size=args.long_batch_size,
                window_steps=args.window, windows=rows, runs=found, decay_first_to_last=decay,
                holds=all(r["holds"] for r in rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--model", default="small-llama")
    p.add_argument("--data", default="builtin:pydoc")
    p.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed"])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ranges", default="0-1,2-3,4-5", help="the blocks, as inclusive layer ranges")
    p.add_argument("--steps", type=int, default=40, help="steps per block")
    p.add_argument("--attention", choices=ATTENTIONS, help="every method's attention implementation, as `preinfer bcd "
                   "--attention` [its default]")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-samples", type=int, default=0, help="first N samples of each split; 0 = all")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the alternating comparison")
    p.add_argument("--eval-batches", type=int, default=16, help="eval batches of the final eval loss")
    p.add_argument("--long-steps", type=int, default=720, help="steps of the long visit; 0 skips it")
    p.add_argument("--long-seq-len", type=int, default=64)
    p.add_argument("--long-batch-size", type=int, default=4)
    p.add_argument("--long-repeats", type=int, default=2)
    p.add_argument("--window", type=int, default=50, help="steps per window of the long visit")
    p.add_argument("--long-cores", choices=["shared", "own"], default="shared",
                   help="the long visit's plain loop and trainer both on core 0, sharing it (shared), or each on a "
                        "core of its own, swapped from one round to the next (own)")
    p.add_argument("--out", type=Path, default=OUT / "peers.json")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny-llama, seq 32, batch 2, 3 steps per block, plain and preinfer")
    p.add_argument("--guard", action="store_true",
                   help=f"the check before a stop: {GUARD_METHODS}, 10 steps per block, 3 rounds, no long visit; "
                        f"exit 1 when a goal against BAdam is missed")
    p.add_argument("--worker", choices=["plain", "badam", "hf-trainer"], help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--until", type=Path, help=argparse.SUPPRESS)
    p.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.guard:
        args.methods, args.steps, args.repeats, args.long_steps, args.eval_batches = GUARD_METHODS, 10, 3, 0, 2
    if args.quick:
        args.model, args.seq_len, args.batch_size, args.steps, args.max_samples = "tiny-llama", 32, 2, 3, 64
        args.ranges, args.repeats, args.eval_batches = "0-1,2-3", 1, 2
        args.long_steps, args.long_seq_len, args.long_batch_size, args.long_repeats, args.window = 8, 32, 2, 1, 4
        if args.methods == ",".join(METHODS):
            args.methods = "plain,preinfer"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_process_environment()  # every method's process gets the OpenMP setting `preinfer bcd` gives itself
    if args.worker:
        run_worker(args.worker, args.flags, args.result, args.ready, args.until)
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        scratch = Path(tmp)
        comparison = compare(args, scratch)
        long = long_visit(args, scratch) if args.long_steps else None
    result = dict(benchmark="peers", command=command_line("peers", argv or sys.argv[1:]),
                  machine=machine(), settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                               if k not in ("worker", "result", "ready", "until", "flags")},
                  targets=TARGETS, **comparison, long_visit=long, wall_s=time.perf_counter() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    columns = ["method", "steps", "steps_per_s",
               *[c for c in ("x_plain", "x_badam", "x_preinfer") if c in result["rows"][0]],
               "tracked_peak_mib", *(["peak_x_badam"] if "peak_x_badam" in result["rows"][0] else []), "eval_loss",
               *(["eval_vs_plain"] if "eval_vs_plain" in result["rows"][0] else [])]
    print(table(result["rows"], columns))
    if long is not None:
        print(table(long["windows"], ["window", "plain", "preinfer", "ratio", "holds"]))
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    missed = missed_goals(result["rows"])
    for line in missed:
        print(line, file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
