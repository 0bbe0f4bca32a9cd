"""Quality of BCD against full-parameter Adam: eval loss and perplexity on the default corpus, small-llama, one seed.

Methods (each in its own subprocess, trained with the real `preinfer.trainer.Trainer` on live token batches):
  full-adam  full-parameter Adam, lr 2e-3, betas (0.9, 0.95), 40 warmup steps, gradient clipping at 1.0
  bcd-adam   BCD-Adam at UFP 1/3 (3 blocks, ascending sweeps), the same Adam settings, 10 warmup steps per visit
             (each visit builds a fresh optimizer, as the paper's BCD does)
  bcd-sgd    BCD-SGD at UFP 1/3 with the paper's defaults: lr 0.1, momentum 0.9, weight decay 1e-5, no warmup,
             no clipping
  (optional, --sgd-lr X) bcd-sgd-tuned: the same with lr X
  (optional) bcd-experts  BCD-Adam as bcd-adam with expert-granular blocks (--experts, default top:0.5): in sparse
             layers only the experts carrying that share of routed tokens train (mixture-of-experts models)
Each method's peak tracked memory (weights, gradients, optimizer state, saved activations; the meter's) is kept.

Two comparisons:
  equal budget (default)  every method gets the same token budget (--epochs, default 2 epochs of the training
                          split); bcd-adam then continues to --bcd-adam-factor times that budget (default 2x) to
                          measure how many epochs it needs to reach full Adam's final eval loss (the paper reports
                          2.2x at UFP 1/3). Its equal-budget figures are read at the budget.
  --until-plateau         every method trains until its eval loss plateaus (the best eval loss improves by less
                          than --plateau-rel over --plateau-window evaluations) or --max-epochs (bcd-adam:
                          --bcd-adam-factor times that, since BCD needs more epochs); each is compared at its best
                          eval loss (early stopping), and the epochs ratio is of the epochs at which each method
                          reached its plateau.
--precision fp32,bf16-mixed,fp16-mixed trains every method in each precision (a method in a precision other than
fp32 is named METHOD@PRECISION) and compares each with the same method in fp32 at the same steps: bf16-mixed's
final eval loss within 1%, fp16-mixed's within 2% (with its skipped steps). Without full-adam among the methods
only this comparison is made.
Each method's result is kept in <out dir>/quality_runs/<method>.json; --reuse takes a method's result from there
instead of training it again when it was measured with the same settings (so methods can also be run in separate
invocations, e.g. in parallel with --methods, and compared by a last run with --reuse).
The eval loss is measured on the whole held-out split every --eval-every optimizer steps (a whole visit for BCD);
evaluation time is excluded from the wall times.

    python -m bench.quality            # 27 min of CPU: about 14 min on 2 free cores (40 min on a loaded machine)
    python -m bench.quality --until-plateau --plateau-window 6   # each method to its plateau (1-2 hours)
    python -m bench.quality --quick    # tiny-llama, a few steps (seconds)
    python -m bench.quality --methods bcd-adam --precision fp32,bf16-mixed,fp16-mixed --epochs 0.5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.lib.common import OUT, ROOT, command_line, machine, module_command
from bench.lib.quality_curves import PAPER, compare_precisions, plot, summarise
from bench.lib.quality_runs import ADAM, SGD, method_precision, run_method


# ---------------------------------------------------------------------------------------------------------------
# The driver.


def method_settings(args: argparse.Namespace, name: str, steps: int) -> dict:
    """Everything one method's result depends on (what --reuse compares)."""
    keys = ("model", "seq_len", "batch_size", "seed", "steps_per_visit", "eval_every", "eval_batches", "full_warmup",
            "visit_warmup", "sgd_lr", "until_plateau", "plateau_rel", "plateau_window", "experts")
    return dict(method=name, steps=steps, **{k: getattr(args, k) for k in keys})


def steps_per_epoch(args: argparse.Namespace) -> int:
    """Optimizer steps in one epoch of the training split at this sequence length and batch size."""
    from pipelines.training import load_datasets
    from preinfer.config import load_config

    config = load_config(overrides=dict(model=dict(name=args.model),
                                        data=dict(seq_len=args.seq_len, batch_size=args.batch_size)))
    return -(-len(load_datasets(config).train) // args.batch_size)


def launch(args: argparse.Namespace, name: str, steps: int, run_dir: Path, settings: dict) -> dict:
    """Run one method in a fresh process (or in this one with --in-process), or with --reuse take its kept
    result when it was measured with the same `settings`; its result dict."""
    result = run_dir.parent / f"{name}.json"
    if args.reuse and result.is_file():
        kept = json.loads(result.read_text())
        if kept.get("bench_settings") == settings:
            print(f"[quality] {name}: reusing {result}", flush=True)
            return kept
    if args.in_process:
        data = run_method(args, name, steps, run_dir)
    else:
        command = [*module_command("quality"), "--worker", name, "--worker-steps", str(steps),
                   "--result", str(result), "--run-dir", str(run_dir), *args.passthrough]
        subprocess.run(command, check=True, cwd=ROOT)
        data = json.loads(result.read_text())
    data["bench_settings"] = settings
    result.write_text(json.dumps(data))
    return data


def table(summary: dict, until_plateau: bool) -> str:
    compared = "best eval loss" if until_plateau else "eval loss at budget"
    lines = [f"| method | {compared} | PPL | vs full Adam | best eval loss (epoch) | tokens | epochs "
             "| train wall s | epochs to full-Adam final | plateau at epoch | peak tracked MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["rows"].items():
        reach = r["reach_full_final"]
        if reach:
            to_full = f"{reach['epochs']:.2f}"
        elif r.get("reach_full_final_extrapolated_epochs"):
            to_full = f"not reached in {r['run_epochs']:.1f} (trend: ~{r['reach_full_final_extrapolated_epochs']:.1f})"
        else:
            to_full = f"not reached in {r['run_epochs']:.1f}"
        plateau = f"{r['plateau']['epochs']:.2f}" if r["plateau"] else "still improving"
        lines.append(
            f"| {name} | {r['final_eval_loss']:.4f} | {r['final_ppl']:.3f} | {r['rel_to_full']:+.2%} "
            f"| {r['best_eval_loss']:.4f} ({r['best_at_epochs']:.2f}) | {r['tokens']:,} | {r['epochs']:.2f} "
            f"| {r['train_wall_s']:.0f} | {to_full} | {plateau} | {(r['peak_tracked_bytes'] or 0) / 2**20:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small-llama")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=float, default=2.0, help="the equal token budget, in epochs of the train split")
    p.add_argument("--bcd-adam-factor", type=float, default=2.0,
                   help="bcd-adam trains this many times the budget, or the cap with --until-plateau (to measure "
                        "the epochs it needs to reach full Adam's loss)")
    p.add_argument("--steps-per-visit", type=int, default=68, help="BCD visit length in optimizer steps")
    p.add_argument("--eval-every", type=int, default=68, help="optimizer steps between evaluations")
    p.add_argument("--eval-batches", type=int, default=0, help="eval batches per evaluation (0: the whole split)")
    p.add_argument("--full-warmup", type=int, default=40, help="warmup steps of full Adam")
    p.add_argument("--visit-warmup", type=int, default=10, help="warmup steps of each BCD-Adam visit")
    p.add_argument("--sgd-lr", type=float, default=None, help="also run BCD-SGD with this lr (bcd-sgd-tuned)")
    p.add_argument("--methods", default="full-adam,bcd-adam,bcd-sgd")
    p.add_argument("--precision", default="fp32",
                   help="comma-separated precisions each method trains in (fp32, bf16-mixed, fp16-mixed); the "
                        "others are compared with fp32")
    p.add_argument("--experts", default="top:0.5", help="bcd-experts: the expert share each sparse layer trains")
    p.add_argument("--until-plateau", action="store_true",
                   help="train every method until its eval loss plateaus (or --max-epochs); compare best losses")
    p.add_argument("--max-epochs", type=float, default=8.0,
                   help="with --until-plateau: the cap per method (bcd-adam: --bcd-adam-factor times this)")
    p.add_argument("--reuse", action="store_true",
                   help="take each method's kept result (quality_runs/<method>.json) if measured with the same settings")
    p.add_argument("--plateau-rel", type=float, default=0.005,
                   help="plateau: the best eval loss improves by less than this fraction ...")
    p.add_argument("--plateau-window", type=int, default=3, help="... over this many further evaluations")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT / "quality.json")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-llama, seq 32, a few steps (seconds)")
    p.add_argument("--in-process", action="store_true", help="run every method in this process (smoke tests)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.batch_size = "tiny-llama", 32, 4
        args.epochs, args.steps_per_visit, args.eval_every, args.full_warmup, args.visit_warmup = 0.004, 2, 2, 2, 1
        args.eval_batches = 4
    if args.sgd_lr is not None and "bcd-sgd-tuned" not in args.methods:
        args.methods += ",bcd-sgd-tuned"
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])
                        if a not in ("--in-process",)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        data = run_method(args, args.worker, args.worker_steps, args.run_dir)
        Path(args.result).write_text(json.dumps(data))
        return 0
    started = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs_dir = args.out.parent / "quality_runs"
    per_epoch = steps_per_epoch(args)
    epochs = args.max_epochs if args.until_plateau else args.epochs
    budget_steps = max(1, round(epochs * per_epoch / (3 * args.steps_per_visit))) * 3 * args.steps_per_visit
    runs: dict[str, dict] = {}
    keys = [name if precision == "fp32" else f"{name}@{precision}"
            for precision in args.precision.split(",") for name in args.methods.split(",")]
    for key in keys:
        steps = round(budget_steps * args.bcd_adam_factor) if method_precision(key)[0] == "bcd-adam" else budget_steps
        print(f"[quality] {key}: up to {steps} steps", flush=True)
        runs[key] = launch(args, key, steps, runs_dir / key, method_settings(args, key, steps))
    if "full-adam" not in runs:
        return precision_only(args, runs, min(run["tokens"] for run in runs.values()), started)
    budget_tokens = max(run["tokens"] for run in runs.values()) if args.until_plateau else runs["full-adam"]["tokens"]
    summary = summarise(runs, budget_tokens, args)
    png = args.out.with_suffix(".png")
    plot(runs, budget_tokens, png, f"{args.model}, builtin:pydoc, seq {args.seq_len}, batch {args.batch_size}, "
                                   f"seed {args.seed}", args.until_plateau)
    result = dict(
        benchmark="quality", command=command_line("quality", args.passthrough),
        machine=machine(), settings=dict(model=args.model, data="builtin:pydoc", seq_len=args.seq_len,
                                         batch_size=args.batch_size, seed=args.seed, budget_steps=budget_steps,
                                         budget_tokens=budget_tokens, steps_per_epoch=per_epoch,
                                         bcd_adam_factor=args.bcd_adam_factor, steps_per_visit=args.steps_per_visit,
                                         eval_every=args.eval_every, adam=ADAM, sgd=SGD, full_warmup=args.full_warmup,
                                         visit_warmup=args.visit_warmup, sgd_tuned_lr=args.sgd_lr,
                                         until_plateau=args.until_plateau, max_epochs=args.max_epochs,
                                         plateau_rel=args.plateau_rel, plateau_window=args.plateau_window),
        paper=PAPER, plot=str(png), **summary, precision=compare_precisions(runs, budget_tokens),
        runs={name: {k: v for k, v in run.items() if k != "config"} | {"config": run["config"]}
              for name, run in runs.items()},
        wall_s=time.perf_counter() - started,
    )
    args.out.write_text(json.dumps(result, indent=1))
    print(table(summary, args.until_plateau))
    print(json.dumps(dict(target=summary["target"], epochs_ratio=summary["epochs_ratio"]), indent=1))
    print(f"wrote {args.out} and {png} in {result['wall_s']:.0f} s")
    return 0


def precision_only(args: argparse.Namespace, runs: dict[str, dict], budget_tokens: int, started: float) -> int:
    """Without full-adam: write and print only the precision comparison."""
    rows = compare_precisions(runs, budget_tokens)
    if not rows:
        print("[quality] kept the results in quality_runs/; the comparison needs full-adam (add it, with --reuse) "
              "or a method in fp32 and another precision")
        return 0
    result = dict(benchmark="quality-precision", command=command_line("quality", args.passthrough),
                  machine=machine(), settings=dict(model=args.model, data="builtin:pydoc", seq_len=args.seq_len,
                                                   batch_size=args.batch_size, seed=args.seed,
                                                   budget_tokens=budget_tokens, steps_per_visit=args.steps_per_visit,
                                                   adam=ADAM, visit_warmup=args.visit_warmup),
                  precision=rows, wall_s=time.perf_counter() - started)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(rows, indent=1))
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
