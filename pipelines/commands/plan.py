"""`preinfer plan`: memory per GPU, the automatic UFP, store size, pre-inference break-even and cost, before renting
GPUs."""

from __future__ import annotations

import argparse
import json
import os

from preinfer.config import load_config
from preinfer.errors import UsageError
from preinfer.config.resolved import ResolvedRun, resolve_run
from preinfer.memory.budget import size_text
from preinfer.memory.expansion import planned_config
from preinfer.memory.layer_spans import blocks_for_ufp, partition
from preinfer.memory.plan import MemoryPlan, plan_memory
from preinfer.memory.settings import GIB, RUN_PRECISIONS, Settings
from preinfer.memory.shapes import SIZES, ModelShape, resolve_shape
from pipelines.flags import CONFIG_FLAGS, add_flags, flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `preinfer plan`; their defaults are `Settings`' (and the training default UFP)."""
    defaults = {"--seq-len": Settings.seq_len, "--epochs-per-visit": Settings.epochs_per_visit,
                "--attention": Settings.attention, "--frozen-dtype": Settings.frozen_dtype,
                "--optimizer": Settings.optimizer, "--fused-step": Settings.fused_step,
                "--separate-ends": Settings.separate_ends, "--expand": Settings.expand,
                "--expand-rank": Settings.expand_rank, "--stream-frozen": Settings.stream_frozen,
                "--masters": Settings.masters, "--steps-per-visit": Settings.steps_per_visit, "--loss": Settings.loss,
                "--loss-chunk": Settings.loss_chunk}
    plan = dict(command="plan", defaults=defaults)
    add_flags(parser, "--model", "--arch", "--device", "--gpu", "--gpu-mem", "--memory-budget", "--seq-len",
              "--micro-batch", **plan)
    add_flags(parser.add_mutually_exclusive_group(), "--ufp", "--blocks", **plan)
    add_flags(parser, "--separate-ends", "--dtype", "--recompute", "--offload", "--loss", "--loss-chunk", "--attention",
              "--frozen-dtype", "--optimizer", "--fused-step", "--stream-frozen", "--masters", "--expand",
              "--expand-rank", "--tokens", "--bandwidth-gbps", "--nodes", "--steps-per-visit", "--pipeline",
              "--epochs-per-visit", "--store-dtype", "--compression",
              "--price-per-hour", "--mfu", "--json", **plan)


def host_memory() -> int:
    """Bytes of this machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def settings_from_args(args: argparse.Namespace, layers: int) -> Settings:
    """Settings from parsed flags; the number of blocks from --blocks or --ufp."""
    if args.offload and not args.recompute:
        raise UsageError("--offload needs --recompute (it offloads recomputation's checkpoints)")
    if args.blocks is not None and args.blocks > layers:
        raise UsageError(f"--blocks {args.blocks} exceeds the model's {layers} layers")
    blocks = args.blocks or blocks_for_ufp(args.ufp, layers)
    on_host = args.device == "cpu"
    budget = args.memory_budget if args.memory_budget is not None or not on_host else host_memory()
    return Settings(
        seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=args.dtype, recompute=args.recompute,
        attention=args.attention, gpu=args.gpu, gpu_mem_gb=args.gpu_mem, blocks=blocks,
        separate_ends=args.separate_ends, tokens=args.tokens,
        bandwidth_gbps=args.bandwidth_gbps, nodes=args.nodes, steps_per_visit=args.steps_per_visit,
        price_per_hour=args.price_per_hour, mfu=args.mfu,
        compression=args.compression, store_dtype=args.store_dtype, pipeline=args.pipeline,
        epochs_per_visit=args.epochs_per_visit, budget_bytes=budget, frozen_dtype=args.frozen_dtype,
        optimizer=args.optimizer, fused_step=args.fused_step, host_device=on_host, expand=args.expand,
        expand_rank=args.expand_rank, stream_frozen=args.stream_frozen, masters=args.masters, loss=args.loss,
        loss_chunk=args.loss_chunk, offload=args.offload,
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


def _loss(s: dict) -> str:
    """The loss and checkpoint placement a plan prices, as the table's second line ends."""
    loss = "plain loss" if s["loss"] == "plain" else f"chunked loss ({s['loss_chunk']} tokens a chunk)"
    return loss + (", checkpoints offloaded to host" if s["offload"] and s["recompute"] else "")


def _money(value: float | None) -> str:
    """Dollars, or a dash when no price is known."""
    return "-" if value is None else f"${value:,.2f}"


def run_flags(result: MemoryPlan, model_spec: str | None) -> list[tuple[str, object]]:
    """The flags of the `bcd` run of the plan's automatic choice, with the values it priced: its blocks and the
    ends' placement, its savers and expansion (none on a pipeline, whose stages are priced without it), and on a
    pipeline of N, N stages and N micro-batches of the planned micro-batch a step (1F1B keeps at most N - j of them
    in flight on stage j, as the planner counts). A GPU's run that streams or maps its masters names its device (on
    the CPU, the default, nothing streams, and masters on disk need no streaming). True stands for a switch."""
    s, auto = result.settings, result.auto
    degree = auto["pipeline_degree"]
    expand = s["expand"] if degree == 1 else "none"
    flags: list[tuple[str, object]] = [
        ("--model", model_spec or f"<a {result.model['name']} model directory>"), ("--blocks", auto["blocks"]),
        ("--separate-ends", auto["separate_ends"]), ("--seq-len", s["seq_len"]),
        ("--batch-size", s["micro_batch"] * degree), ("--precision", RUN_PRECISIONS[s["dtype"]]),
        ("--attention", s["attention"]), ("--recompute", s["recompute"]), ("--offload", s["offload"]),
        ("--loss", None if s["loss"] == "auto" else s["loss"]),
        ("--loss-chunk", s["loss_chunk"] if s["loss_chunk"] != Settings.loss_chunk else None),
        ("--frozen-dtype", None if s["frozen_dtype"] == "auto" else s["frozen_dtype"]),
        ("--optimizer", s["optimizer"]), ("--fused-step", s["fused_step"]),
        ("--stream-frozen", s["stream_frozen"]), ("--masters", None if s["masters"] == "host" else s["masters"]),
        ("--expand", expand),
        ("--expand-rank", s["expand_rank"] if expand == "lowrank" else None),
        ("--device", "cpu" if s["host_device"] else
         "cuda" if s["stream_frozen"] or s["masters"] == "disk" else None),
    ]
    if degree > 1:
        flags += [("--pipeline", degree), ("--microbatches", degree)]
    return [(name, value) for name, value in flags if value not in (None, False)]


def run_command_line(result: MemoryPlan, model_spec: str | None) -> str:
    """The command line of the plan's automatic choice: `preinfer bcd ...` on one GPU, torchrun on a pipeline;
    or why it is not offered, when the run's own rules (`preinfer.config`) would refuse it."""
    flags = run_flags(result, model_spec)
    overrides: dict[str, dict[str, object]] = {}
    for name, value in flags:
        definition = flag(name)
        overrides.setdefault(definition.section, {})[definition.key] = value
    try:
        load_config(overrides=overrides, flags=CONFIG_FLAGS)
    except UsageError as refused:
        return f"none offered: bcd would refuse it ({refused})"
    words = " ".join(name if value is True else f"{name} {value}" for name, value in flags)
    degree = result.auto["pipeline_degree"]
    if degree == 1:
        return f"preinfer bcd {words}"
    return f"torchrun --nproc-per-node {degree} -m pipelines.cli bcd {words}"


def memory_table(result: MemoryPlan) -> list[str]:
    """The memory rows as a table whose columns are as wide as their widest figure, two spaces apart."""
    s = result.settings
    stages = f", worst of {s['pipeline']} stages" if result.stages else ""
    header = [f"memory per {'process' if s['host_device'] else 'GPU'}{stages} (GiB)", "weights", "grads", "optim",
              "activ", "step", "host", "total", "x W", "fits", "visit"]
    rows = [[name, *(_gib(getattr(mem, part)) for part in ("weights", "grads", "optimizer", "activations", "step",
                                                           "host", "total")),
             f"{mem.total / result.weight_bytes:.2f}", "yes" if mem.fits else "no", mem.note]
            for name, mem in result.memory.items()]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        numbers = "".join(f"  {cell:>{width}}" for cell, width in zip(cells[1:-2], widths[1:-2]))
        return f"{cells[0]:<{widths[0]}}{numbers}  {cells[-2]:<{widths[-2]}}  {cells[-1]}".rstrip()

    return [line(header), *(line(row) for row in rows)]


def host_lines(result: MemoryPlan) -> list[str]:
    """What the host column holds, and a streamed layer's copy against its compute."""
    s, lines = result.settings, []
    held = "masters of the frozen weights held as codes" + (" (none: on disk, memory-mapped)"
                                                              if s["masters"] == "disk" else "")
    held += " + the offloaded checkpoints" if s["offload"] and s["recompute"] else ""
    if s["stream_frozen"] and not s["host_device"]:
        held += " + the streamed frozen layers (at most two of them on the device, in weights)"
    if s["host_device"]:
        lines.append(f"host = {held}; on the CPU they share the budget (in the total)")
    elif any(mem.host for mem in result.memory.values()) or s["stream_frozen"]:
        lines.append(f"host = {held}, in host memory (not in the total)")
    t = result.stream
    if t is not None:
        lines.append(
            f"streaming: a frozen layer ({_gib(t['layer_bytes'])} GiB) copies in {t['copy_ms']:.1f} ms over "
            f"{t['pcie']} ({t['pcie_gbs']:g} GB/s) while the layer before it computes {t['forward_ms']:.1f} ms "
            f"forward, {t['backward_ms']:.1f} ms backward over {t['tokens']} tokens a step: "
            + ("hidden" if t["hides"] else "NOT hidden, the copies set the pace")
            + f" (hidden from {t['tokens_to_hide']} tokens a step: --micro-batch x --seq-len x grad accumulation)")
    return lines


def automatic_lines(result: MemoryPlan, model_spec: str | None) -> list[str]:
    """The automatic partition (the fewest visits that fit, the ends' placement too), and its run line."""
    auto = result.auto
    if auto["blocks"] is None:
        return ["automatic UFP: nothing fits, even one layer per GPU"]
    ends = " + the embedding and head blocks" if auto["separate_ends"] else ", the ends inside the first and last"
    where = "on one GPU" if auto["pipeline_degree"] == 1 else f"on {auto['pipeline_degree']} GPUs in a pipeline"
    return [
        f"automatic UFP: 1/{auto['blocks']} ({auto['blocks']} blocks{ends}; {auto['visits']} visits) {where}, "
        f"largest visit {size_text(auto['per_gpu_bytes'])} per GPU; full Adam needs "
        f"{result.full_adam_pipeline_degree or 'more than one layer per'} GPU(s)",
        f"run it: {run_command_line(result, model_spec)}",
    ]


def render(result: MemoryPlan, model_spec: str | None = None) -> str:
    """A readable table of a plan; `model_spec` is what `--model` of the printed run command names (None for a
    bare size)."""
    m, s = result.model, result.settings
    lines = [
        f"model {m['name']} ({m['arch']}, {m['params'] / 1e9:.3g}B parameters, {m['layers']} layers); "
        f"{s['dtype']}, {s['attention']} attention, seq {s['seq_len']} x micro-batch {s['micro_batch']}, "
        f"{s['blocks']} blocks (UFP 1/{s['blocks']}){' + the embedding and head blocks' if s['separate_ends'] else ''}",
        f"{_device(s)}: {_gib(result.capacity_bytes)} GiB usable"
        f"{' (--memory-budget)' if s['budget_bytes'] and not s['host_device'] else ''}; "
        f"W (weight bytes) = {_gib(result.weight_bytes)} GiB; {s['optimizer']}, frozen dtype {s['frozen_dtype']}"
        f"{', fused step' if s['fused_step'] else ''}{_expansion(s)}; {_loss(s)}",
        "",
        *memory_table(result),
    ]
    if result.stages:
        lines.append(f"stages of BCD on --pipeline {s['pipeline']} (each its own card, cut as the run cuts them): "
                     + "; ".join(f"{stage['label']} {_gib(stage['peak_bytes'])}" for stage in result.stages))
    if any(mem.step for mem in result.memory.values()):
        lines.append("step = the largest of a moment's temporaries: the loss's backward (two float32 [rows, vocab] "
                     "gradients, rows: every token, or one chunk), the Adam step's denominator, a tied embedding's "
                     "two extra gradients at the end of backward; beyond the activations freed by then")
    lines += host_lines(result)
    lines += ["", *automatic_lines(result, model_spec)]
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
    lines += sync_lines(result.dp_sync)
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


def sync_lines(sync: dict | None) -> list[str]:
    """The --dp-sync comparison of a plan for several nodes (none for one)."""
    if sync is None:
        return []
    head = (f"data parallel on {sync['nodes']} nodes at {sync['bandwidth_gbps']:g} Gbps (ring all-reduce, no "
            f"overlap): compute {sync['compute_seconds_per_step']:.3f} s/step; per --dp-sync mode, bytes a node sends "
            f"per step, traffic s/step, scaling efficiency (visit: {sync['steps_per_visit']} steps a visit)")
    rows = [f"  {mode:<10} {size_text(row['bytes_per_step']):>10} {row['seconds_per_step']:8.3f} s "
            f"{row['efficiency']:6.1%}" for mode, row in sync["modes"].items()]
    return [head, *rows]


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
