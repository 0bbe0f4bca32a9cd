"""bench.train --scenarios: issue 16's scenario table, whole `bcd` runs with `--pre-inference` auto against on
and off, each pair side by side in processes of their own."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.lib.common import ROOT, command_line, machine, module_command, run_side_by_side, table
from bench.lib.train_runs import base_config, timed_run
from preinfer.metrics import CacheRecord, PlanOutcomeRecord, SweepPlanRecord

SCENARIO_MODES = ("auto", "on", "off")


def scenario_run(args: argparse.Namespace, model: str, order: str, epochs: float, mode: str, out: Path) -> dict:
    """One whole bcd run of a scenario: wall time, final eval loss, auto's plans and the model's prediction."""
    config = base_config(argparse.Namespace(**{**vars(args), "model": model}),
                         data=dict(max_samples=args.scenario_samples), blocks=dict(sweeps=args.sweeps, order=order),
                         stop=dict(epochs_per_visit=epochs), run=dict(out=str(out)),
                         pre_inference=dict(mode=mode, store_dir=str(out.parent / f"{out.name}-stores")))
    summary, records, wall, cpu = timed_run(config, out)
    plans = [r for r in records if isinstance(r, SweepPlanRecord)]
    outcome = [r for r in records if isinstance(r, PlanOutcomeRecord)]
    probes = [r.seconds for r in records if isinstance(r, CacheRecord) and r.how == "probe"]
    return dict(mode=mode, wall_s=wall, probe_s=sum(probes), cpu_s=cpu, load_average=os.getloadavg()[0], fit_s=summary["wall_s"],
                final_eval_loss=summary["final_eval_loss"],
                steps=summary["steps"], sources=[v["source_boundary"] for v in summary["visits"]],
                plans=[dict(sweep=p.sweep, reason=p.reason, chosen=p.chosen, predicted_s=p.predicted_s,
                            alternative=p.alternative, alternative_s=p.alternative_s, live_s=p.live_s,
                            note=p.note) for p in plans],
                predicted_s=outcome[-1].run_predicted_s if outcome else None,
                measured_s=outcome[-1].run_measured_s if outcome else None)


def scenario_command(args: argparse.Namespace, model: str, order: str, epochs: float, mode: str,
                     out: Path) -> tuple[list[str], Path]:
    """The command that runs `scenario_run` in a Python process of its own, as a user's `preinfer bcd` runs
    (nothing carried over from the runs before it: allocator state, threads, opened stores, warmed code paths; its
    times leave out the process's start and imports), and the file it writes its result to."""
    result = out.parent / f"{out.name}.json"
    spec = dict(model=model, order=order, epochs=epochs, mode=mode, out=str(out))
    command = [*module_command("train"), "--seq-len", str(args.seq_len), "--batch-size",
               str(args.batch_size), "--scenario-samples", str(args.scenario_samples), "--sweeps", str(args.sweeps),
               "--threads", "1", "--scenario-worker", json.dumps(spec), "--result", str(result)]
    return command, result


def scenario_worker(args: argparse.Namespace) -> None:
    spec = json.loads(args.scenario_worker)
    run = scenario_run(args, spec["model"], spec["order"], spec["epochs"], spec["mode"], Path(spec["out"]))
    args.result.write_text(json.dumps(run))


def scenario_pair(args: argparse.Namespace, model: str, order: str, epochs: float, modes: tuple[str, str],
                  out: Path) -> dict[str, dict]:
    """The runs of two modes of a scenario side by side, the first mode on core 0 (`run_side_by_side`)."""
    commands = {mode: scenario_command(args, model, order, epochs, mode, out / mode) for mode in modes}
    out.mkdir(parents=True, exist_ok=True)
    run_side_by_side([command for command, _ in commands.values()], ROOT)
    return {mode: json.loads(result.read_text()) for mode, (_, result) in commands.items()}


def scenarios(args: argparse.Namespace, root: Path, on_row=lambda rows: None) -> list[dict]:
    """Every scenario: auto against on and auto against off, each pair side by side (one core and one thread
    each; auto on core 0 in even repeats, core 1 in odd ones), --scenario-repeats times, after one untimed pair per
    model (the disk's caches). Auto over each mode: the median over repeats of the pair's ratio; auto over the
    better of the two: the larger of those (auto <= 1.05 x min(on, off) iff both ratios are <= 1.05). `on_row`
    sees the rows so far after each scenario."""
    rows = []
    epochs_list = [float(e) for e in args.scenario_epochs.split(",")]
    for model in args.scenario_models.split(","):
        scenario_pair(args, model, "ascending", epochs_list[0], ("on", "off"), root / f"warm-up-{model}")
        for order in args.scenario_orders.split(","):
            for epochs in epochs_list:
                name = f"{model}-{order}-{epochs:g}"
                repeats: dict[str, list[dict]] = {mode: [] for mode in SCENARIO_MODES}
                ratios: dict[str, dict[str, list[float]]] = {m: {"wall_s": [], "cpu_s": []} for m in ("on", "off")}
                for r in range(args.scenario_repeats):
                    for other in ("on", "off"):
                        modes = ("auto", other) if r % 2 == 0 else (other, "auto")
                        done = scenario_pair(args, model, order, epochs, modes, root / f"{name}-{other}-{r}")
                        for mode in modes:
                            repeats[mode].append(done[mode])
                        for key, values in ratios[other].items():
                            values.append(done["auto"][key] / done[other][key])
                runs = {mode: dict(runs[0], wall_s=statistics.median(r["wall_s"] for r in runs),
                                   walls_s=[r["wall_s"] for r in runs],
                                   cpu_s=statistics.median(r["cpu_s"] for r in runs),
                                   predicted_s=_median_or_none([r["predicted_s"] for r in runs]),
                                   measured_s=_median_or_none([r["measured_s"] for r in runs]),
                                   repeats=runs[1:])
                        for mode, runs in repeats.items()}
                over = {m: {key: statistics.median(v) for key, v in r.items()} for m, r in ratios.items()}
                losses = [r["final_eval_loss"] for mode in SCENARIO_MODES for r in repeats[mode]]
                row = dict(model=model, order=order, epochs_per_visit=epochs, runs=runs, pair_ratios=ratios,
                           auto_over_on=over["on"]["wall_s"], auto_over_off=over["off"]["wall_s"],
                           auto_over_best=max(over["on"]["wall_s"], over["off"]["wall_s"]),
                           auto_over_best_cpu=max(over["on"]["cpu_s"], over["off"]["cpu_s"]),
                           max_rel_eval_loss_diff=max(abs(a - losses[-1]) / abs(losses[-1]) for a in losses))
                rows.append(row)
                on_row(rows)
                print(f"[train] {name}: " + ", ".join(
                    f"{m} {r['wall_s']:.1f} s ({' '.join(f'{w:.1f}' for w in r['walls_s'])})" for m, r in runs.items())
                      + f"; auto / on {row['auto_over_on']:.3f}, auto / off {row['auto_over_off']:.3f}", flush=True)
    return rows


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def scenario_report(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        runs = row["runs"]
        auto, on = runs["auto"], runs["on"]
        lines.append(dict(
            model=row["model"], order=row["order"], epochs=f"{row['epochs_per_visit']:g}",
            auto_s=auto["wall_s"], on_s=on["wall_s"], off_s=runs["off"]["wall_s"],
            auto_over_on=f"{row['auto_over_on']:.3f}", auto_over_off=f"{row['auto_over_off']:.3f}",
            auto_over_best=f"{row['auto_over_best']:.3f}", cpu_auto_over_best=f"{row['auto_over_best_cpu']:.3f}",
            auto_sources=" ".join(map(str, auto["sources"])),
            on_sources=" ".join(map(str, on["sources"])),
            auto_probe_s=auto["probe_s"], auto_predicted_s=auto["predicted_s"], auto_measured_s=auto["measured_s"],
            on_predicted_s=on["predicted_s"], on_measured_s=on["measured_s"],
            loss_diff=f"{row['max_rel_eval_loss_diff']:.1e}"))
    return table(lines, list(lines[0]) if lines else [])


def scenario_main(args: argparse.Namespace, root: Path) -> dict:
    load = [os.getloadavg()[0]]
    started = time.perf_counter()

    def partial(rows: list[dict]) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps(rows, indent=1))

    rows = scenarios(args, root, partial)
    load.append(os.getloadavg()[0])
    return dict(
        benchmark="train scenarios", command=command_line("train", sys.argv[1:]),
        machine=machine(), load_average=load, wall_s=time.perf_counter() - started,
        settings=dict(models=args.scenario_models, data="builtin:pydoc", seq_len=args.seq_len,
                      batch_size=args.batch_size, max_samples=args.scenario_samples, sweeps=args.sweeps, ufp="1/3",
                      orders=args.scenario_orders, epochs_per_visit=args.scenario_epochs,
                      repeats=args.scenario_repeats, optimizer="adam", lr=2e-3, store="zarr, float32",
                      threads=torch.get_num_threads()),
        target="auto_over_best <= 1.05", scenarios=rows,
        targets_met=all(r["auto_over_best"] <= 1.05 for r in rows),
    )


# ---- report --------------------------------------------------------------------------------------------------
