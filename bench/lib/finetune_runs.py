"""bench.finetune's methods and one run of each: the rows' flags (as `preinfer bcd` reads them), the tasks' data,
and a run of a method as a process of its own, kept in the rows file for --resume."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.chat_records import records
from bench.lib.common import ROOT, module_command
from bench.lib.peer_loops import LORA_RANK, loop_worker
from bench.lib.pretrained import checkpoint_dir
from bench.lib.runs import cli_result, eval_loss, parse_config
from preinfer.config.rules import resolved_expand
from preinfer.partition import balanced_ranges

# The `bcd` rows of issue 37, by method: their flags on top of `bcd`'s.
LOW_BIT = {**{f"bcd-{dtype}": ["--frozen-dtype", dtype, "--expand", "none"] for dtype in ("bf16", "int8", "nf4")},
           "bcd-nf4-8bit": ["--frozen-dtype", "nf4", "--expand", "none", "--optimizer", "adam8bit", "--fused-step"]}
# The levers of issue 38, by method: their flags on top of `bcd`'s. Not in the default --methods (`--methods levers`).
LEVERS = {"bcd-none": ["--expand", "none"], "bcd-lowrank": ["--expand", "lowrank"], "bcd-sgd": ["--expand", "sgd"],
          "bcd-depth-lr": ["--block-lr", "depth:0.5..1.5"], "bcd-depth-lr-down": ["--block-lr", "depth:1.5..0.5"],
          "bcd-x4": [],
          "bcd-x4-keep": ["--keep-optimizer-state"], "bcd-x4-lowrank": ["--expand", "lowrank"],
          **{f"bcd-expand-lr-{rate}": ["--expand", "lowrank", "--expand-lr", rate] for rate in ("3e-4", "1e-3")}}
# Rows that spend the same steps in SHORTER-times more sweeps of SHORTER-times shorter visits.
SHORTER = 4
LOOP_METHODS = ("badam", *LORA_RANK)  # the methods of `loop_worker`
METHODS = ("full", "bcd", "bcd-none", "bcd-store", "bcd-auto", "bcd-budget", *LOW_BIT, "badam", "lora8", "lora16",
           "qlora")
TASKS = ("chat", "text", "licences")
FAMILY = {"full": "full", "bcd": "bcd", "bcd-store": "bcd", "bcd-auto": "bcd", "bcd-budget": "bcd", "badam": "badam",
          "lora8": "lora", "lora16": "lora", "qlora": "lora", **dict.fromkeys([*LOW_BIT, *LEVERS], "bcd")}
PRE_INFERENCE = {"bcd-store": "on", "bcd-auto": "auto"}  # the others live
# The method that stands for its family in the grid.
GRID_METHOD = {"full": "full", "bcd": "bcd", "badam": "badam", "lora": "lora16"}
GRIDS = "full=3e-5,1e-4;bcd=1e-4,3e-4;badam=1e-4,3e-4;lora=3e-4,1e-3"
GENERAL_TEXTS = Path("/usr/share/common-licenses")


# ---------------------------------------------------------------------------------------------------------------
# Data.


def task_data(task: str, scratch: Path, general: str) -> str:
    """The --data of a task (`licences`: the general corpus, `general`)."""
    if task == "text":
        return "builtin:pydoc"
    if task == "licences":
        return general
    path = scratch / "pydoc-chat.jsonl"
    if not path.exists():  # each conversation once: pydoc repeats some sections under several topics
        lines = dict.fromkeys(json.dumps(r) + "\n" for r in records())
        path.write_text("".join(lines))
    return str(path)


def general_corpus(spec: str | None, scratch: Path) -> str:
    """The general corpus's --data: --general as given, or the system's licence texts joined into one file."""
    if spec:
        return spec
    texts = sorted(p for p in GENERAL_TEXTS.glob("*") if p.is_file()) if GENERAL_TEXTS.is_dir() else []
    if not texts:
        raise SystemExit(f"finetune: no general corpus: {GENERAL_TEXTS} has no files; give --general (any plain "
                         f"text the tasks do not train on)")
    path = scratch / "general.txt"
    path.write_text("\n\n".join(p.read_text(errors="replace") for p in texts))
    return str(path)


def base_model(name: str | None, checkpoint: str, scratch: Path) -> tuple[str, str]:
    """The directory every method starts from and its --tokenizer: --model's, bench.checkpoint's `checkpoint` by
    default, or a preset saved once (its seeded initialisation, byte tokens) so that every method and the base
    evaluation load the same weights."""
    if name is None:
        return str(checkpoint_dir(checkpoint)), "auto"
    if Path(name).is_dir():
        return name, "auto"
    from pipelines.models import resolve_model

    resolve_model(name, seed=0).save_pretrained(scratch / "base")
    return str(scratch / "base"), "byte"


def equal_ranges(model: str, blocks: int) -> str:
    """The --ranges of `blocks` blocks of equal layer counts over `model`'s layers ('0-9,10-19,20-29' for 30, 3)."""
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    return ",".join(f"{lo}-{hi - 1}" for lo, hi in balanced_ranges([1] * layers, blocks))


def visit_steps(args: argparse.Namespace) -> int:
    """--steps-per-visit, which the `bcd-x4` rows split into SHORTER visits."""
    if args.steps_per_visit % SHORTER:
        raise SystemExit(f"finetune: the bcd-x4 rows split --steps-per-visit into {SHORTER} visits: give a "
                         f"multiple of {SHORTER} (got {args.steps_per_visit})")
    return args.steps_per_visit


# ---------------------------------------------------------------------------------------------------------------
# Flags of one run, as `preinfer bcd` reads them (the loop workers parse the same flags into the same config).


def run_flags(args: argparse.Namespace, method: str, data: str, lr: float, out: Path, budget: float = 0.0) -> list[str]:
    """The `preinfer bcd` flags of `method`'s run on `data` at `lr` (`budget`: bytes, for bcd-budget)."""
    blocks = len(args.ranges.split(","))
    flags = ["--model", args.model, "--tokenizer", args.tokenizer, "--data", data, "--seq-len", str(args.seq_len),
             "--batch-size", str(args.batch_size), "--optimizer", "adam", "--lr", str(lr), "--weight-decay", "0",
             "--warmup-steps", "0", "--grad-clip", "0", "--precision", "fp32", "--eval-tokens",
             str(args.eval_batches * args.batch_size * args.seq_len), "--seed", str(args.seed), "--order", "ascending",
             "--eval-fraction", str(args.eval_fraction), "--out", str(out)]
    if args.max_samples:
        flags += ["--max-samples", str(args.max_samples)]
    if method == "full":
        return flags + ["--mode", "full", "--keep-optimizer-state", "--sweeps", str(args.sweeps * blocks),
                        "--steps-per-visit", str(args.steps_per_visit)]
    flags += ["--sweeps", str(args.sweeps), "--steps-per-visit", str(args.steps_per_visit)]
    if method == "bcd-budget":
        return flags + ["--ufp", "auto", "--memory-budget", f"{budget / 2**20:.0f}MiB", "--recompute",
                        "--pre-inference", "auto"]
    if method in LOW_BIT:  # after `bcd`'s flags: its --optimizer replaces theirs
        flags += LOW_BIT[method]
    if method in LEVERS:
        flags += LEVERS[method]
        if method.startswith("bcd-x4"):
            flags += ["--sweeps", str(args.sweeps * SHORTER), "--steps-per-visit", str(visit_steps(args) // SHORTER)]
    return flags + ["--ranges", args.ranges, "--pre-inference", PRE_INFERENCE.get(method, "off")]


# ---------------------------------------------------------------------------------------------------------------
# One run, as a process of its own.


def run(method: str, flags: list[str], scratch: Path, eval_count: int, in_process: bool = False) -> dict:
    """Run `method` with `flags`; its result with the process's peak RSS (`in_process`: run in this process, whose
    peak so far it reports)."""
    if in_process:
        return run_here(method, flags, eval_count)
    out = Path(flags[flags.index("--out") + 1])
    if method in LOOP_METHODS:
        result_file = scratch / f"{out.name}.json"
        command = [*module_command("finetune"), "--worker", method, "--result", str(result_file),
                   "--eval-batches", str(eval_count), "--", *flags]
    else:
        command = [sys.executable, "-m", "pipelines.cli", "bcd", *flags]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL)  # BAdam prints its blocks
    _, status, usage = os.wait4(process.pid, 0)
    wall_s = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    result = json.loads(result_file.read_text()) if method in LOOP_METHODS else cli_result(out)
    result["rss"], result["wall_s"] = usage.ru_maxrss * 1024, wall_s
    return result


def run_here(method: str, flags: list[str], eval_count: int) -> dict:
    """`run` in this process (smoke tests): the loop worker or `preinfer bcd`'s main, its prints discarded."""
    from pipelines.cli import main

    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        if method in LOOP_METHODS:
            result = loop_worker(method, flags, eval_count)
        elif (code := main(["bcd", *flags])) != 0:
            raise RuntimeError(f"finetune: {method}'s run exited {code}")
    if method not in LOOP_METHODS:
        result = cli_result(Path(flags[flags.index("--out") + 1]))
    result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["wall_s"] = time.perf_counter() - started
    return result


def measured(args: argparse.Namespace, method: str, task: str, lr: float, scratch: Path, evals: dict,
             budget: float = 0.0) -> dict:
    """One run of `method` on `task` at `lr`, evaluated on the task and the general corpus."""
    out = scratch / f"{task}-{method}-{lr:g}-{args.seed}"
    flags = run_flags(args, method, evals["data"], lr, out, budget)
    key = run_key(args, task, method, flags, scratch)
    if args.resume and (row := measured_before(args.out, key)) is not None:
        print(f"[finetune] {task} {method} lr {lr:g} seed {args.seed}: eval {row['eval_loss']:.4f}, measured "
              f"before (--resume)", flush=True)
        return row
    result = run(method, flags, scratch, args.eval_batches, args.in_process)
    model_dir = result.pop("model_dir")
    tokens = result["steps"] * args.batch_size * args.seq_len
    row = dict(task=task, method=method, lr=lr, seed=args.seed, steps=result["steps"], eval_loss=eval_loss(model_dir, evals["task"]),
               general_loss=eval_loss(model_dir, evals["general"]), tokens_per_s=tokens / result["train_s"],
               train_s=result["train_s"], caching_s=result.get("caching_s", 0.0),
               tracked_peak_mib=result["tracked_peak"] / 2**20, rss_mib=result["rss"] / 2**20,
               wall_s=result["wall_s"], curve=result["curve"], key=key)
    shutil.rmtree(out, ignore_errors=True)
    with args.out.with_suffix(".rows.jsonl").open("a") as log:  # kept if a later run fails
        log.write(json.dumps(row) + "\n")
    print(f"[finetune] {task} {method} lr {lr:g} seed {args.seed}: eval {row['eval_loss']:.4f}, general {row['general_loss']:.4f}, "
          f"{row['tokens_per_s']:.0f} tokens/s, peak {row['tracked_peak_mib']:.0f} MiB, RSS {row['rss_mib']:.0f} "
          f"MiB, wall {row['wall_s']:.0f} s", flush=True)
    return row


def run_key(args: argparse.Namespace, task: str, method: str, flags: list[str], scratch: Path) -> str:
    """What makes a run the same run: its task, method (the loop rows read `bcd`'s flags), the model as given
    (`--model` or `--checkpoint`) and its flags, the run's --out left out and the invocation's temporary directory
    (a preset's saved weights, the chat data) named `<scratch>`; for a BCD row also the landscape expansion its
    flags resolve to, so that a row measured under another default (`--expand none` before `auto`) is not taken."""
    kept = [flag for before, flag in zip(["", *flags], flags) if "--out" not in (before, flag)]
    expansion = [f"expand={resolved_expand(parse_config(flags))}"] if FAMILY[method] == "bcd" else []
    return " ".join([task, method, args.source, *kept, *expansion]).replace(str(scratch), "<scratch>")


def measured_before(out: Path, key: str) -> dict | None:
    """The last row of `out`'s rows file (<stem>.rows.jsonl) measured with `key`, if any."""
    rows = out.with_suffix(".rows.jsonl")
    lines = rows.read_text().splitlines() if rows.exists() else []
    return next((row for row in map(json.loads, reversed(lines)) if row.get("key") == key), None)
