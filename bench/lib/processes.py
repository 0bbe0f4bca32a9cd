"""A benchmark's step run as a process of its own under `nice -n 10`, measured by the kernel: its exit status,
seconds, peak RSS (`os.wait4`'s ru_maxrss) and, sampled while it runs, its peak anonymous and file-backed RSS."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

from bench.lib.common import ROOT

NICENESS = 10  # each measured process's `nice -n`: a benchmark's steps yield to the machine's other work


def measured(command: list[str], sample_s: float = 0.0) -> tuple[dict, str]:
    """Run `command` under `nice -n NICENESS`: its exit status, seconds, peak RSS in bytes and last line of stderr (with
    `sample_s` > 0, also the peaks of RssAnon and RssFile read from /proc every `sample_s` seconds); and its
    stdout."""
    start = time.perf_counter()
    peaks = {"RssAnon": 0, "RssFile": 0}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(["nice", "-n", str(NICENESS), *command], cwd=ROOT, stdout=out, stderr=err,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
        sampler = threading.Thread(target=_sample, args=(process, peaks, sample_s), daemon=True)
        if sample_s > 0:
            sampler.start()
        _, status, usage = os.wait4(process.pid, 0)
        out.seek(0)
        err.seek(0)
        stdout, lines = out.read(), [line for line in err.read().splitlines() if line.strip()]
    row = dict(command=" ".join(command), exit=os.waitstatus_to_exitcode(status),
               seconds=round(time.perf_counter() - start, 1), peak_rss=usage.ru_maxrss * 1024,
               last_line=lines[-1] if lines else "")
    if sample_s > 0:
        row.update(peak_rss_anon=peaks["RssAnon"], peak_rss_file=peaks["RssFile"])
    return row, stdout


def _sample(process: subprocess.Popen, peaks: dict[str, int], every: float) -> None:
    """Keep the largest RssAnon and RssFile of `process` (`nice` executes the command in its own process)."""
    while process.poll() is None:
        try:
            with open(f"/proc/{process.pid}/status") as status:
                for line in status:
                    key = line.split(":", 1)[0]
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(line.split()[1]) * 1024)
        except (OSError, ValueError):
            return
        time.sleep(every)


def cli(*args: str) -> list[str]:
    """`preinfer ARGS` in this interpreter."""
    return [sys.executable, "-m", "pipelines.cli", *args]
