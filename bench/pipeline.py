"""A 2-stage pipeline on CPU (gloo): step time and bubble fraction against the pipeline schedule's theory, and bytes sent
between stages per step against the planner's estimate.

Two processes under torchrun each hold one stage of the model (stages cut by `preinfer.memory.stage_cut`), every layer
trains (one block: the whole model, so both stages run forward and backward), and each step runs a batch of B
samples in M micro-batches through `pipelines.pipeline_parallel.visit.VisitPipeline`, for M in {2, 4, 8} and both
schedules. Per stage and step it measures the time spent inside `PipelineStage.forward_one_chunk` and
`backward_one_chunk` (busy) and the step's wall time; the measured bubble is 1 - busy / step (mean over the
stages; `bubble_slowest`: of the busiest stage alone, which sets the pace), the theory's (N-1)/(M+N-1) for equal
stages and free communication. Bytes sent are summed over the
`PipelineStage` send operations of both stages; the planner's estimate is `preinfer.memory.traffic.traffic`'s
bytes per step (forward activations and backward gradients at each of the N-1 cuts).

    python -m bench.pipeline             # small-llama, seq 128, batch 8, 6 timed steps per row
    python -m bench.pipeline --quick     # tiny-llama, seq 32, 2 timed steps per row
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


STAGES = 2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per row (after one untimed)")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--quick", action="store_true", help="tiny-llama, seq 32, 2 timed steps")
    parser.add_argument("--out", help="JSON path [bench/out/pipeline.json]")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a torchrun rank writing its rows here
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.steps = "tiny-llama", 32, 2
    return args


def worker(args: argparse.Namespace) -> None:
    """One rank: time every (schedule, M) row; rank 0 writes the rows (both stages' numbers) to args.worker."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    import preinfer
    from preinfer.memory.layer_spans import LayerSpan
    from preinfer.memory.settings import Settings
    from preinfer.memory.shapes import shape_from_config
    from preinfer.partition import make_partition
    from preinfer.memory.stage_cut import cut_stages
    from preinfer.parallel_dims import parallel_dims
    from pipelines.pipeline_parallel.visit import VisitPipeline
    from pipelines.models.suffix import load_modules, meta_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dims = parallel_dims(STAGES, "cpu")
    shape = shape_from_config(meta_model(args.model).config)
    whole = [LayerSpan(0, shape.layers, True, True)]
    settings = Settings(seq_len=args.seq_len, micro_batch=args.batch_size // STAGES)
    stages = cut_stages(shape, settings, STAGES, whole, STAGES)
    stage = stages[dims.stage]
    model = load_modules(args.model, lambda s: s.stage_modules(stage.start, stage.stop, stage.embed, stage.head),
                         f"stage {dims.stage}")
    staged = preinfer.stage(model)
    block = make_partition(staged, num_blocks=1).blocks[0]
    for param in model.parameters():
        param.requires_grad_(not param.is_meta)
    model.train()

    counters = {"busy": 0.0, "bytes": 0}

    def timed(method):
        def run(self, *a, **k):
            start = time.perf_counter()
            try:
                return method(self, *a, **k)
            finally:
                counters["busy"] += time.perf_counter() - start
        return run

    def counted(method):
        def run(self, *a, **k):
            ops = method(self, *a, **k)
            counters["bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops
        return run

    for name in ("forward_one_chunk", "backward_one_chunk"):
        setattr(PipelineStage, name, timed(getattr(PipelineStage, name)))
    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        setattr(PipelineStage, name, counted(getattr(PipelineStage, name)))

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (args.batch_size, args.seq_len), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    count = torch.tensor(float(args.batch_size * (args.seq_len - 1)))
    rows = []
    for pipeline_schedule in ("gpipe", "1f1b"):
        for parts in [int(m) for m in args.microbatches.split(",")]:
            pipe = VisitPipeline(staged, stages, dims, block, parts, pipeline_schedule, False, torch.device("cpu"))
            steps = []
            for index in range(args.steps + 1):
                counters.update(busy=0.0, bytes=0)
                dist.barrier()
                start = time.perf_counter()
                pipe.step(batch, count)
                dist.barrier()
                wall = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                if index:
                    steps.append((wall, counters["busy"], counters["bytes"]))
            mine = torch.tensor([statistics.median(s[0] for s in steps), statistics.median(s[1] for s in steps),
                                 steps[-1][2]], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(STAGES)]
            dist.all_gather(every, mine)
            rows.append(dict(pipeline_schedule=pipeline_schedule, microbatches=parts, step_s=max(float(e[0]) for e in every),
                             busy_s=[float(e[1]) for e in every], bytes_sent=int(sum(float(e[2]) for e in every))))
    if dist.get_rank() == 0:
        Path(args.worker).write_text(json.dumps(dict(stages=[vars(s) for s in stages], rows=rows)))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    from bench.lib.common import ROOT, command_line, machine, table, write_json
    from preinfer.memory.settings import Settings
    from preinfer.memory.shapes import resolve_shape
    from preinfer.memory.traffic import traffic

    with tempfile.TemporaryDirectory() as tmp:
        found = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(STAGES), "--standalone",
                   "-m", "bench.pipeline", "--worker", str(found), "--model", args.model,
                   "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                   "--microbatches", args.microbatches]
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        measured = json.loads(found.read_text())
    shape = resolve_shape(args.model)
    planned = traffic(shape, Settings(seq_len=args.seq_len, micro_batch=args.batch_size), STAGES)
    rows = []
    for row in measured["rows"]:
        m, busy = row["microbatches"], row["busy_s"]
        bubble = statistics.mean(1 - b / row["step_s"] for b in busy)
        rows.append(dict(row, bubble=bubble, bubble_slowest=1 - max(busy) / row["step_s"],
                         bubble_theory=(STAGES - 1) / (m + STAGES - 1),
                         planner_bytes=planned["pipeline_bytes_per_step"],
                         bytes_ratio=row["bytes_sent"] / planned["pipeline_bytes_per_step"]))
    print(f"{args.model}, seq {args.seq_len} x batch {args.batch_size}, {STAGES} stages: "
          + ", ".join(f"stage {j} layers {s['start']}-{s['stop'] - 1}" for j, s in enumerate(measured["stages"])))
    print(table([dict(r, busy=" / ".join(f"{b:.3f}" for b in r["busy_s"])) for r in rows],
                ["pipeline_schedule", "microbatches", "step_s", "busy", "bubble", "bubble_slowest", "bubble_theory", "bytes_sent",
                 "planner_bytes", "bytes_ratio"]))
    payload = dict(command=command_line("pipeline", argv if argv is not None else sys.argv[1:]),
                   machine=machine(), settings=dict(model=args.model, seq_len=args.seq_len,
                                                    batch_size=args.batch_size, steps=args.steps, stages=STAGES),
                   stage_cut=measured["stages"], rows=rows)
    path = Path(args.out) if args.out else write_json("pipeline", payload)
    if args.out:
        path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
