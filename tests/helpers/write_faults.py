"""What the write-fault tests share (tests/contract/test_write_faults.py, test_token_store_faults.py): the runs
under test and their flags, the one error line a fault ends a command with and the command it names, and what a run
has written for good and ends with."""

import errno
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from preinfer.checkpoint import newest_checkpoint
from tests.helpers.cli_run import run_cli
from tests.helpers.disk_faults import ENOSPC, EROFS, files

ERRORS = {"full-disk": ENOSPC, "read-only": EROFS}
REMEDY = {errno.ENOSPC: "free space", errno.EROFS: "make it writable"}

# The runs whose checkpoints are under test: 8-bit AdamW state with low-rank expansion factors, checkpointed every
# step, so that the first visit's step 1 and the second's step 3 (the run cut by --total-steps) are mid-visit; and
# the kept optimizer state (host memory, carried by each checkpoint) over two sweeps of one-step visits.
RUNS = {
    "adamw8bit-lowrank": ["--steps-per-visit", "2", "--total-steps", "3", "--optimizer", "adamw8bit",
                          "--expand", "lowrank"],
    "kept-state": ["--steps-per-visit", "1", "--sweeps", "2", "--optimizer", "adamw8bit", "--keep-optimizer-state"],
}


def bcd_args(corpus: str, tokens: Path, out: Path, run: str, *extra: str) -> list[str]:
    return ["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--batch-size", "4", "--blocks", "2",
            "--eval-tokens", "64", "--max-samples", "8", "--lr", "1e-3", "--pre-inference", "off",
            "--checkpoint-every", "1", "--token-store", str(tokens), *RUNS[run], *extra, "--out", str(out)]


def tokenize_args(corpus: str, out: Path) -> list[str]:
    return ["tokenize", "--data", corpus, "--seq-len", "32", "--samples-per-shard", "8", "--quiet", "--out", str(out)]


def the_error_line(err: str) -> str:
    """The command's one error line: the last of stderr (transformers' progress bar of the export may come
    before it), no traceback, no other error line."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and err.strip().endswith(errors[0]), err
    return errors[0]


def failed(argv: list[str], capsys, error: OSError) -> str:
    """Run `preinfer ARGV`, which a fault of `error` stops: exit 1 and one line saying why and the remedy."""
    code, _, err = run_cli(argv, capsys)
    assert code == 1, err
    line = the_error_line(err)
    assert error.strerror in line and f"{REMEDY[error.errno]}, then" in line, line
    return line


def rerun_named(line: str, argv: list[str], out: Path) -> list[str]:
    """The command `line` says continues the run: `preinfer bcd --out OUT --resume`, or the same command again."""
    if line.endswith(f"then run `preinfer bcd --out {out} --resume`"):
        return ["bcd", "--out", str(out), "--resume"]
    assert "then run the same command again" in line, line
    return argv


def run_result(out: Path) -> dict[str, object]:
    """What a run ends with: its checkpoint's weights and optimizer state (tensors), and its export's files."""
    checkpoint = out / "checkpoint"
    return {"model": load_file(str(checkpoint / "model.safetensors")),
            "state": load_file(str(checkpoint / "state.safetensors")),
            "export": files(out / "export")}


def assert_finished_as(out: Path, expected: dict[str, object]) -> None:
    got = run_result(out)
    for part in ("model", "state"):
        assert set(got[part]) == set(expected[part])
        assert all(torch.equal(got[part][k], expected[part][k]) for k in got[part]), part
    assert got["export"] == expected["export"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".owner.lock") == []


def kept(out: Path) -> dict[str, bytes]:
    """What a run has written for good: its newest complete checkpoint's files and its export's (by path under
    `out`), and its config and inputs once a checkpoint needs them."""
    found = {}
    checkpoint = newest_checkpoint(out / "checkpoint")
    if checkpoint is not None:
        found.update({f"{checkpoint.name}/{k}": v for k, v in files(checkpoint).items()})
        found.update({name: (out / name).read_bytes() for name in ("config.toml", "inputs.json")})
    if (out / "export").is_dir():
        found.update({f"export/{k}": v for k, v in files(out / "export").items()})
    return found


class Reference(NamedTuple):
    """A run, uninterrupted: what it ends with, and the writes it makes in its directory (paths relative to it)."""

    finished: dict[str, object]
    writes: list[str]

    def at(self, write: str, occurrence: int = 1) -> int:
        """The number (1: the first) of the `occurrence`-th write of `write` (a path relative to the run)."""
        return [i for i, path in enumerate(self.writes, 1) if path == write][occurrence - 1]


def run_main(argv: list[str]) -> int:
    from pipelines.cli import main

    return main(argv)
