"""A streamed step (`--stream-frozen`) against a resident one, side by side in one process (issue 45).

Both methods train the same preset from the same weights, batches and blocks (BCD, `--grad-accum` micro-batches
a step, pre-inference off so every visit runs the frozen layers); they alternate for --repeats rounds, and each
round trains every block for --steps steps. Per method: the median step time (between the step records' ends within
a visit; its first two steps left out: the memory meter tracks them, and the first builds the optimizer state), and the ratio streamed / resident. On the CPU the streamed
step's copies are no-ops (the goal: at most 1.10x a resident step, the cost of the layer-major order and the
stream's bookkeeping); `--copies` makes them real copies on the CPU too (what a GPU's mechanics cost without a GPU:
every streamed tensor freed and refilled from its host copy at each use).

On CUDA (`--device cuda`, as bench/device_check.sh runs it) each method's visits also give
`torch.cuda.max_memory_allocated()` against the planner's device total for the visit (`preinfer plan` with the
same settings, `stream_frozen` for the streamed one), and the meter's streamed bytes on the device.

    python -m bench.stream_frozen                        # tiny-llama... see --help; JSON in bench/out/
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import preinfer
from bench.lib.common import command_line, machine, write_json
from pipelines.data.batches import live_sources
from pipelines.data.in_memory import TokenDataset
from pipelines.models.suffix import to_device
from preinfer.config import Config
from preinfer.device_placement import host_tensors
from preinfer.memory.footprint import bcd_memory
from preinfer.memory.layer_spans import partition
from preinfer.memory.meter import MemoryMeter
from preinfer.memory.settings import PRECISION_DTYPES, Settings
from preinfer.memory.shapes import resolve_shape
from preinfer.metrics import StepRecord
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from preinfer.trainer import Trainer

METHODS = ("resident", "streamed")


def tokens(n: int, seq: int, vocab: int, seed: int, split: str) -> TokenDataset:
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
    return TokenDataset(ids, torch.ones_like(ids, dtype=torch.bool), ids, "random", split)


def one_run(args: argparse.Namespace, stream: bool) -> dict:
    """Train every block of the preset for --steps steps; the step times after each visit's first, and per
    visit the meter's figures (and the CUDA peak)."""
    config = Config()
    config.model.stream_frozen, config.model.frozen_dtype = stream, args.frozen_dtype
    config.run.device, config.run.precision, config.run.recompute = args.device, args.precision, args.recompute
    config.optim.grad_accum, config.optim.lr, config.data.batch_size = args.grad_accum, 1e-4, args.batch_size
    config.optim.fused_step, config.blocks.expand = args.fused_step, "none"
    config.stop.steps_per_visit = args.steps
    model = build_preset(args.model, seed=0)  # placed as a run places it: streamed tensors stay in host memory
    staged = preinfer.stage(to_device(model, args.device, host_tensors(preinfer.stage(model), config)))
    vocab = staged.model.config.vocab_size
    samples = args.batch_size * args.grad_accum * args.steps * args.blocks
    sources = live_sources(tokens(samples, args.seq_len, vocab, 0, "train"),
                           tokens(args.batch_size, args.seq_len, vocab, 1, "eval"), args.batch_size,
                           samples_per_shard=args.batch_size * 4)
    steps: dict[int, list[float]] = {}
    trainer = Trainer(staged, make_partition(staged, num_blocks=args.blocks), config, sources,
                      on_record=lambda r: isinstance(r, StepRecord) and steps.setdefault(r.block, []).append(
                          r.visit_s))
    if stream and args.copies:
        trainer.seams.stream.copies = True
    trainer.meter = MemoryMeter(staged.model)
    trainer.fit()
    untracked = MemoryMeter.STEPS_PER_VISIT  # the meter's steps (and the first, which builds the optimizer state)
    return dict(step_s=[b - a for ends in steps.values() for a, b in zip(ends[untracked:], ends[untracked + 1:])],
                visits=[dict(block=v["block"], **{k: v["memory"].get(k) for k in
                                                  ("params", "frozen_device", "tracked_peak", "cuda_peak")})
                        for v in trainer.position.visits])


def planned(args: argparse.Namespace, stream: bool) -> list[int]:
    """The planner's device total of each visit (live, one GPU) at the bench's settings."""
    shape = resolve_shape(args.model)
    settings = Settings(seq_len=args.seq_len, micro_batch=args.batch_size * (args.grad_accum if stream else 1),
                        dtype=PRECISION_DTYPES[args.precision], recompute=args.recompute,
                        frozen_dtype=args.frozen_dtype, fused_step=args.fused_step, expand="none",
                        stream_frozen=stream, host_device=args.device == "cpu", budget_bytes=10**15)
    blocks = partition(shape, args.blocks)
    return [bcd_memory(shape, settings, blocks, k, store=False).total for k in range(len(blocks))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_frozen", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"))
    parser.add_argument("--frozen-dtype", default="auto")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per visit (the first two are metered, not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, the methods alternating")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--fused-step", action="store_true")
    parser.add_argument("--copies", action="store_true", help="real copies on the CPU too (the GPU's mechanics)")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    visits: dict[str, list] = {}
    for _ in range(args.repeats):
        for method in METHODS:
            run = one_run(args, method == "streamed")
            times[method] += run["step_s"]
            visits[method] = run["visits"]
    medians = {method: statistics.median(values) for method, values in times.items()}
    result = dict(median_step_s=medians, ratio=medians["streamed"] / medians["resident"], steps=len(times["streamed"]))
    for method in METHODS:
        for visit, plan in zip(visits[method], planned(args, method == "streamed")):
            visit["planned_total"] = plan
            if visit["cuda_peak"]:
                visit["cuda_over_plan"] = round(visit["cuda_peak"] / plan, 3)
    print(json.dumps(result | {"visits": visits}, indent=1))
    payload = dict(command=command_line("stream_frozen", argv if argv is not None else sys.argv[1:]),
                   machine=machine(), settings=vars(args), **result, visits=visits)
    print(f"wrote {write_json('stream_frozen', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
