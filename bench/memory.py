"""Peak memory of full-parameter Adam against BCD-Adam (live at UFP 1/2, 1/3, 1/4, and from a store).

Each configuration runs in its own subprocess (so that process RSS peaks are separate) and trains with the real
`preinfer.trainer.Trainer` and `preinfer.memory.meter.MemoryMeter` for a few steps per visit, on the default corpus.
BCD-Adam is the paper's, each visit training its block alone (`--expand none`; the default `auto` adds low-rank
factors above the block, about 7% of the tracked peak on SmolLM2: docs/fine-tuning.md).
Per configuration it reports the meter's peak tracked memory (max over visits of `tracked_peak`, with the
components of that visit: params, grads, optimizer, activations) and the process peak RSS, each as a ratio to
full Adam, beside the planner's prediction (`preinfer.memory`) and the reference paper's figures.

"From a store": every visit of a block above boundary 0 reads boundary states at the block's start boundary k
and the prefix (embedding and layers < k) is not in memory at all. See `--help` and `store_worker` for how that
row is produced.

"+ recompute": the same configuration trained with `run.recompute` (activation checkpointing of every layer in
the gradient path). Full Adam with recomputation is the paper's baseline ("even with recomputation, about 4 W");
each row is given as a ratio to full Adam without and with it.

    python -m bench.memory                 # small-llama and medium-llama at 256x8 and 128x1 (4.5 min of CPU)
    python -m bench.memory --quick         # tiny-llama, seq 32, batch 2, one step per visit (seconds)
    python -m bench.memory --precision bf16-mixed --regimes 128x1    # bf16 weights, fp32 masters of the block
    python -m bench.memory --attention eager,sdpa --regimes 512x1,1024x1,2048x1 --ufps 1/3 --store-ufps '' \
        --recomputed ''                    # both attention implementations, and their saved-activation ratio

"--precision bf16-mixed": every weight resident in bf16; the active block (under full Adam: every parameter) has
fp32 masters, fp32 gradients and fp32 Adam moments; stores hold bf16 states; the planner's rows are its
`bf16-mixed` dtype.

"--attention eager,sdpa": every configuration with each attention implementation (the model's and the planner's);
`attention_ratios` gives, per model, regime and configuration, the saved-activation bytes of eager over sdpa.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.common import OUT, ROOT, command_line, machine, module_command
from bench.lib.memory_workers import parse_configuration, run_worker
from preinfer.memory.footprint import bcd_memory, full_memory
from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import ModelShape, resolve_shape

# The reference paper's peak-memory reduction of BCD against full-parameter Adam, by UFP ("about 45% less on
# average"): the expected ratio to full Adam is 1 - reduction.
PAPER_REDUCTION = {"1/2": 0.33, "1/3": 0.50, "1/4": 0.60}
PAPER_AVERAGE_REDUCTION = 0.45
TARGETS = {"bcd_live_1/3": 0.55, "bcd_store": 0.45}
PLANNER_DTYPES = {"fp32": "float32", "bf16-mixed": "bf16-mixed"}  # --precision -> the planner's dtype
COMPONENTS = ("params", "masters", "grads", "optimizer", "activations")


# ---------------------------------------------------------------------------------------------------------------
# Planner predictions.


def predict(model: str, seq_len: int, batch: int, rows: list[dict], num_layers: int, store: bool | None,
            recompute: bool, precision: str, attention: str) -> list[int]:
    """The planner's bytes of tensors held (what the meter measures: the total without the step's temporaries) for
    each measured visit (store None: full Adam), on the real partition's layer ranges (not the planner's even
    split)."""
    shape = resolve_shape(model)
    settings = Settings(seq_len=seq_len, micro_batch=batch, dtype=PLANNER_DTYPES[precision],
                           blocks=max(len(rows), 1), recompute=recompute, attention=attention, expand="none")
    if store is None:
        return [full_memory(shape, settings, recompute=recompute).held]
    all_blocks = full_blocks(shape, rows, num_layers)
    by_start = {b.start: i for i, b in enumerate(all_blocks)}
    return [bcd_memory(shape, settings, all_blocks, by_start[r["start"]], store).held for r in rows]


def full_blocks(shape: ModelShape, rows: list[dict], num_layers: int) -> list[LayerSpan]:
    """Planner blocks for every measured block; a store run measures only the blocks above boundary 0, so the
    block below them is added back (it only matters for its index)."""
    blocks = [LayerSpan(r["start"], r["stop"], r["start"] == 0, r["stop"] == num_layers) for r in rows]
    if blocks and blocks[0].start > 0:
        blocks.insert(0, LayerSpan(0, blocks[0].start, True, False))
    return blocks


# ---------------------------------------------------------------------------------------------------------------
# The driver.


def configurations(ufps: list[str], store_ufps: list[str], recomputed: list[str]) -> list[str]:
    return ["full", *[f"live:{u}" for u in ufps], *[f"store:{u}" for u in store_ufps],
            *[f"{name}+recompute" for name in recomputed]]


def run_configuration(args: argparse.Namespace, model: str, name: str, out: Path) -> dict:
    """Run one configuration in a fresh Python process (or in this one with --in-process); its result dict.
    A store configuration first runs the caching worker in a process of its own."""
    kind, ufp, _ = parse_configuration(name)
    if kind == "store":
        run_configuration(args, model, f"cache:{ufp}", out)
    result = out / f"_{model}_{args.attention}_{name.replace(':', '_').replace('/', '-').replace('+', '_')}.json"
    if args.in_process:
        run_worker(argparse.Namespace(**{**vars(args), "worker": name, "result": str(result), "model": model}))
    else:
        command = [*module_command("memory"), "--worker", name, "--result", str(result),
                   "--model", model, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
                   "--steps", str(args.steps), "--threads", str(args.threads),
                   "--store-samples", str(args.store_samples), "--precision", args.precision,
                   "--attention", args.attention]
        subprocess.run(command, check=True, cwd=ROOT)
    data = json.loads(result.read_text())
    result.unlink()
    return data


def summarise(model: str, name: str, data: dict, args: argparse.Namespace) -> dict:
    """Peaks of one configuration (worst visit, and worst visit above boundary 0), with the planner's figures."""
    num_layers = resolve_shape(model).layers
    kind, ufp, recompute = parse_configuration(name)
    store = None if kind == "full" else kind == "store"
    visits = data["visits"]
    predictions = predict(model, args.seq_len, args.batch_size, visits, num_layers, store, recompute, args.precision,
                          args.attention)
    for visit, predicted in zip(visits, predictions):
        visit["planner_total"] = predicted
    worst = max(visits, key=lambda v: v["memory"]["tracked_peak"])
    upper = [v for v in visits if v["start"] > 0]
    worst_upper = max(upper, key=lambda v: v["memory"]["tracked_peak"]) if upper else None
    return dict(
        model=model, regime=f"{args.seq_len}x{args.batch_size}", seq_len=args.seq_len, batch_size=args.batch_size,
        attention=args.attention, config=name, mode="full" if kind == "full" else "bcd", ufp=ufp, recompute=recompute,
        source="store" if store else "live",
        tracked_peak=worst["memory"]["tracked_peak"], worst_block=worst["block"],
        components={k: worst["memory"][k] for k in COMPONENTS},
        planner_total=worst["planner_total"],
        tracked_peak_above_0=worst_upper["memory"]["tracked_peak"] if worst_upper else None,
        worst_block_above_0=worst_upper["block"] if worst_upper else None,
        planner_total_above_0=worst_upper["planner_total"] if worst_upper else None,
        rss_peak=data["rss_peak"], rss_start=data["rss_start"], wall_s=data["wall_s"],
        partition=data["partition"], visits=visits, **({"store": data["store"]} if "store" in data else {}),
    )


def add_ratios(rows: list[dict]) -> None:
    """Each row's peaks as ratios to full Adam on the same model and regime (sequence length x batch), and to
    full Adam with recomputation where it was measured."""
    full = {(r["model"], r["regime"], r["attention"]): r for r in rows if r["config"] == "full"}
    full_recompute = {(r["model"], r["regime"], r["attention"]): r for r in rows if r["config"] == "full+recompute"}
    for r in rows:
        base = full[(r["model"], r["regime"], r["attention"])]
        base_recompute = full_recompute.get((r["model"], r["regime"], r["attention"]))
        r["ratio_tracked_to_full_recompute"] = (r["tracked_peak"] / base_recompute["tracked_peak"]
                                                if base_recompute else None)
        r["activation_share_of_full"] = base["components"]["activations"] / base["tracked_peak"]
        r["ratio_tracked"] = r["tracked_peak"] / base["tracked_peak"]
        r["ratio_tracked_above_0"] = (r["tracked_peak_above_0"] / base["tracked_peak"]
                                      if r["tracked_peak_above_0"] is not None else None)
        r["ratio_planner"] = r["planner_total"] / base["planner_total"]
        r["ratio_rss"] = r["rss_peak"] / base["rss_peak"]
        r["ratio_rss_above_start"] = (r["rss_peak"] - r["rss_start"]) / (base["rss_peak"] - base["rss_start"])
        r["planner_error"] = r["planner_total"] / r["tracked_peak"] - 1
        r["paper_ratio"] = 1 - PAPER_REDUCTION[r["ufp"]] if r["ufp"] in PAPER_REDUCTION else None


def attention_ratios(rows: list[dict]) -> dict:
    """Per model, regime and configuration measured with both implementations: saved-activation bytes (the
    worst visit's, by the meter) of eager over sdpa, and each one's planner error."""
    by_key = {(r["model"], r["regime"], r["config"], r["attention"]): r for r in rows}
    out = {}
    for (model, regime, config, attention), eager in by_key.items():
        sdpa = by_key.get((model, regime, config, "sdpa"))
        if attention != "eager" or sdpa is None:
            continue
        out[f"{model} {regime} {config}"] = dict(
            saved_activations_eager_over_sdpa=eager["components"]["activations"] / sdpa["components"]["activations"],
            activations_eager=eager["components"]["activations"], activations_sdpa=sdpa["components"]["activations"],
            planner_error_eager=eager["planner_error"], planner_error_sdpa=sdpa["planner_error"])
    return out


def check_targets(rows: list[dict]) -> dict:
    """The issue's targets per model and regime: live BCD at 1/3 <= 0.55x full Adam's tracked peak; from a
    store <= 0.45x (with live BCD over the same blocks, above boundary 0, beside it); each without and with
    recomputation (`+recompute`, also as a ratio to full Adam with recomputation)."""
    out = {}
    for key in sorted({(r["model"], r["regime"], r["attention"]) for r in rows}):
        mine = {r["config"]: r for r in rows if (r["model"], r["regime"], r["attention"]) == key}
        checks = dict(activation_share_of_full=mine["full"]["activation_share_of_full"])
        for suffix in ("", "+recompute"):
            live, store = mine.get("live:1/3" + suffix), mine.get("store:1/3" + suffix)
            tag = suffix.replace("+", "_")
            checks["bcd_live_1_3" + tag] = None if live is None else dict(
                ratio=live["ratio_tracked"], target=TARGETS["bcd_live_1/3"],
                holds=live["ratio_tracked"] <= TARGETS["bcd_live_1/3"],
                ratio_to_full_recompute=live["ratio_tracked_to_full_recompute"])
            checks["bcd_store_1_3" + tag] = None if store is None else dict(
                ratio=store["ratio_tracked"], target=TARGETS["bcd_store"],
                holds=store["ratio_tracked"] <= TARGETS["bcd_store"],
                ratio_to_full_recompute=store["ratio_tracked_to_full_recompute"],
                live_same_blocks_ratio=live["ratio_tracked_above_0"] if live else None)
        out[f"{key[0]} {key[1]} {key[2]}"] = checks
    return out


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict]) -> str:
    """A Markdown table of every configuration."""
    head = ("| model | seq x batch | attention | configuration | worst block | tracked peak MiB | params | masters | grads | optimizer | activations "
            "| x full (tracked) | x full + recompute | planner MiB | planner x full | planner error | paper x full "
            "| blocks > 0: x full | RSS peak MiB | x full (RSS) | x full (RSS above start) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c = r["components"]
        lines.append(
            f"| {r['model']} | {r['regime']} | {r['attention']} | {label(r)} | {r['worst_block']} | {mib(r['tracked_peak'])} | {mib(c['params'])} "
            f"| {mib(c['masters'])} | {mib(c['grads'])} | {mib(c['optimizer'])} | {mib(c['activations'])} | {ratio(r['ratio_tracked'])} "
            f"| {ratio(r['ratio_tracked_to_full_recompute'])} | {mib(r['planner_total'])} | {ratio(r['ratio_planner'])} | {r['planner_error']:+.1%} "
            f"| {ratio(r['paper_ratio'])} | {ratio(r['ratio_tracked_above_0'])} | {mib(r['rss_peak'])} "
            f"| {ratio(r['ratio_rss'])} | {ratio(r['ratio_rss_above_start'])} |"
        )
    return "\n".join(lines)


def label(r: dict) -> str:
    name = "full Adam" if r["mode"] == "full" else \
        f"BCD-Adam UFP {r['ufp']} {'from a store' if r['source'] == 'store' else 'live'}"
    return name + (" + recompute" if r["recompute"] else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small-llama,medium-llama", help="comma-separated presets")
    p.add_argument("--ufps", default="1/2,1/3,1/4", help="UFPs of the live BCD rows")
    p.add_argument("--store-ufps", default="1/3", help="UFPs of the from-a-store rows (the target is at 1/3)")
    p.add_argument("--recomputed", default="full,live:1/3,store:1/3",
                   help="configurations also measured with recomputation (activation checkpointing); '' for none")
    p.add_argument("--regimes", default="256x8,128x1",
                   help="sequence length x micro-batch pairs: 256x8 (activations dominate these small models), "
                        "128x1 (activations about 0.7 W of full Adam's 4.7 W, the share of the paper's 7B accounting)")
    p.add_argument("--store-samples", type=int, default=64, help="training samples cached in each store")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per visit (memory needs only a few)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--precision", default="fp32", choices=list(PLANNER_DTYPES),
                   help="fp32, or bf16-mixed: bf16 weights, fp32 masters, gradients and Adam state of the block")
    p.add_argument("--attention", default="sdpa",
                   help="attention implementations, comma-separated: sdpa, eager or eager,sdpa (each configuration "
                        "runs with each; with both, the saved-activation ratio eager/sdpa is reported)")
    p.add_argument("--out", type=Path, default=OUT / "memory.json")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny-llama, seq 32, batch 2, 1 step per visit (seconds)")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (smoke tests; RSS peaks are then not separate)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.regimes, args.steps, args.store_samples = "tiny-llama", "32x2", 1, 8
    return args


def parse_regimes(text: str) -> list[tuple[int, int]]:
    """'256x8,128x1' -> [(256, 8), (128, 1)]."""
    return [(int(seq), int(batch)) for seq, batch in (part.split("x") for part in text.split(","))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []
    names = configurations(args.ufps.split(","), [u for u in args.store_ufps.split(",") if u],
                           [c for c in args.recomputed.split(",") if c])
    attentions = args.attention.split(",")
    for seq_len, batch_size in parse_regimes(args.regimes):
        args.seq_len, args.batch_size = seq_len, batch_size
        for model in args.models.split(","):
            for args.attention in attentions:
                for name in names:
                    print(f"[memory] {model} seq {seq_len} x batch {batch_size}, {args.attention}: {name} ...",
                          flush=True)
                    rows.append(summarise(model, name, run_configuration(args, model, name, args.out.parent), args))
    add_ratios(rows)
    shutil.rmtree(args.out.parent / "_stores", ignore_errors=True)
    result = dict(
        benchmark="memory", command=command_line("memory", argv or sys.argv[1:]),
        machine=machine(), settings=dict(regimes=args.regimes, steps_per_visit=args.steps, store_samples=args.store_samples,
                                         precision=args.precision, optimizer="adam", threads=args.threads,
                                         attention=attentions),
        paper=dict(reduction_by_ufp=PAPER_REDUCTION, average_reduction=PAPER_AVERAGE_REDUCTION),
        targets=check_targets(rows), attention_ratios=attention_ratios(rows), rows=rows,
        wall_s=time.perf_counter() - started,
    )
    args.out.write_text(json.dumps(result, indent=1))
    print(table(rows))
    print(json.dumps(result["targets"], indent=1))
    print(json.dumps(result["attention_ratios"], indent=1))
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
