"""Peak memory of full-parameter Adam against BCD-Adam (live at UFP 1/2, 1/3, 1/4, and from a store).

Each configuration runs in its own subprocess (so that process RSS peaks are separate) and trains with the real
`preinfer.trainer.Trainer` and `preinfer.meter.MemoryMeter` for a few steps per visit, on the default corpus.
Per configuration it reports the meter's peak tracked memory (max over visits of `tracked_peak`, with the
components of that visit: params, grads, optimizer, activations) and the process peak RSS, each as a ratio to
full Adam, beside the planner's prediction (`preinfer.memory_model`) and the reference paper's figures.

"From a store": every visit of a block above boundary 0 reads boundary states at the block's start boundary k
and the prefix (embedding and layers < k) is not in memory at all. See `--help` and `store_worker` for how that
row is produced.

    python bench/memory.py                 # small-llama and medium-llama, seq 256, batch 8 (a few minutes)
    python bench/memory.py --quick         # tiny-llama, seq 32, batch 2, one step per visit (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import preinfer  # noqa: E402
from preinfer import memory_model as mm  # noqa: E402
from preinfer.config import Config, load_config  # noqa: E402
from preinfer.meter import MemoryMeter  # noqa: E402
from preinfer.partition import Block, Partition, make_partition  # noqa: E402
from preinfer.presets import build_preset  # noqa: E402
from preinfer.trainer import LiveSources, Trainer  # noqa: E402

# The reference paper's peak-memory reduction of BCD against full-parameter Adam, by UFP ("about 45% less on
# average"): the expected ratio to full Adam is 1 - reduction.
PAPER_REDUCTION = {"1/2": 0.33, "1/3": 0.50, "1/4": 0.60}
PAPER_AVERAGE_REDUCTION = 0.45
TARGETS = {"bcd_live_1/3": 0.55, "bcd_store": 0.45}
COMPONENTS = ("params", "grads", "optimizer", "activations")


# ---------------------------------------------------------------------------------------------------------------
# Workers (one per configuration, each in its own process).


def rss_now() -> int:
    """Current resident set size of this process in bytes (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_config(args: argparse.Namespace, mode: str, ufp: str | None) -> Config:
    """The training config of one memory run: Adam, a few steps per visit, one sweep, one eval batch."""
    return load_config(overrides=dict(
        model=dict(name=args.model),
        data=dict(seq_len=args.seq_len, batch_size=args.batch_size, eval_batches=1),
        blocks=dict(ufp=ufp or "1", sweeps=1, order="ascending"),
        optim=dict(name="adam", lr=1e-4),
        stop=dict(steps_per_visit=args.steps),
        run=dict(mode=mode, seed=0),
    ))


def visit_row(visit: dict, block: Block) -> dict:
    """One visit's measurement: the block, the meter's report."""
    return dict(block=visit["block"], label=visit["label"], start=block.start, stop=block.stop,
                source_boundary=visit["source_boundary"], num_params=block.num_params, memory=visit["memory"])


def live_worker(args: argparse.Namespace, mode: str, ufp: str | None) -> dict:
    """Full Adam (mode full) or live BCD-Adam at `ufp`: every block visited once, the whole model resident."""
    from pipelines.training import live_sources, load_datasets, partition_for

    config = worker_config(args, mode, ufp)
    torch.manual_seed(0)
    data = load_datasets(config)
    rss_start = rss_now()
    model = build_preset(args.model, seed=0)
    staged = preinfer.stage(model)
    partition = partition_for(staged, config)
    trainer = Trainer(staged, partition, config, live_sources(data, config), None, MemoryMeter(model))
    visits = trainer.fit()
    return dict(rss_start=rss_start, partition=partition.report(),
                visits=[visit_row(v, partition.blocks[v["block"]]) for v in visits])


class StoredStates:
    """A `BatchSource` at boundary k > 0 yielding stored-shape boundary states (random hidden states in float32,
    the storage dtype of a float32 run; an all-ones mask; positions 0..T-1; random labels). Memory depends only on
    the shapes, not on the values."""

    def __init__(self, boundary: int, hidden: int, vocab: int, seq_len: int, batch_size: int, batches: int):
        self.boundary = boundary
        self.shape = (batch_size, seq_len)
        self.hidden, self.vocab, self.batches = hidden, vocab, batches
        self.generator = torch.Generator().manual_seed(boundary)
        self.position = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.batches

    def _batch(self) -> dict[str, torch.Tensor]:
        b, t = self.shape
        return dict(
            hidden=torch.randn(b, t, self.hidden, generator=self.generator),
            attention_mask=torch.ones(b, t, dtype=torch.bool),
            position_ids=torch.arange(t).expand(b, t).contiguous(),
            labels=torch.randint(0, self.vocab, (b, t), generator=self.generator),
        )

    def __next__(self) -> dict[str, torch.Tensor]:
        self.position += 1
        return self._batch()

    def one_pass(self):
        for _ in range(self.batches):
            yield self._batch()

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state.get("position", 0)


class StorePlan:
    """Every visit reads `StoredStates` at the visited block's start boundary."""

    def __init__(self, source_train: StoredStates, source_eval: StoredStates):
        self.train, self.eval = source_train, source_eval

    def sources(self, block: Block):
        return self.train, self.eval

    def visit_finished(self, block: Block) -> None:
        pass


def drop_prefix(model: nn.Module, staged: preinfer.StagedModel, boundary: int) -> None:
    """Remove the embedding and layers < boundary from the module tree: their tensors are freed (not resident)
    and no longer counted by the meter. Llama-family models only (the presets)."""
    model.model.embed_tokens = nn.Identity()
    for index in range(boundary):
        staged.layers[index] = nn.Identity()
    gc.collect()


def store_worker(args: argparse.Namespace, ufp: str) -> dict:
    """BCD-Adam from a store, emulated: for each block above boundary 0 in ascending order, the prefix below the
    block's start boundary k is deleted (as a run that loads only the suffix would never load it), a source at
    boundary k yields stored-shape boundary states, and the real Trainer trains the block for a few steps."""
    config = worker_config(args, "bcd", ufp)
    torch.manual_seed(0)
    rss_start = rss_now()
    model = build_preset(args.model, seed=0)
    staged = preinfer.stage(model)
    full = make_partition(staged, ufp=float(Fraction(ufp)))
    report = full.report()
    upper = [block for block in full.blocks if block.start > 0]
    del full  # block 0 holds the embedding's and the first layers' parameters
    rows = []
    while upper:
        block = upper.pop(0)
        drop_prefix(model, staged, block.start)
        single = Partition((replace(block, index=0),), sum(p.numel() for p in model.parameters()), ())
        states = [StoredStates(block.start, model.config.hidden_size, model.config.vocab_size, args.seq_len,
                               args.batch_size, batches) for batches in (64, 1)]
        trainer = Trainer(staged, single, config, StorePlan(*states), None, MemoryMeter(model))
        (visit,) = trainer.fit()
        visit["block"] = block.index
        rows.append(visit_row(visit, block))
        del trainer, single, block
    return dict(rss_start=rss_start, partition=report, visits=rows,
                store="emulated: prefix modules replaced by nn.Identity (freed), random boundary states at k")


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.worker == "full":
        result = live_worker(args, "full", None)
    elif args.worker.startswith("live:"):
        result = live_worker(args, "bcd", args.worker.split(":", 1)[1])
    elif args.worker.startswith("store:"):
        result = store_worker(args, args.worker.split(":", 1)[1])
    else:
        raise SystemExit(f"unknown worker '{args.worker}'")
    result["rss_peak"] = max(v["memory"]["rss_peak"] for v in result["visits"])
    result["wall_s"] = time.perf_counter() - started
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# Planner predictions.


def predict(model: str, seq_len: int, batch: int, rows: list[dict], num_layers: int, store: bool | None) -> list[int]:
    """The planner's total bytes for each measured visit (store None: full Adam), on the real partition's layer
    ranges (not the planner's even split)."""
    shape = mm.resolve_shape(model)
    settings = mm.Settings(seq_len=seq_len, micro_batch=batch, dtype="float32", blocks=max(len(rows), 1))
    if store is None:
        return [mm.full_memory(shape, settings, recompute=False).total]
    all_blocks = full_blocks(shape, rows, num_layers)
    by_start = {b.start: i for i, b in enumerate(all_blocks)}
    return [mm.bcd_memory(shape, settings, all_blocks, by_start[r["start"]], store).total for r in rows]


def full_blocks(shape: mm.ModelShape, rows: list[dict], num_layers: int) -> list[mm.Block]:
    """Planner blocks for every measured block; a store run measures only the blocks above boundary 0, so the
    block below them is added back (it only matters for its index)."""
    blocks = [mm.Block(r["start"], r["stop"], r["start"] == 0, r["stop"] == num_layers) for r in rows]
    if blocks and blocks[0].start > 0:
        blocks.insert(0, mm.Block(0, blocks[0].start, True, False))
    return blocks


# ---------------------------------------------------------------------------------------------------------------
# The driver.


def configurations(ufps: list[str], store_ufps: list[str]) -> list[str]:
    return ["full", *[f"live:{u}" for u in ufps], *[f"store:{u}" for u in store_ufps]]


def run_configuration(args: argparse.Namespace, model: str, name: str, out: Path) -> dict:
    """Run one configuration in a fresh Python process (or in this one with --in-process); its result dict."""
    result = out / f"_{model}_{name.replace(':', '_').replace('/', '-')}.json"
    if args.in_process:
        run_worker(argparse.Namespace(**{**vars(args), "worker": name, "result": str(result), "model": model}))
        data = json.loads(result.read_text())
        result.unlink()
        return data
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result),
               "--model", model, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--threads", str(args.threads)]
    subprocess.run(command, check=True, cwd=ROOT)
    data = json.loads(result.read_text())
    result.unlink()
    return data


def summarise(model: str, name: str, data: dict, args: argparse.Namespace) -> dict:
    """Peaks of one configuration (worst visit, and worst visit above boundary 0), with the planner's figures."""
    num_layers = build_layers(model)
    store = None if name == "full" else name.startswith("store:")
    visits = data["visits"]
    predictions = predict(model, args.seq_len, args.batch_size, visits, num_layers, store)
    for visit, predicted in zip(visits, predictions):
        visit["planner_total"] = predicted
    worst = max(visits, key=lambda v: v["memory"]["tracked_peak"])
    upper = [v for v in visits if v["start"] > 0]
    worst_upper = max(upper, key=lambda v: v["memory"]["tracked_peak"]) if upper else None
    return dict(
        model=model, config=name, mode="full" if name == "full" else "bcd",
        ufp=None if name == "full" else name.split(":", 1)[1], source="store" if store else "live",
        tracked_peak=worst["memory"]["tracked_peak"], worst_block=worst["block"],
        components={k: worst["memory"][k] for k in COMPONENTS},
        planner_total=worst["planner_total"],
        tracked_peak_above_0=worst_upper["memory"]["tracked_peak"] if worst_upper else None,
        worst_block_above_0=worst_upper["block"] if worst_upper else None,
        planner_total_above_0=worst_upper["planner_total"] if worst_upper else None,
        rss_peak=data["rss_peak"], rss_start=data["rss_start"], wall_s=data["wall_s"],
        partition=data["partition"], visits=visits, **({"store": data["store"]} if "store" in data else {}),
    )


def build_layers(model: str) -> int:
    return mm.resolve_shape(model).layers


def add_ratios(rows: list[dict]) -> None:
    """Each row's peaks as ratios to the same model's full Adam."""
    full = {r["model"]: r for r in rows if r["config"] == "full"}
    for r in rows:
        base = full[r["model"]]
        r["ratio_tracked"] = r["tracked_peak"] / base["tracked_peak"]
        r["ratio_tracked_above_0"] = (r["tracked_peak_above_0"] / base["tracked_peak"]
                                      if r["tracked_peak_above_0"] is not None else None)
        r["ratio_planner"] = r["planner_total"] / base["planner_total"]
        r["ratio_rss"] = r["rss_peak"] / base["rss_peak"]
        r["ratio_rss_above_start"] = (r["rss_peak"] - r["rss_start"]) / (base["rss_peak"] - base["rss_start"])
        r["planner_error"] = r["planner_total"] / r["tracked_peak"] - 1
        r["paper_ratio"] = 1 - PAPER_REDUCTION[r["ufp"]] if r["ufp"] in PAPER_REDUCTION else None


def check_targets(rows: list[dict]) -> dict:
    """The issue's targets per model: live BCD at 1/3 <= 0.55x full Adam's tracked peak; from a store <= 0.45x."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        mine = {r["config"]: r for r in rows if r["model"] == model}
        live = mine.get("live:1/3")
        store = mine.get("store:1/3")
        out[model] = dict(
            bcd_live_1_3=None if live is None else dict(ratio=live["ratio_tracked"], target=0.55,
                                                        holds=live["ratio_tracked"] <= 0.55),
            bcd_store_1_3=None if store is None else dict(
                ratio=store["ratio_tracked"], target=0.45, holds=store["ratio_tracked"] <= 0.45,
                live_same_blocks_ratio=live["ratio_tracked_above_0"] if live else None),
        )
    return out


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict]) -> str:
    """A Markdown table of every configuration."""
    head = ("| model | configuration | worst block | tracked peak MiB | params | grads | optimizer | activations "
            "| x full (tracked) | planner MiB | planner x full | planner error | paper x full | blocks > 0: x full "
            "| RSS peak MiB | x full (RSS) | x full (RSS above start) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c = r["components"]
        lines.append(
            f"| {r['model']} | {label(r)} | {r['worst_block']} | {mib(r['tracked_peak'])} | {mib(c['params'])} "
            f"| {mib(c['grads'])} | {mib(c['optimizer'])} | {mib(c['activations'])} | {ratio(r['ratio_tracked'])} "
            f"| {mib(r['planner_total'])} | {ratio(r['ratio_planner'])} | {r['planner_error']:+.1%} "
            f"| {ratio(r['paper_ratio'])} | {ratio(r['ratio_tracked_above_0'])} | {mib(r['rss_peak'])} "
            f"| {ratio(r['ratio_rss'])} | {ratio(r['ratio_rss_above_start'])} |"
        )
    return "\n".join(lines)


def label(r: dict) -> str:
    if r["config"] == "full":
        return "full Adam"
    return f"BCD-Adam UFP {r['ufp']} {'from a store' if r['source'] == 'store' else 'live'}"


def machine() -> dict:
    """Where the benchmark ran."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), 0)
    return dict(nproc=os.cpu_count(), cpu=cpu, ram_gib=round(mem / 2**30, 1), torch=torch.__version__,
                python=platform.python_version())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small-llama,medium-llama", help="comma-separated presets")
    p.add_argument("--ufps", default="1/2,1/3,1/4", help="UFPs of the live BCD rows")
    p.add_argument("--store-ufps", default="1/3", help="UFPs of the from-a-store rows (the target is at 1/3)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per visit (memory needs only a few)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "memory.json")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny-llama, seq 32, batch 2, 1 step per visit (seconds)")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (smoke tests; RSS peaks are then not separate)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.seq_len, args.batch_size, args.steps = "tiny-llama", 32, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []
    names = configurations(args.ufps.split(","), [u for u in args.store_ufps.split(",") if u])
    for model in args.models.split(","):
        for name in names:
            print(f"[memory] {model} {name} ...", flush=True)
            rows.append(summarise(model, name, run_configuration(args, model, name, args.out.parent), args))
    add_ratios(rows)
    result = dict(
        benchmark="memory", command=" ".join(["python", "bench/memory.py", *(argv or sys.argv[1:])]),
        machine=machine(), settings=dict(seq_len=args.seq_len, batch_size=args.batch_size, steps_per_visit=args.steps,
                                         dtype="float32", optimizer="adam", threads=args.threads),
        paper=dict(reduction_by_ufp=PAPER_REDUCTION, average_reduction=PAPER_AVERAGE_REDUCTION),
        targets=check_targets(rows), rows=rows, wall_s=time.perf_counter() - started,
    )
    args.out.write_text(json.dumps(result, indent=1))
    print(table(rows))
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
