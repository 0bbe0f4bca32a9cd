"""The planner against `torch.cuda.max_memory_allocated` on one CUDA GPU, and steps/s of `preinfer bcd` against a
plain loop (issue 37, part 5; run by bench/device_check.sh).

Memory rows: presets x attention (sdpa: on CUDA its flash and memory-efficient kernels, whose saved tensors differ
from CPU SDPA's; eager) x recompute (off, on) x (full Adam, live BCD on the middle of 3 blocks), float32. Each
row starts from an empty allocator, moves the model to the GPU and runs two steps (forward through the staged
model, backward, Adam step; the second step's forward meets the first one's optimizer state and gradients, as
the planner prices it); the measured peak is `torch.cuda.max_memory_allocated()` and the JSON gives it over the
planner's total.

Speed: `preinfer bcd --device cuda` (its step records' `visit_s`, each visit's first step left out) against a
plain loop of the same blocks (freeze the rest, fresh Adam, forward, backward, step), same model, batches, seq.

    python -m bench.device_memory            # on a CUDA machine; elsewhere it says so and exits 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.lib.common import ROOT, command_line, machine, write_json

import preinfer
from preinfer.memory.footprint import bcd_memory, full_memory
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import resolve_shape
from preinfer.partition import make_partition
from preinfer.presets import build_preset

BLOCKS = 3
NO_CUDA = "device check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure"


def _trainable(model: torch.nn.Module, staged: preinfer.StagedModel, k: int | None) -> list:
    """Every parameter (k None), else block k's (the trainer's partition, which is the planner's), the rest
    frozen."""
    if k is None:
        return list(model.parameters())
    params = list(make_partition(staged, num_blocks=BLOCKS).blocks[k].params)
    model.requires_grad_(False)
    for param in params:
        param.requires_grad_(True)
    return params


def cuda_peak(name: str, k: int | None, attention: str, recompute: bool, seq: int, batch: int) -> int:
    """max_memory_allocated over two training steps of a preset on the GPU, from an empty allocator."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_preset(name, attention=attention).cuda().train()
    staged = preinfer.stage(model)
    params = _trainable(model, staged, k)
    start = 0 if k is None else partition(resolve_shape(name), BLOCKS)[k].start
    optimizer = torch.optim.Adam(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    for _ in range(2):
        with torch.set_grad_enabled(start == 0):
            state = staged.run(staged.embed(ids, labels=ids), 0, start)
        staged.loss(staged.run(state, start, staged.num_layers, recompute=recompute)).backward()
        optimizer.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, staged, params, optimizer
    return peak


def memory_rows(names: list[str], seq: int, batch: int) -> list[dict]:
    rows = []
    for name in names:
        shape = resolve_shape(name)
        for attention in ("sdpa", "eager"):
            for recompute in (False, True):
                settings = Settings(seq_len=seq, micro_batch=batch, dtype="float32", recompute=recompute,
                                    attention=attention, blocks=BLOCKS)
                for k in (None, 1):
                    planned = (full_memory(shape, settings, recompute).total if k is None else
                               bcd_memory(shape, settings, partition(shape, BLOCKS), k, store=False).total)
                    measured = cuda_peak(name, k, attention, recompute, seq, batch)
                    rows.append(dict(model=name, attention=attention, recompute=recompute,
                                     row="full_adam" if k is None else "bcd_live block 1", planned=planned,
                                     cuda_max_allocated=measured, ratio=round(measured / planned, 3)))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def plain_steps_per_s(name: str, seq: int, batch: int, steps: int) -> float:
    """Steps/s of the plain per-block loop on the GPU, each block's first step left out."""
    model = build_preset(name).cuda().train()
    staged = preinfer.stage(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    times = []
    for k in range(BLOCKS):
        optimizer = torch.optim.Adam(_trainable(model, staged, k), lr=1e-4)
        for step in range(steps):
            begin = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times += [time.perf_counter() - begin] if step else []
    return len(times) / sum(times)


def preinfer_steps_per_s(name: str, seq: int, batch: int, steps: int) -> float:
    """Steps/s of `preinfer bcd --device cuda` from its step records, each visit's first step left out."""
    with tempfile.TemporaryDirectory(prefix="device-speed-") as tmp:
        subprocess.run([sys.executable, "-m", "pipelines.cli", "bcd", "--model", name, "--blocks", str(BLOCKS),
                        "--steps-per-visit", str(steps), "--seq-len", str(seq), "--batch-size", str(batch),
                        "--eval-tokens", str(seq * batch), "--pre-inference", "off", "--device", "cuda",
                        "--lr", "1e-4", "--out", f"{tmp}/run"], cwd=ROOT, check=True, capture_output=True)
        records = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    stamps: dict[tuple[int, int], list[float]] = {}
    for record in records:
        if record["kind"] == "step":
            stamps.setdefault((record["sweep"], record["block"]), []).append(record["visit_s"])
    times = [b - a for visit in stamps.values() for a, b in zip(visit, visit[1:])]
    return len(times) / sum(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_memory", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-llama,small-llama,medium-llama")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--speed-model", default="medium-llama")
    parser.add_argument("--steps", type=int, default=30, help="steps per visit of the speed runs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    rows = memory_rows(args.models.split(","), args.seq_len, args.batch_size)
    plain = plain_steps_per_s(args.speed_model, args.seq_len, args.batch_size, args.steps)
    ours = preinfer_steps_per_s(args.speed_model, args.seq_len, args.batch_size, args.steps)
    speed = dict(model=args.speed_model, plain_steps_per_s=round(plain, 2), preinfer_steps_per_s=round(ours, 2),
                 preinfer_over_plain=round(ours / plain, 3))
    print(json.dumps(speed))
    ratios = [row["ratio"] for row in rows]
    payload = dict(command=command_line("device_memory", argv if argv is not None else sys.argv[1:]),
                   machine=machine(), gpu=torch.cuda.get_device_name(), memory=rows, speed=speed,
                   ratio_median=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)])
    print(f"wrote {write_json('device_memory', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
