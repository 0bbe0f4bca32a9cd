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
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.lib.common import OUT, ROOT, command_line, machine, module_command
from bench.lib.curves import plateau_point

TARGET_REL = 0.03  # BCD-Adam's final eval loss within 3% of full Adam's
PRECISION_REL = {"bf16-mixed": 0.01, "fp16-mixed": 0.02}  # final eval loss against the same method in fp32
PAPER = dict(ppl_full_adam=6.59, ppl_bcd_adam=6.62, epochs_ratio_ufp_1_3=2.2)
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
    p = trainer.progress
    if not curve or curve[-1]["step"] != p.global_step:
        measure(p.global_step, p.tokens)
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(c) + "\n" for c in curve))
    peak = max(visit["memory"].get("tracked_peak", 0) for visit in p.visits) if p.visits else 0
    return dict(method=name, config=config.to_dict(), partition=partition.report(), steps=p.global_step,
                precision=trainer.precision, skipped_steps=trainer.scaler.skipped,
                peak_tracked_bytes=peak,
                tokens=p.tokens, tokens_per_epoch=tokens_per_epoch, curve=curve,
                train_wall_s=time.perf_counter() - clock["start"] - clock["eval_s"], eval_s=clock["eval_s"])


# ---------------------------------------------------------------------------------------------------------------
# Analysis of the eval curves.


def at_budget(curve: list[dict], tokens: int) -> dict:
    """The last eval point at or before `tokens`."""
    return [c for c in curve if c["tokens"] <= tokens][-1]


def first_reaching(curve: list[dict], loss: float) -> dict | None:
    """The first eval point whose loss is at or below `loss`, linearly interpolated in tokens, epochs, wall."""
    for before, after in zip(curve, curve[1:]):
        if after["eval_loss"] <= loss:
            span = before["eval_loss"] - after["eval_loss"]
            f = 1.0 if span <= 0 else min(1.0, max(0.0, (before["eval_loss"] - loss) / span))
            return {k: before[k] + f * (after[k] - before[k]) for k in ("tokens", "epochs", "train_wall_s")}
    return None


def trend(curve: list[dict], points: int = 4) -> dict | None:
    """Least-squares fit of eval loss = a + b * log(tokens) over the last `points` evaluations."""
    tail = [c for c in curve if c["tokens"] > 0][-points:]
    if len(tail) < 3:
        return None
    xs = [math.log(c["tokens"]) for c in tail]
    ys = [c["eval_loss"] for c in tail]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return dict(intercept=my - slope * mx, slope_per_log_token=slope)


def tokens_to_reach(fit: dict | None, loss: float) -> float | None:
    """Tokens at which a fitted log trend reaches `loss` (None when the trend does not fall)."""
    if fit is None or fit["slope_per_log_token"] >= 0:
        return None
    return math.exp((loss - fit["intercept"]) / fit["slope_per_log_token"])


def summarise(runs: dict[str, dict], budget_tokens: int, args: argparse.Namespace) -> dict:
    """Per method: equal-budget (or best, --until-plateau) figures, best loss, plateau; and the epochs ratio
    against the paper's 2.2x."""
    rows = {}
    for name, run in runs.items():
        curve = run["curve"]
        best = min((c for c in curve if c["tokens"] <= budget_tokens), key=lambda c: c["eval_loss"])
        end = best if args.until_plateau else at_budget(curve, budget_tokens)
        plateau = plateau_point(curve, args.plateau_rel, args.plateau_window)
        rows[name] = dict(
            final_eval_loss=end["eval_loss"], final_ppl=math.exp(end["eval_loss"]), tokens=end["tokens"],
            epochs=end["epochs"], train_wall_s=end["train_wall_s"],
            best_eval_loss=best["eval_loss"], best_at_tokens=best["tokens"], best_at_epochs=best["epochs"],
            plateau=plateau, run_tokens=run["tokens"], run_epochs=run["tokens"] / run["tokens_per_epoch"],
            run_final_eval_loss=curve[-1]["eval_loss"], trend_last_4=trend(curve),
            run_train_wall_s=run["train_wall_s"], eval_s=run["eval_s"],
            peak_tracked_bytes=run.get("peak_tracked_bytes"),
        )
    full = rows["full-adam"]
    target = full["final_eval_loss"]
    for name, row in rows.items():
        row["rel_to_full"] = row["final_eval_loss"] / target - 1
        reach = first_reaching(runs[name]["curve"], target)
        row["reach_full_final"] = reach
        if reach is None and name != "full-adam":
            fit = trend(runs[name]["curve"])
            estimate = tokens_to_reach(fit, target)
            tokens_per_epoch = runs[name]["tokens_per_epoch"]
            row["reach_full_final_extrapolated_epochs"] = None if estimate is None else estimate / tokens_per_epoch
    bcd = rows.get("bcd-adam")
    epochs_ratio = None
    if bcd is not None:
        reach = bcd["reach_full_final"]
        epochs_ratio = dict(
            full_adam_epochs=full["epochs"],
            bcd_adam_epochs_to_full_final=reach["epochs"] if reach else None,
            ratio=(reach["epochs"] / full["epochs"]) if reach else None,
            extrapolated_ratio=(bcd.get("reach_full_final_extrapolated_epochs") or math.nan) / full["epochs"]
            if not reach else None,
            paper=PAPER["epochs_ratio_ufp_1_3"],
        )
        if bcd["plateau"] and full["plateau"]:
            full_at, bcd_at = full["plateau"]["epochs"], bcd["plateau"]["epochs"]
            epochs_ratio["plateau_epochs"] = dict(full_adam=full_at, bcd_adam=bcd_at,
                                                  ratio=bcd_at / full_at if full_at else None)
        target_check = dict(rel=bcd["rel_to_full"], limit=TARGET_REL, holds=bcd["rel_to_full"] <= TARGET_REL,
                            best_rel=bcd["best_eval_loss"] / full["best_eval_loss"] - 1)
    else:
        target_check = None
    return dict(rows=rows, epochs_ratio=epochs_ratio, target=target_check)


def compare_precisions(runs: dict[str, dict], budget_tokens: int) -> dict:
    """Each METHOD@PRECISION run against METHOD in fp32 at the same budget: relative final eval loss, its limit,
    and the steps the loss scaler skipped."""
    rows = {}
    for key, run in runs.items():
        name, precision = method_precision(key)
        if precision == "fp32" or name not in runs:
            continue
        ours, fp32 = (at_budget(r["curve"], budget_tokens)["eval_loss"] for r in (run, runs[name]))
        rel = ours / fp32 - 1
        rows[key] = dict(method=name, precision=precision, final_eval_loss=ours, fp32_final_eval_loss=fp32,
                         rel_to_fp32=rel, limit=PRECISION_REL[precision], holds=abs(rel) <= PRECISION_REL[precision],
                         steps=run["steps"], skipped_steps=run["skipped_steps"],
                         train_wall_s=run["train_wall_s"], fp32_train_wall_s=runs[name]["train_wall_s"])
    return rows


def plot(runs: dict[str, dict], budget_tokens: int, out: Path, title: str, until_plateau: bool) -> None:
    """Eval loss against tokens for every method, the budget and full Adam's final (or best) loss marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, run in runs.items():
        curve = [c for c in run["curve"] if c["tokens"] > 0]
        ax.plot([c["tokens"] for c in curve], [c["eval_loss"] for c in curve], "o-", ms=3, label=name)
    full_curve = runs["full-adam"]["curve"]
    if until_plateau:
        full = min(c["eval_loss"] for c in full_curve)
        ax.axhline(full, color="grey", ls=":", lw=1, label=f"full Adam best ({full:.3f})")
    else:
        full = at_budget(full_curve, budget_tokens)["eval_loss"]
        ax.axhline(full, color="grey", ls=":", lw=1, label=f"full Adam final ({full:.3f})")
        ax.axvline(budget_tokens, color="grey", ls="--", lw=1, label="equal token budget")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(title)
    losses = [c["eval_loss"] for r in runs.values() for c in r["curve"] if c["tokens"] > 0]
    ax.set_ylim(min(losses) - 0.05, min(max(losses), full + 1.5))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


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
