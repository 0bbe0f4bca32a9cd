"""How data-parallel replicas agree, side by side (issue 46): `--dp-sync` step, visit (plain average and DiLoCo's
outer Nesterov step) and every:N, and step sync's `--grad-compression` bf16 and powersgd:R, each a torchrun job of
--ranks gloo CPU processes over the same model, corpus, seed and global batch (equal tokens: --global-batch split
over the ranks), on a corpus no default was tuned on (the source text of Python's own `argparse` module).

Measured per row, from the run's metrics.jsonl: the eval loss after the last visit; the bytes each rank sent per
step (`sent_bytes`, counted at the collectives: step and visit records, the visits' closing syncs included); the
compute seconds of a step (its wall on this machine, where the ranks' link is the loopback); and the wall per step
modelled at 10 and 25 Gbps: compute + bytes / bandwidth (no overlap). Ratios are to step sync's row of the same
ranks: bytes, eval loss (percent above), modelled wall. Every row trains the same steps (--steps-per-visit a visit,
100 by default: the visit rows sync once in 100 steps), so the rows are at equal tokens. The plot (--plot, a PNG)
draws each row's training loss against the bytes its rank 0 had sent by then, and its final eval loss at its total
bytes, one panel per world size. The
machine is shared and small (2 cores; 4 ranks share them): keep runs short, read medians and ratios, not absolute
seconds. The wall measured over a rate-limited link is `bench.dp_sync_link`'s.

    python -m bench.dp_sync --ranks 2,4 --plot docs/dp_sync.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.lib.common import command_line, machine, table, write_json
from bench.lib.dp_sync_runs import arguments, corpus, measured, records, run

GBPS = (10, 25)


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


def loss_against_bytes(out: Path) -> tuple[list[float], list[float]]:
    """Each step's training loss, and the bytes rank 0 had sent by its end (a visit's closing sync counted at the
    visit's last step)."""
    steps, visits = records(out)
    closing = {}  # the last step of each visit: its sync's bytes (the visit's beyond its steps')
    for visit in visits:
        mine = [s for s in steps if (s.sweep, s.block) == (visit.sweep, visit.block)]
        closing[mine[-1].step] = visit.sent_bytes - sum(s.sent_bytes for s in mine)
    sent, total = [], 0
    for step in steps:
        total += step.sent_bytes + closing.get(step.step, 0)
        sent.append(total)
    return sent, [s.loss for s in steps]


def plot(rows: list[dict], work: Path, path: str) -> None:
    """Training loss against bytes sent, one panel per world size, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({row["ranks"] for row in rows})
    figure, axes = plt.subplots(1, len(worlds), figsize=(4.2 * len(worlds), 3.2), squeeze=False, sharey=True)
    for axis, ranks in zip(axes[0], worlds):
        for row in (r for r in rows if r["ranks"] == ranks):
            sent, loss = loss_against_bytes(work / f"{ranks}-{row['mode']}")
            line, = axis.plot([max(b, 1) for b in sent], loss, label=row["mode"], linewidth=0.8, alpha=0.7)
            axis.plot(sent[-1], row["eval_loss"], "o", color=line.get_color(), markersize=5)
        axis.set(xscale="log", title=f"{ranks} ranks", xlabel="bytes sent by a rank")
    axes[0][0].set_ylabel("training loss (dots: final eval loss)")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = arguments("python -m bench.dp_sync", __doc__).parse_args(argv)
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
    if args.plot:
        plot(rows, work, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
