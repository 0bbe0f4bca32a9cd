"""How data-parallel replicas agree, side by side (issue 46): `--dp-sync` step, visit (plain average and DiLoCo's
outer Nesterov step) and every:N, and step sync's `--grad-compression` bf16 and powersgd:R, each a torchrun job of
--ranks gloo CPU processes over the same model, corpus, seed and global batch (equal tokens: --global-batch split
over the ranks), on a corpus no default was tuned on (the source text of Python's own `argparse` module).

Measured per row, from the run's metrics.jsonl: the eval loss after the last visit; the bytes each rank sent per
step (`sent_bytes`, counted at the collectives: step and visit records, the visits' closing syncs included); the
compute seconds of a step (its wall on this machine, where the ranks' link is the loopback); and the wall per step
modelled at 10 and 25 Gbps: compute + bytes / bandwidth (no overlap). Ratios are to step sync's row of the same
ranks: bytes, eval loss (percent above), modelled wall. The machine is shared and small (2 cores): keep runs short,
read medians and ratios, not absolute seconds. The wall over a rate-limited link (network namespaces joined by a
veth pair under a tbf qdisc) is not built here: it needs root and `ip`/`tc`.

    python -m bench.dp_sync --ranks 2 --steps-per-visit 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.lib.common import ROOT, command_line, machine, table, write_json

MODES = {  # row: flags
    "step": ["--dp-sync", "step"],
    "step+bf16": ["--dp-sync", "step", "--grad-compression", "bf16"],
    "step+powersgd:4": ["--dp-sync", "step", "--grad-compression", "powersgd:4"],
    "every:10": ["--dp-sync", "every:10"],
    "visit": ["--dp-sync", "visit"],
    "visit+outer": ["--dp-sync", "visit", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
}
GBPS = (10, 25)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.dp_sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2", help="comma list of world sizes, e.g. 2,4")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--sweeps", type=int, default=2)
    parser.add_argument("--steps-per-visit", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences a step over all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench-dp-sync"), help="where the runs go")
    return parser.parse_args(argv)


def corpus(work: Path) -> str:
    """The source of Python's `argparse` module as a text corpus."""
    path = work / "corpus.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(Path(argparse.__file__).read_text())
    return str(path)


def run(args: argparse.Namespace, ranks: int, mode: str, data: str, out: Path) -> None:
    """One row's torchrun job."""
    flags = ["bcd", "--model", args.model, "--data", data, "--blocks", str(args.blocks), "--sweeps",
             str(args.sweeps), "--steps-per-visit", str(args.steps_per_visit), "--batch-size",
             str(args.global_batch // ranks), "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--seed", "0",
             "--pre-inference", "off", "--expand", "none", "--grad-clip", "0", "--order", "ascending",
             "--out", str(out), *MODES[mode]]
    shutil.rmtree(out, ignore_errors=True)  # this benchmark's own run of an earlier invocation
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    "-m", "pipelines.cli", *flags], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def measured(out: Path) -> dict:
    """Eval loss, bytes a step and compute seconds a step of one run (rank 0's records)."""
    from preinfer.metrics import StepRecord, VisitRecord, read_metrics
    from preinfer.run_dir import RunDir

    records = read_metrics(RunDir(out).metrics)
    steps = [r for r in records if isinstance(r, StepRecord)]
    visits = [r for r in records if isinstance(r, VisitRecord)]
    seconds = [(b.tokens - a.tokens) / b.tokens_per_s for a, b in zip(steps, steps[1:])]  # this step's tokens
    return dict(eval_loss=visits[-1].eval_loss, bytes_per_step=sum(v.sent_bytes for v in visits) / len(steps),
                compute_s=statistics.median(seconds), steps=len(steps))


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's modelled walls and its ratios to step sync's row of the same ranks."""
    for row in rows:
        for gbps in GBPS:
            row[f"wall_{gbps}g_s"] = row["compute_s"] + row["bytes_per_step"] / (gbps * 1e9 / 8)
    for row in rows:
        base = next(r for r in rows if r["ranks"] == row["ranks"] and r["mode"] == "step")
        row["bytes_x"] = row["bytes_per_step"] / base["bytes_per_step"]
        row["loss_vs_step_pct"] = 100 * (row["eval_loss"] / base["eval_loss"] - 1)
        row["wall_10g_x"] = row["wall_10g_s"] / base["wall_10g_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = Path(args.work)
    data = corpus(work)
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for mode in args.modes.split(","):
            out = work / f"{ranks}-{mode}"
            run(args, ranks, mode, data, out)
            rows.append(dict(ranks=ranks, mode=mode, **measured(out)))
    rows = with_ratios(rows)
    print(table(rows, ["ranks", "mode", "eval_loss", "loss_vs_step_pct", "bytes_per_step", "bytes_x", "compute_s",
                       "wall_10g_s", "wall_25g_s", "wall_10g_x"]))
    path = write_json("dp_sync", dict(command=command_line("dp_sync", argv or sys.argv[1:]), machine=machine(),
                                      settings=vars(args), rows=rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
