"""Small helpers shared by the benchmarks: the repository root, median timing, commands run side by side, a
plain-text table, the command line a result records, JSON output under bench/out/."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository root: `python -m bench.NAME` runs from here
OUT = ROOT / "bench" / "out"


def median_seconds(run: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median wall time of `run` over `repeats` runs; `before` runs untimed before each one."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_side_by_side(commands: list[list[str]], cwd: pathlib.Path) -> None:
    """Run `commands` at the same time, command i pinned to core i (`taskset`) with one OpenMP thread, so that
    they meet the same machine at every moment: a shared machine's speed moves by tens of percent within
    minutes, which then moves them alike and cancels in their ratio."""
    started = [_pinned(command, core, cwd) for core, command in enumerate(commands)]
    for process in started:
        _check(process)


def run_paced(pacer: list[str], measured: list[str], cwd: pathlib.Path, ready: pathlib.Path, done: pathlib.Path,
              cores: tuple[int, int] = (0, 1)) -> None:
    """Run `measured` beside `pacer`, pinned as in `run_side_by_side`, so that the pacer covers every moment of
    the measured run: `measured` starts once the pacer has created `ready` (after its first step), and `done`
    is created when `measured` has ended (the pacer's cue to stop)."""
    pace = _pinned(pacer, cores[0], cwd)
    while not ready.exists():
        if pace.poll() is not None:
            _check(pace)
            raise RuntimeError(f"the pacer ended before it started: {' '.join(pacer)}")
        time.sleep(0.05)
    try:
        _check(_pinned(measured, cores[1], cwd))
    finally:
        done.touch()
        _check(pace)


def _pinned(command: list[str], core: int, cwd: pathlib.Path) -> subprocess.Popen:
    """`command` started on `core` alone (`taskset`) with one OpenMP thread, its output discarded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(["taskset", "-c", str(core), *command], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _check(process: subprocess.Popen) -> None:
    if process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode, process.args)


def table(rows: list[dict], columns: list[str]) -> str:
    """Rows of dicts as an aligned text table (floats with 2 decimals)."""
    cells = [[f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def write_json(name: str, payload: dict) -> pathlib.Path:
    """Write `payload` to bench/out/<name>.json and return the path."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def module_command(name: str) -> list[str]:
    """The start of the command that runs benchmark `name` in a process of its own (from ROOT, as `cwd`)."""
    return [sys.executable, "-m", f"bench.{name}"]


def command_line(name: str, args: list[str]) -> str:
    """The command that reruns benchmark `name` with `args`, as its JSON records it."""
    return " ".join(["python", "-m", f"bench.{name}", *args])


def machine() -> dict:
    """Where the benchmark ran."""
    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in pathlib.Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), 0)
    return dict(nproc=os.cpu_count(), cpu=cpu, ram_gib=round(mem / 2**30, 1), torch=torch.__version__,
                python=platform.python_version(), torch_threads=torch.get_num_threads())
