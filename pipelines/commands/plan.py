"""`preinfer plan`: memory per GPU, the automatic UFP, store size, pre-inference break-even and cost, before renting
GPUs."""

from __future__ import annotations

import argparse
import json
import os

from preinfer.errors import UsageError
from preinfer.config.resolved import ResolvedRun, resolve_run
from preinfer.memory.expansion import planned_config
from preinfer.memory.layer_spans import blocks_for_ufp, partition
from preinfer.memory.plan import MemoryPlan, plan_memory
from preinfer.memory.settings import GIB, RUN_PRECISIONS, Settings
from preinfer.memory.shapes import SIZES, ModelShape, resolve_shape
from pipelines.flags import add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `preinfer plan`; their defaults are `Settings`' (and the training default UFP)."""
    defaults = {"--seq-len": Settings.seq_len, "--epochs-per-visit": Settings.epochs_per_visit,
                "--attention": Settings.attention, "--frozen-dtype": Settings.frozen_dtype,
                "--optimizer": Settings.optimizer, "--fused-step": Settings.fused_step,
                "--separate-ends": Settings.separate_ends, "--expand": Settings.expand,
                "--expand-rank": Settings.expand_rank}
    plan = dict(command="plan", defaults=defaults)
    add_flags(parser, "--model", "--arch", "--device", "--gpu", "--gpu-mem", "--memory-budget", "--seq-len",
              "--micro-batch", **plan)
    add_flags(parser.add_mutually_exclusive_group(), "--ufp", "--blocks", **plan)
    add_flags(parser, "--separate-ends", "--dtype", "--recompute", "--attention", "--frozen-dtype", "--optimizer", "--fused-step",
              "--expand", "--expand-rank", "--tokens", "--bandwidth-gbps", "--pipeline", "--epochs-per-visit", "--store-dtype", "--compression",
              "--price-per-hour", "--mfu", "--json", **plan)


def host_memory() -> int:
    """Bytes of this machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def settings_from_args(args: argparse.Namespace, layers: int) -> Settings:
    """Settings from parsed flags; the number of blocks from --blocks or --ufp."""
    if args.blocks is not None and args.blocks > layers:
        raise UsageError(f"--blocks {args.blocks} exceeds the model's {layers} layers")
    blocks = args.blocks or blocks_for_ufp(args.ufp, layers)
    on_host = args.device == "cpu"
    budget = args.memory_budget if args.memory_budget is not None or not on_host else host_memory()
    return Settings(
        seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=args.dtype, recompute=args.recompute,
        attention=args.attention, gpu=args.gpu, gpu_mem_gb=args.gpu_mem, blocks=blocks,
        separate_ends=args.separate_ends, tokens=args.tokens,
        bandwidth_gbps=args.bandwidth_gbps, price_per_hour=args.price_per_hour, mfu=args.mfu,
        compression=args.compression, store_dtype=args.store_dtype, pipeline=args.pipeline,
        epochs_per_visit=args.epochs_per_visit, budget_bytes=budget, frozen_dtype=args.frozen_dtype,
        optimizer=args.optimizer, fused_step=args.fused_step, host_device=on_host, expand=args.expand,
        expand_rank=args.expand_rank,
    )


def _gib(n: float | None) -> str:
    """Bytes as GiB with two decimals."""
    return "-" if n is None else f"{n / GIB:.2f}"


def _device(s: dict) -> str:
    """The device a plan is for, as the table's second line names it."""
    if s["host_device"]:
        return "CPU (host memory)"
    return f"GPU {s['gpu'] if s['gpu_mem_gb'] is None else str(s['gpu_mem_gb']) + ' GB'}"


def _expansion(s: dict) -> str:
    """The landscape expansion a plan prices, as the table's second line ends (nothing without one)."""
    if s["expand"] == "none":
        return ""
    return f", expand {s['expand']}" + (f" rank {s['expand_rank']}" if s["expand"] == "lowrank" else "")


def _money(value: float | None) -> str:
    """Dollars, or a dash when no price is known."""
    return "-" if value is None else f"${value:,.2f}"


def pipeline_command(result: MemoryPlan, model_spec: str | None) -> str:
    """The torchrun command line of the plan's automatic choice on its pipeline: N processes, N stages, the
    blocks it chose, N micro-batches of the planned micro-batch per step (1F1B keeps at most N - j of them in
    flight on stage j, as the planner counts)."""
    s, auto = result.settings, result.auto
    degree = auto["pipeline_degree"]
    model = model_spec or f"<a {result.model['name']} model directory>"
    flags = [f"--model {model}", f"--blocks {auto['blocks']}", f"--pipeline {degree}", f"--microbatches {degree}",
             f"--batch-size {s['micro_batch'] * degree}", f"--seq-len {s['seq_len']}",
             f"--precision {RUN_PRECISIONS[s['dtype']]}", f"--attention {s['attention']}",
             *(["--recompute"] if s["recompute"] else [])]
    return f"torchrun --nproc-per-node {degree} -m pipelines.cli bcd " + " ".join(flags)


def render(result: MemoryPlan, model_spec: str | None = None) -> str:
    """A readable table of a plan; `model_spec` is what `--model` of the printed pipeline command names (None
    for a bare size)."""
    m, s = result.model, result.settings
    lines = [
        f"model {m['name']} ({m['arch']}, {m['params'] / 1e9:.3g}B parameters, {m['layers']} layers); "
        f"{s['dtype']}, {s['attention']} attention, seq {s['seq_len']} x micro-batch {s['micro_batch']}, "
        f"{s['blocks']} blocks (UFP 1/{s['blocks']}){' + the embedding and head blocks' if s['separate_ends'] else ''}",
        f"{_device(s)}: {_gib(result.capacity_bytes)} GiB usable"
        f"{' (--memory-budget)' if s['budget_bytes'] and not s['host_device'] else ''}; "
        f"W (weight bytes) = {_gib(result.weight_bytes)} GiB; {s['optimizer']}, frozen dtype {s['frozen_dtype']}"
        f"{', fused step' if s['fused_step'] else ''}{_expansion(s)}",
        "",
        f"{'memory per ' + ('process' if s['host_device'] else 'GPU') + ' (GiB)':<24}{'weights':>9}{'grads':>9}"
        f"{'optim':>9}{'activ':>9}{'step':>9}{'host':>9}{'total':>9}{'x W':>7}  fits  visit",
    ]
    for name, mem in result.memory.items():
        ratio = mem.total / result.weight_bytes
        lines.append(
            f"{name:<24}{_gib(mem.weights):>9}{_gib(mem.grads):>9}{_gib(mem.optimizer):>9}{_gib(mem.activations):>9}"
            f"{_gib(mem.step):>9}{_gib(mem.host):>9}{_gib(mem.total):>9}{ratio:>7.2f}  {'yes' if mem.fits else 'no':<4}  {mem.note}"
        )
    if any(mem.step for mem in result.memory.values()):
        lines.append("step = the Adam step's temporaries (its denominator), or a tied embedding's two extra "
                     "gradients at the end of backward, whichever is larger, beyond the activations freed by then")
    if s["host_device"]:
        lines.append("host = masters of the frozen weights held as codes; on the CPU they share the budget "
                     "(in the total)")
    elif any(mem.host for mem in result.memory.values()):
        lines.append("host = masters of the frozen weights held as codes, in host memory (not in the total)")
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
           else "never breaks even")
        + f" ({'pays off' if t['pays_off'] else 'does not pay off'} at {s['epochs_per_visit']:g} epoch(s) per visit)"
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


def resolved_run(shape: ModelShape, settings: Settings) -> ResolvedRun:
    """The run a plan prices, every auto settled by the rules a run settles them by (`resolve_run`)."""
    blocks = len(partition(shape, settings.blocks, settings.separate_ends))
    return resolve_run(planned_config(settings), RUN_PRECISIONS[settings.dtype], any(shape.sparse), blocks)


def run(args: argparse.Namespace) -> int:
    """Print the plan as a table or JSON (with the run it prices resolved, as a run records it)."""
    shape = resolve_shape(args.model, args.arch)
    settings = settings_from_args(args, shape.layers)
    result = plan_memory(shape, settings)
    if args.json:
        print(json.dumps(result.to_dict() | {"resolved": resolved_run(shape, settings).to_dict()}, indent=2))
    else:
        print(render(result, None if args.model.lower() in SIZES[args.arch] else args.model))
    return 0
