"""`preinfer plan`: memory per GPU, the automatic UFP, store size, pre-inference break-even and cost, before renting GPUs."""

from __future__ import annotations

import argparse
import json

from preinfer.config import BlockConfig
from preinfer.errors import UsageError
from preinfer.memory.layer_spans import blocks_for_ufp
from preinfer.memory.plan import MemoryPlan, plan_memory
from preinfer.memory.settings import DTYPES, GIB, GPUS, Settings
from preinfer.memory.shapes import SIZES, resolve_shape
from preinfer.memory.traffic import COMPRESSION, STORE_DTYPES
from pipelines.arguments import memory_size, positive_float, positive_int, token_count, unit_fraction


def _prices() -> str:
    """The GPU table's prices as one phrase."""
    return ", ".join(f"{name} ${gpu['price']:.2f}" for name, gpu in GPUS.items() if gpu["price"] is not None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `preinfer plan`; their defaults are `Settings`' (and the training default UFP)."""
    parser.add_argument("--model", required=True,
                        help="a preset (tiny-llama, small-llama, ...), a local model directory, a config.json, "
                             "or a size: 1.5b, 7b, 13b, 20b (standard shapes)")
    parser.add_argument("--arch", choices=["llama", "gpt2"], default="llama",
                        help="shape family for a size given to --model")
    parser.add_argument("--gpu", choices=list(GPUS), default=Settings.gpu,
                        help="GPU type: memory, peak FLOPs and default price")
    parser.add_argument("--gpu-mem", type=positive_float, metavar="GB",
                        help="GPU memory in GB, overriding the --gpu table's")
    parser.add_argument("--memory-budget", type=memory_size, metavar="SIZE",
                        help="bytes a process may fill, e.g. 22GiB, 512MiB or 1.5e9, instead of the GPU's usable "
                             "memory: the automatic UFP is then what `bcd --ufp auto --memory-budget SIZE` chooses")
    parser.add_argument("--seq-len", type=positive_int, default=Settings.seq_len, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=positive_int, default=Settings.micro_batch,
                        help="sequences per micro-batch step")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--ufp", type=unit_fraction, default=BlockConfig.ufp,
                       help="unfrozen parameter fraction per visit, e.g. 1/3 or 0.25: ceil(1/UFP) blocks")
    split.add_argument("--blocks", type=positive_int, help="number of blocks (instead of --ufp)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=Settings.dtype,
                        help="float32; bf16-mixed (bf16 weights, 2 bytes/parameter; the trainable parameters' float32 "
                             "masters, gradients and Adam moments, 16 bytes more, as the trainer holds them); "
                             "bf16 (everything bf16)")
    parser.add_argument("--recompute", action="store_true",
                        help="activation recomputation for the BCD rows (the full-Adam row is shown both ways)")
    parser.add_argument("--tokens", type=token_count,
                        help="dataset / training token budget, e.g. 1e9: store size on disk, transfer times and cost")
    parser.add_argument("--bandwidth-gbps", type=positive_float, default=Settings.bandwidth_gbps,
                        help="inter-GPU link bandwidth in Gbit/s for the traffic comparison")
    parser.add_argument("--pipeline", type=positive_int,
                        help="pipeline degree for the traffic comparison [the plan's own, at least 2]")
    parser.add_argument("--epochs-per-visit", type=positive_float, default=Settings.epochs_per_visit,
                        help="epochs each BCD visit trains; one caching pass serves them all")
    parser.add_argument("--store-dtype", choices=list(STORE_DTYPES),
                        help="storage dtype of boundary states; float8_e4m3, float8_e5m2, int8: 8-bit codes plus a "
                             "float32 scale per token [float32 when training in float32, else bfloat16]")
    parser.add_argument("--compression", type=positive_float,
                        help="store codec ratio [" + ", ".join(f"{ratio:g} for {kind} stores"
                                                             for kind, ratio in COMPRESSION.items()) + "]")
    parser.add_argument("--price-per-hour", type=positive_float, metavar="USD",
                        help=f"GPU price per hour [the paper's: {_prices()}]")
    parser.add_argument("--mfu", type=unit_fraction, default=Settings.mfu,
                        help="assumed model-FLOPs utilisation for the cost estimate")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def settings_from_args(args: argparse.Namespace, layers: int) -> Settings:
    """Settings from parsed flags; the number of blocks from --blocks or --ufp."""
    if args.blocks is not None and args.blocks > layers:
        raise UsageError(f"--blocks {args.blocks} exceeds the model's {layers} layers")
    blocks = args.blocks or blocks_for_ufp(args.ufp, layers)
    return Settings(
        seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=args.dtype, recompute=args.recompute,
        gpu=args.gpu, gpu_mem_gb=args.gpu_mem, blocks=blocks, tokens=args.tokens,
        bandwidth_gbps=args.bandwidth_gbps, price_per_hour=args.price_per_hour, mfu=args.mfu,
        compression=args.compression, store_dtype=args.store_dtype, pipeline=args.pipeline,
        epochs_per_visit=args.epochs_per_visit, budget_bytes=args.memory_budget,
    )


def _gib(n: float | None) -> str:
    """Bytes as GiB with two decimals."""
    return "-" if n is None else f"{n / GIB:.2f}"


def _money(value: float | None) -> str:
    """Dollars, or a dash when no price is known."""
    return "-" if value is None else f"${value:,.2f}"


# The run precision of each planner dtype (pure bf16 has no run precision: bf16-mixed is the nearest).
RUN_PRECISIONS = {"float32": "fp32", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed"}


def pipeline_command(result: MemoryPlan, model_spec: str | None) -> str:
    """The torchrun command line of the plan's automatic choice on its pipeline: N processes, N stages, the
    blocks it chose, N micro-batches of the planned micro-batch per step (1F1B keeps at most N - j of them in
    flight on stage j, as the planner counts)."""
    s, auto = result.settings, result.auto
    degree = auto["pipeline_degree"]
    model = model_spec or f"<a {result.model['name']} model directory>"
    flags = [f"--model {model}", f"--blocks {auto['blocks']}", f"--pipeline {degree}", f"--microbatches {degree}",
             f"--batch-size {s['micro_batch'] * degree}", f"--seq-len {s['seq_len']}",
             f"--precision {RUN_PRECISIONS[s['dtype']]}", *(["--recompute"] if s["recompute"] else [])]
    return f"torchrun --nproc-per-node {degree} -m pipelines.cli bcd " + " ".join(flags)


def render(result: MemoryPlan, model_spec: str | None = None) -> str:
    """A readable table of a plan; `model_spec` is what `--model` of the printed pipeline command names (None
    for a bare size)."""
    m, s = result.model, result.settings
    lines = [
        f"model {m['name']} ({m['arch']}, {m['params'] / 1e9:.3g}B parameters, {m['layers']} layers); "
        f"{s['dtype']}, seq {s['seq_len']} x micro-batch {s['micro_batch']}, {s['blocks']} blocks (UFP 1/{s['blocks']})",
        f"GPU {s['gpu'] if s['gpu_mem_gb'] is None else str(s['gpu_mem_gb']) + ' GB'}: "
        f"{_gib(result.capacity_bytes)} GiB usable{' (--memory-budget)' if s['budget_bytes'] else ''}; "
        f"W (weight bytes) = {_gib(result.weight_bytes)} GiB",
        "",
        f"{'memory per GPU (GiB)':<24}{'weights':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'total':>9}"
        f"{'x W':>7}  fits  visit",
    ]
    for name, mem in result.memory.items():
        ratio = mem.total / result.weight_bytes
        lines.append(
            f"{name:<24}{_gib(mem.weights):>9}{_gib(mem.grads):>9}{_gib(mem.optimizer):>9}{_gib(mem.activations):>9}"
            f"{_gib(mem.total):>9}{ratio:>7.2f}  {'yes' if mem.fits else 'no':<4}  {mem.note}"
        )
    auto = result.auto
    lines.append("")
    if auto["blocks"] is None:
        lines.append("automatic UFP: nothing fits, even one layer per GPU")
    else:
        lines.append(
            f"automatic UFP: 1/{auto['blocks']} ({auto['blocks']} blocks) on {auto['pipeline_degree']} GPU(s) "
            f"in a pipeline, {_gib(auto['per_gpu_bytes'])} GiB per GPU; full Adam needs "
            f"{result.full_adam_pipeline_degree or 'more than one layer per'} GPU(s)"
        )
    if (auto["pipeline_degree"] or 1) > 1:
        lines.append(f"run it: {pipeline_command(result, model_spec)}")
    store = result.store
    size = "" if store["bytes_per_boundary"] is None else f", {_gib(store['bytes_per_boundary'])} GiB per boundary"
    lines.append(f"store: {store['dtype']}, {store['bytes_per_token']:.0f} bytes/token on disk{size}")
    t = result.traffic
    lines.append(
        f"pre-inference: pipeline of {t['pipeline_degree']} moves {t['pipeline_bytes_per_token']:.0f} bytes/token "
        f"per epoch; caching writes {t['cache_write_bytes_per_token']:.0f} once and reads as much per epoch; "
        + (f"break-even after {t['break_even_epochs']:.2f} epochs" if t["break_even_epochs"] is not None
           else "never breaks even") + f" ({'pays off' if t['pays_off'] else 'does not pay off'} at {s['epochs_per_visit']:g} epoch(s) per visit)"
    )
    if "pipeline_seconds_per_epoch" in t:
        lines.append(f"  at {s['bandwidth_gbps']:g} Gbps: pipeline {t['pipeline_seconds_per_epoch']:.0f} s/epoch, "
                     f"store reads {t['cache_seconds_per_epoch']:.0f} s/epoch")
    if result.cost is None:
        lines.append("cost: give --tokens for a cost estimate")
    elif "note" in result.cost:
        lines.append(f"cost: {result.cost['note']}")
    else:
        c = result.cost
        parts = [f"{mode} {c[mode]['gpu_hours']:,.1f} GPU-h {_money(c[mode]['dollars'])}"
                 for mode in ("full", "bcd_live", "bcd_store")]
        lines.append(f"cost for {s['tokens']:,} tokens at {c['peak_tflops']:g} TFLOPS x MFU {c['mfu']:g}, "
                     f"{_money(c['price_per_hour'])}/h: " + "; ".join(parts))
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the plan as a table or JSON."""
    shape = resolve_shape(args.model, args.arch)
    result = plan_memory(shape, settings_from_args(args, shape.layers))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(render(result, None if args.model.lower() in SIZES[args.arch] else args.model))
    return 0
