"""`preinfer demo`: BCD (UFP 1/3, Adam) of small-llama on Python's own docs, twice with the same seed: the
prefix run live (`--pre-inference off`) and with pre-inference decided per visit (`auto`), side by side."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from preinfer.config import Config
from preinfer.metrics import CacheRecord, Record, plot_losses, read_metrics
from preinfer.run_dir import RunDir
from pipelines.flags import add_flags
from pipelines import training


def demo_config(out: Path, pre_inference: str) -> Config:
    """Long visits over a small slice of the corpus: the regime where caching the prefix pays."""
    config = Config()
    config.model.name = "small-llama"
    config.data.seq_len = 128
    config.data.batch_size = 8
    config.data.max_samples = 256
    config.data.samples_per_shard = 64
    config.blocks.ufp = "1/3"
    config.blocks.sweeps = 2
    config.optim.name = "adam"
    config.optim.lr = 2e-3
    config.optim.warmup_steps = 10
    config.optim.grad_clip = 1.0
    config.stop.epochs_per_visit = 2.0
    config.pre_inference.mode = pre_inference
    config.run.out = str(out / pre_inference)
    return config.validate()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "--out", command="demo")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    runs = {}
    for mode in ("off", "auto"):
        config = demo_config(out, mode)
        if RunDir(config.run.out).holds_run():
            shutil.rmtree(config.run.out)
        print(f"\n== BCD of small-llama with --pre-inference {mode} ==")
        runs[mode] = (training.run(config), read_metrics(RunDir(config.run.out).metrics))
    print("\n" + comparison(runs))
    plot_losses({f"pre-inference {m}": records for m, (_, records) in runs.items()}, out / "demo.png",
                title="small-llama, BCD UFP 1/3: prefix live (off) against pre-inference (auto)")
    (out / "demo.json").write_text(json.dumps({m: summary for m, (summary, _) in runs.items()}, indent=1))
    print(f"\nruns in {out}/off and {out}/auto; losses against tokens in {out}/demo.png")
    return 0


def comparison(runs: dict[str, tuple[dict, list[Record]]]) -> str:
    """The two runs side by side."""
    rows = {
        "final eval loss": lambda s, r: f"{s['final_eval_loss']:.5f}",
        "wall time (s)": lambda s, r: f"{s['wall_s']:.1f}",
        "time caching (s)": lambda s, r: f"{sum(x.seconds for x in _caches(r)):.1f}",
        "peak tracked memory (MiB)": lambda s, r: f"{s['peak_memory'].get('tracked_peak', 0) / 2**20:.1f}",
        "largest store (MiB)": lambda s, r: f"{max([x.bytes for x in _caches(r)] or [0]) / 2**20:.1f}",
    }
    modes = list(runs)
    lines = [f"{'':<28}" + "".join(f"{m:>14}" for m in modes)]
    lines += [f"{name:<28}" + "".join(f"{cell(*runs[m]):>14}" for m in modes) for name, cell in rows.items()]
    per_run = [_visit_rates(summary["visits"]) for summary, _ in runs.values()]
    for index, pair in enumerate(zip(*per_run)):
        label = f"visit {index} (block {pair[0][0]}) tok/s"
        lines.append(f"{label:<28}" + "".join(f"{rate:>8,.0f} {source:>5}" for _, rate, source in pair))
    return "\n".join(lines)


def _caches(records: list[Record]) -> list[CacheRecord]:
    return [r for r in records if isinstance(r, CacheRecord)]


def _visit_rates(visits: list[dict]) -> list[tuple[int, float, str]]:
    """(block, training tokens/s, live or store) of each visit."""
    rates, before = [], 0
    for visit in visits:
        rates.append((visit["block"], (visit["tokens"] - before) / max(visit["wall_s"], 1e-9),
                      "store" if visit["source_boundary"] else "live"))
        before = visit["tokens"]
    return rates
