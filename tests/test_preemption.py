"""Preemption-safe runs (invariant 8): SIGTERM or SIGINT mid-visit finishes the step, writes a checkpoint and exits
143 / 130 with one line saying how to resume; `--resume` continues from that step and ends bit for bit where an
uninterrupted run ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipelines.cli import main
from preinfer.metrics import StepRecord, read_metrics
from preinfer.run_dir import RunDir

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
# `preinfer bcd` that, once it has logged its first step, waits until the test says it has sent its signal (the
# file SIGNAL_SENT names appears): the signal arrives mid-visit however slowly the test is scheduled.
HELD_BCD = """
import os, pathlib, sys, time
from pipelines.cli import main
from preinfer.metrics import MetricsLog, StepRecord

write, sent = MetricsLog.write, pathlib.Path(os.environ["SIGNAL_SENT"])

def write_then_wait(self, record):
    write(self, record)
    while isinstance(record, StepRecord) and record.step == 1 and not sent.exists():
        time.sleep(0.01)

MetricsLog.write = write_then_wait
sys.exit(main(sys.argv[1:]))
"""


def bcd_args(corpus: str, out: Path) -> list[str]:
    return ["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--batch-size", "2",
            "--steps-per-visit", str(STEPS), "--blocks", "2", "--eval-tokens", "128", "--pre-inference", "off",
            "--lr", "1e-3", "--precision", "bf16-mixed", "--out", str(out)]


def interrupt(corpus: str, out: Path, signum: int) -> subprocess.CompletedProcess:
    """Run `preinfer bcd` in a child process and send it `signum` once it has logged its first step (it waits there
    until the signal is sent)."""
    sent = out.parent / f"{out.name}.signal-sent"
    child = subprocess.Popen([sys.executable, "-c", HELD_BCD, *bcd_args(corpus, out)], cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "SIGNAL_SENT": str(sent)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = RunDir(out).metrics
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and '"kind": "step"' in metrics.read_text()):
        assert child.poll() is None and time.monotonic() < deadline, "the run ended before its first step"
        time.sleep(0.01)
    child.send_signal(signum)
    sent.touch()
    stdout, stderr = child.communicate(timeout=300)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def stopped_at(out: Path) -> dict:
    return json.loads((RunDir(out).checkpoint / "state.json").read_text())["trainer"]


@pytest.mark.timeout(600)
def test_sigterm_mid_visit_then_resume_equals_an_uninterrupted_run(tmp_path, corpus):
    out = tmp_path / "preempted"
    stopped = interrupt(corpus, out, signal.SIGTERM)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("preinfer bcd: stopped by SIGTERM after step ")
    assert f"`preinfer bcd --out {out} --resume`" in last
    state = stopped_at(out)
    assert 0 < state["visit_step"] < STEPS and state["visit"] == 0  # mid-visit of the first block
    assert not RunDir(out).export.exists()

    assert main([*bcd_args(corpus, out), "--resume"]) == 0
    steps = [r.step for r in read_metrics(RunDir(out).metrics) if isinstance(r, StepRecord)]
    assert steps == list(range(1, 2 * STEPS + 1))  # no step redone, none missing

    reference = tmp_path / "uninterrupted"
    assert main(bcd_args(corpus, reference)) == 0
    got, want = (load_file(str(RunDir(d).checkpoint_weights)) for d in (out, reference))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(600)
def test_sigint_mid_visit_checkpoints_and_exits_130(tmp_path, corpus):
    out = tmp_path / "interrupted"
    stopped = interrupt(corpus, out, signal.SIGINT)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1].startswith("preinfer bcd: stopped by SIGINT after step ")
    state = stopped_at(out)
    assert 0 < state["visit_step"] < STEPS
    assert state["global_step"] == int(stopped.stderr.strip().split("after step ")[1].split(";")[0])


class FakeCuda:
    """Two CUDA devices whose generator states are given tensors, and the states set back on them."""

    def __init__(self, monkeypatch, devices: int):
        self.states = [torch.full((16,), i + 1, dtype=torch.uint8) for i in range(devices)]
        self.restored: list[torch.Tensor] | None = None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: setattr(self, "restored", list(states)))


@pytest.mark.parametrize("devices", [0, 2])
def test_checkpoints_carry_every_cuda_generator_state(tmp_path, monkeypatch, devices):
    """Invariant 8 on accelerators: each CUDA device's generator state is saved, and set again on resume."""
    from preinfer.checkpoint import load_checkpoint, save_checkpoint

    cuda = FakeCuda(monkeypatch, devices)
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "checkpoint", model, {}, {"step": 1})
    saved = load_file(str(tmp_path / "checkpoint" / "state.safetensors"))
    assert sorted(name for name in saved if name.startswith("rng.cuda.")) == [f"rng.cuda.{i}" for i in range(devices)]
    for i, state in enumerate(cuda.states):
        assert torch.equal(saved[f"rng.cuda.{i}"], state)
    cuda.states = [torch.zeros(16, dtype=torch.uint8) for _ in range(devices)]  # the generators moved on
    load_checkpoint(tmp_path / "checkpoint", model)
    if devices:
        assert [s.tolist() for s in cuda.restored] == [[i + 1] * 16 for i in range(devices)]
    else:
        assert cuda.restored is None
