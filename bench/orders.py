"""Block orders side by side (issue 27, item 4): time and epochs to full Adam's plateau loss for each visit order of
BCD-Adam with pre-inference, and the reference's UFP table at the best order.

Every method is a `python -m pipelines.cli bcd ...` process of its own, run one after the other, on the same
model, data, seed, sequence length and batch size, with Adam (lr --lr, betas --betas, no weight decay, gradient
clipping at --grad-clip, --warmup steps of linear warmup at the start of every visit; the same lr for both
families unless --bcd-lr), in float32, evaluating after every visit on the eval split (its first --eval-tokens
tokens; 0, the default: all of it), each visit --visit-epochs epochs (`--epochs-per-visit`; default 1, a fraction
such as 1/3 evaluates a setup that plateaus within an epoch more often):

- `full`: full-parameter Adam, `--mode full --keep-optimizer-state`, up to --full-epochs epochs: one visit, and so
  one evaluation, per --visit-epochs, Adam's state kept across them (each visit warms up again, as every BCD visit
  does).
  Its plateau is the first evaluation after which its best eval loss improves by less than --plateau-rel over
  the next --plateau-window evaluations (`bench.lib.curves.plateau_point`, computed after the run). **The target**
  is its best eval loss once the plateau is seen (the best of the evaluations up to the plateau's plus the
  window: where a run that stopped at its plateau would have stopped), or the best of the whole run when it
  still improves at the cap.
- one row per order of --orders (`ascending`, `descending`, `random`, `importance`, `importance-cached`): BCD-Adam
  at UFP 1/3 (`--ufp 1/3`), `--pre-inference auto`, up to --sweeps x 3 visits: `--total-steps` of that many
  visits' steps (full Adam's first visit's), with `--sweeps --sweeps` for a fixed order and as many sweeps as steps
  for an importance order (whose sweeps may visit fewer blocks, down to one, and with --stop gain end visits early:
  the step budget, not the sweeps, ends it, so every row has the same cap in epochs). --gain adds a row
  `ORDER+gain` for each importance order, the same run with `--stop gain` (a visit also ends when another block
  would gain more). --levers adds a row `ORDER+LEVER` for each order and lever of issue 38: `none`, `lowrank` and
  `sgd` (`--expand`; a row without a lever runs the default, `auto`, which is lowrank here and none with `keep`),
  `keep` (`--keep-optimizer-state`).

Measured per row, from the run's metrics.jsonl (`bench.lib.runs.cli_result`): the eval loss at each visit's end
against cumulative training time (the visits' `wall_s`, plus the seconds of `cache` records, store building, and
of `importance` records, an importance order's measurement; evaluation excluded) and against epochs (steps over
an epoch's steps: full Adam's first visit's over --visit-epochs; one pass over the training split). Then:

- time and epochs to target: those of the first evaluation at or below the target (None if none is);
- `x_time`, `x_epochs`: their ratios to full Adam's own time and epochs to the target. Goals: x_time <= 0.6,
  x_epochs <= 1.15;
- `best_vs_full_pct`: the row's best eval loss over full Adam's best, in percent above it. Goal: <= 0.5;
- the tracked peak memory (the largest `memory.tracked_peak` of its visits), store building and importance time.

The UFP table (the reference's: peak memory and epochs to converge at UFP 1/2, 1/3 and 1/4) is made at the best
row: the one with the smallest time to target (--ufp-order names another; when no row reaches the target, the
one with the lowest best eval loss). Its 1/3 run is reused; the others run with the same cap of epochs (sweeps
ceil(--sweeps x 3 x UFP), and the same step budget); --ufps names the UFPs (`--ufps 1/3` reuses that run alone).
Per UFP: blocks, tracked peak (and its ratio to full Adam's), epochs to the target and epochs to its own plateau
(same rule as full Adam's; None while still improving).

Default setup: small-llama over builtin:pydoc with the byte tokenizer (the defaults of `bench.quality
--until-plateau`: seq 128, batch 8, lr 2e-3, betas 0.9,0.95, clipping 1.0), cut to the first 720 training samples
(--max-samples; 90 steps an epoch; the eval split has 381 samples), full Adam up to 12 epochs, every order up to
6 sweeps (18 epochs at 3 blocks). Sizing, measured on 2 idle cores: `--max-samples 480 --full-epochs 8
--sweeps 4 --gain` (every row capped at 12 epochs, the UFP table's three runs included) took 34 minutes; the
gain rows cost about 1.2x an importance row's training time and evaluate every 8 or so steps. The default, 1.5x
those samples and epochs, is about twice that (predicted, not measured).

    python -m bench.orders                        # small-llama over pydoc (about 70 min on 2 idle cores)
    python -m bench.orders --gain                 # also importance orders with --stop gain
    python -m bench.orders --model ~/.cache/preinfer/models/smollm2-135m-instruct --lr 1e-4 --bcd-lr 3e-4 \\
        --batch-size 4 --max-samples 192 --visit-epochs 1/3 --eval-tokens 8192 --full-epochs 2 --sweeps 2 \\
        --warmup 4 --gain --ufps 1/3 --out bench/out/orders-smollm2.json
                                                  # the SmolLM2-135M fine-tuning setup (bench.checkpoint makes
                                                  # the directory; full Adam at 1e-4 and BCD-Adam at 3e-4, the best
                                                  # of bench.finetune's grid on text): a pretrained model that
                                                  # plateaus within about an epoch, evaluated every third of one
    python -m bench.orders --quick                # smoke run: tiny-llama, 2 sweeps, every order, the UFP table

--model takes a preset or a model directory, --data any corpus `preinfer bcd --data` reads, --tokenizer
`preinfer bcd --tokenizer` (auto: the directory's own, the byte tokenizer for a preset).

Prints the tables and writes bench/out/orders.json (--out) and, beside it with the same stem, a plot of eval loss
against training time and against epochs, one line per row plus full Adam, the target drawn across.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

from bench.lib.common import OUT, ROOT, command_line, machine, table
from bench.lib.order_curves import TARGETS, add_epochs, best_row, full_summary, order_summary, ufp_row
from bench.lib.runs import cli_result
from pipelines import cli
from pipelines.cli import set_process_environment

ORDERS = ("ascending", "descending", "random", "importance", "importance-cached")
IMPORTANCE_ORDERS = ("importance", "importance-cached")
# A row's suffix after its order (`ORDER+SUFFIX`) and the flags it adds: `gain` for importance orders (--gain), the
# levers of issue 38 for every order (--levers).
SUFFIX_FLAGS = {"gain": ["--stop", "gain"], "none": ["--expand", "none"], "lowrank": ["--expand", "lowrank"],
                "sgd": ["--expand", "sgd"], "keep": ["--keep-optimizer-state"]}
LEVERS = ("none", "lowrank", "sgd", "keep")
UFPS = ("1/2", "1/3", "1/4")


# ---------------------------------------------------------------------------------------------------------------
# The runs.


def shared_flags(args: argparse.Namespace, out: Path) -> list[str]:
    """The `preinfer bcd` flags every run shares: model, data, Adam, one epoch a visit, evaluation, seed."""
    flags = ["--model", args.model, "--tokenizer", args.tokenizer, "--data", args.data, "--seq-len", str(args.seq_len),
             "--batch-size", str(args.batch_size), "--optimizer", "adam", "--betas", args.betas, "--weight-decay",
             "0", "--warmup-steps", str(args.warmup), "--grad-clip", str(args.grad_clip), "--precision", "fp32",
             "--eval-tokens", str(args.eval_tokens), "--epochs-per-visit", str(float(args.visit_epochs)),
             "--seed", str(args.seed), "--out", str(out)]
    return flags + (["--max-samples", str(args.max_samples)] if args.max_samples else [])


def full_flags(args: argparse.Namespace, out: Path) -> list[str]:
    """Full-parameter Adam, one visit (and evaluation) per --visit-epochs, up to --full-epochs."""
    return [*shared_flags(args, out), "--lr", str(args.lr), "--mode", "full", "--keep-optimizer-state", "--sweeps",
            str(math.ceil(args.full_epochs / args.visit_epochs))]


def bcd_flags(args: argparse.Namespace, out: Path, row: str, ufp: str, visit_steps: int) -> list[str]:
    """BCD-Adam of a row (`ORDER` or `ORDER+gain`) at `ufp`, pre-inference auto, capped at --sweeps x 3 visits of
    `visit_steps` steps: a step budget of them, and the sweeps holding them (for an importance order, whose sweeps
    may visit one block and, with `--stop gain`, end a visit early, as many sweeps as steps)."""
    order, _, suffix = row.partition("+")
    total = args.sweeps * 3 * visit_steps
    sweeps = total if order in IMPORTANCE_ORDERS else sweeps_at(args.sweeps, ufp)  # a sweep: at least one step
    flags = [*shared_flags(args, out), "--lr", str(args.bcd_lr or args.lr), "--ufp", ufp, "--order", order,
             "--sweeps", str(sweeps), "--total-steps", str(total), "--pre-inference", "auto"]
    return flags + SUFFIX_FLAGS.get(suffix, [])


def sweeps_at(sweeps: int, ufp: str) -> int:
    """Sweeps at `ufp` holding the epochs of `sweeps` at UFP 1/3."""
    return max(1, math.ceil(sweeps * 3 * Fraction(ufp)))


def rows_of(args: argparse.Namespace) -> list[str]:
    """The rows to run: every order of --orders, with --gain each importance order again with `--stop gain`, and
    each order again with each lever of --levers."""
    orders, levers = args.orders.split(","), [lever for lever in args.levers.split(",") if lever]
    unknown = [o for o in orders if o not in ORDERS] + [lever for lever in levers if lever not in LEVERS]
    if unknown:
        raise SystemExit(f"orders: --orders or --levers names {', '.join(unknown)}; expected some of "
                         f"{', '.join(ORDERS)} and of {', '.join(LEVERS)}")
    gain = [f"{o}+gain" for o in orders if o in IMPORTANCE_ORDERS] if args.gain else []
    return orders + gain + [f"{o}+{lever}" for o in orders for lever in levers]


def run(name: str, flags: list[str], in_process: bool = False) -> dict:
    """Run `preinfer bcd FLAGS` in a process of its own (`in_process`: in this one, its prints in the same log); its
    curve (eval loss at each visit's end against training time), tracked peak and store-building time, its blocks,
    and the process's seconds."""
    started = time.perf_counter()
    out = Path(flags[flags.index("--out") + 1])
    log = out.with_suffix(".log")
    with log.open("w") as sink:
        if in_process:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                code = cli.main(["bcd", *flags])
        else:
            code = subprocess.run([sys.executable, "-m", "pipelines.cli", "bcd", *flags], cwd=ROOT, stdout=sink,
                                  stderr=subprocess.STDOUT).returncode
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"orders: the {name} run failed (exit {code}); its output ends:\n{tail}")
    result = cli_result(out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scores = [r["scores"] for r in records if r["kind"] == "importance"]
    result["blocks"] = len(scores[0]) if scores else 1 + max(r["block"] for r in records if r["kind"] == "visit")
    result["importance_s"] = sum(r["seconds"] for r in records if r["kind"] == "importance")
    result["stop_reasons"] = [r["stop_reason"] for r in records if r["kind"] == "visit"]
    result["run_s"] = time.perf_counter() - started
    return {k: v for k, v in result.items() if k not in ("stamps", "times", "model_dir")}


# ---------------------------------------------------------------------------------------------------------------
# The comparison.


def measured(name: str, flags: list[str], epoch_steps: float, in_process: bool) -> dict:
    """`run`, its curve in epochs of `epoch_steps` steps."""
    result = run(name, flags, in_process)
    return dict(result, curve=add_epochs(result["curve"], epoch_steps))


def compare(args: argparse.Namespace, scratch: Path) -> dict:
    """Full Adam, every row at UFP 1/3, then the UFP table at the best row."""
    rel, window = args.plateau_rel, args.plateau_window
    print(f"[orders] full Adam: up to {args.full_epochs} epochs", flush=True)
    full = run("full", full_flags(args, scratch / "full"), args.in_process)
    visit_steps = full["curve"][0]["step"]
    epoch_steps = visit_steps / float(args.visit_epochs)
    full = full_summary(dict(full, curve=add_epochs(full["curve"], epoch_steps)), rel, window)
    print(f"[orders] full Adam: target {full['target']:.4f} (plateau at epoch {full['plateau_epochs']}), reached "
          f"after {full['time_to_target']:.1f} s, {full['epochs_to_target']:.2f} epochs", flush=True)
    rows = []
    for name in rows_of(args):
        result = measured(name, bcd_flags(args, scratch / name, name, "1/3", visit_steps), epoch_steps,
                          args.in_process)
        rows.append(order_summary(name, result, full, rel, window))
        print(f"[orders] {name}: best {rows[-1]['best_eval_loss']:.4f} ({rows[-1]['best_vs_full_pct']:+.2f}%), "
              f"x_time {cell(rows[-1]['x_time'])}, x_epochs {cell(rows[-1]['x_epochs'])}", flush=True)
    best = best_row(rows, args.ufp_order)
    ufps = []
    for ufp in args.ufps.split(","):
        if ufp == "1/3":
            done = best
        else:
            out = scratch / f"{best['row']}-ufp{ufp.replace('/', '_')}"
            done = order_summary(best["row"], measured(f"{best['row']} at UFP {ufp}",
                                                      bcd_flags(args, out, best["row"], ufp, visit_steps),
                                                      epoch_steps, args.in_process),
                                 full, rel, window)
        ufps.append(ufp_row(ufp, done, full))
    return dict(epoch_steps=epoch_steps, full=full, rows=rows, best=best["row"], ufp_table=ufps)


def plot(full: dict, rows: list[dict], path: Path, title: str) -> None:
    """Eval loss against training time and against epochs, one line per row plus full Adam, the target across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    for axis, x, label in zip(axes, ("train_s", "epochs"), ("training time (s)", "epochs")):
        for row in (full, *rows):
            axis.plot([p[x] for p in row["curve"]], [p["eval_loss"] for p in row["curve"]], marker="o",
                      markersize=3, label="full Adam" if row is full else row["row"],
                      color="black" if row is full else None, linewidth=2 if row is full else 1)
        axis.axhline(full["target"], color="grey", linestyle=":", label=f"target {full['target']:.4f}")
        axis.set(xlabel=label, ylabel="eval loss", title=f"{title}: eval loss against {label.split(' (')[0]}")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def cell(value: object) -> object:
    """A table cell: None as '-', losses and ratios to 4 significant places."""
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else value


# ---------------------------------------------------------------------------------------------------------------
# The command line.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.orders", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--orders", default=",".join(ORDERS), help=f"comma-separated, of {', '.join(ORDERS)}")
    p.add_argument("--gain", action="store_true", help="also each importance order with --stop gain")
    p.add_argument("--levers", default="", help=f"also each order with each of these, comma-separated, of "
                   f"{', '.join(LEVERS)} (--expand none, lowrank or sgd, --keep-optimizer-state)")
    p.add_argument("--model", default="small-llama", help="a preset or a model directory")
    p.add_argument("--data", default="builtin:pydoc")
    p.add_argument("--tokenizer", default="auto", help="as `preinfer bcd --tokenizer`")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, default=720, help="first N samples of each split; 0 = all")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate (both families)")
    p.add_argument("--bcd-lr", type=float, help="BCD-Adam's learning rate [--lr]")
    p.add_argument("--betas", default="0.9,0.95")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--visit-epochs", type=Fraction, default=Fraction(1),
                   help="epochs a visit (full Adam's too), e.g. 1/3: an evaluation each")
    p.add_argument("--eval-tokens", type=int, default=0, help="evaluate on the eval split's first N tokens; 0 = all")
    p.add_argument("--warmup", type=int, default=10, help="warmup steps at the start of every visit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-epochs", type=int, default=12, help="full Adam's cap, in epochs (one a visit)")
    p.add_argument("--sweeps", type=int, default=6, help="each order's cap at UFP 1/3, in sweeps (one epoch a visit)")
    p.add_argument("--plateau-rel", type=float, default=0.005,
                   help="plateau: the best eval loss improves by less than this fraction ...")
    p.add_argument("--plateau-window", type=int, default=3, help="... over this many further evaluations (epochs)")
    p.add_argument("--ufps", default=",".join(UFPS), help="the UFP table's UFPs, comma-separated, of "
                   f"{', '.join(UFPS)}")
    p.add_argument("--ufp-order", help="the row (ORDER or ORDER+gain) of the UFP table [the fastest to the target]")
    p.add_argument("--out", type=Path, default=OUT / "orders.json")
    p.add_argument("--in-process", action="store_true", help="run every row in this process (smoke tests)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny-llama, seq 32, batch 4, 32 samples, full Adam 2 epochs, 2 sweeps")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.batch_size, args.max_samples = "tiny-llama", 32, 4, 32
        args.full_epochs, args.sweeps, args.warmup, args.plateau_window = 2, 2, 2, 1
    rows = rows_of(args)
    unknown = [u for u in args.ufps.split(",") if u not in UFPS]
    if unknown:
        p.error(f"--ufps names {', '.join(unknown)}; expected some of {', '.join(UFPS)}")
    if args.ufp_order and args.ufp_order not in rows:
        p.error(f"--ufp-order {args.ufp_order} is not a row of this run ({', '.join(rows)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_process_environment()  # every run gets the OpenMP setting `preinfer bcd` gives itself
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="orders-") as tmp:
        comparison = compare(args, Path(tmp))
    png = args.out.with_suffix(".png")
    result = dict(benchmark="orders", command=command_line("orders", argv or sys.argv[1:]),
                  machine=machine(), settings={k: str(v) if isinstance(v, (Path, Fraction)) else v
                                               for k, v in vars(args).items()},
                  targets=TARGETS, plot=str(png), **comparison, wall_s=time.perf_counter() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result["full"], result["rows"], png, f"{Path(args.model).name}, {args.data}")
    columns = ["row", "best_eval_loss", "best_vs_full_pct", "time_to_target", "x_time", "epochs_to_target",
               "x_epochs", "plateau_epochs", "caching_s", "importance_s", "tracked_peak_mib"]
    shown = [dict(row, tracked_peak_mib=row["tracked_peak"] / 2**20) for row in (result["full"], *result["rows"])]
    print(f"target: full Adam's plateau loss {result['full']['target']:.4f}; goals {TARGETS}")
    print(table([{c: cell(r.get(c)) for c in columns} for r in shown], columns))
    print(f"UFP table at {result['best']}:")
    ufp_columns = ["ufp", "blocks", "tracked_peak_mib", "peak_x_full", "epochs_to_target", "plateau_epochs",
                   "best_eval_loss", "epochs"]
    print(table([{c: cell(r[c]) for c in ufp_columns} for r in result["ufp_table"]], ufp_columns))
    print(f"wrote {args.out} and {png} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
