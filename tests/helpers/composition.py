"""The features of issue 44's composition set, as `preinfer bcd` flags, and how a combination of them is run:
each combination either trains (and then must equal its references) or is refused in one line before any model
loads. `tests/test_composition.py` runs every pair and the combinations the largest runs need; docs/combinations.md
lists the refused ones with their reasons."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from pipelines.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "combinations.md"


@dataclass(frozen=True)
class Feature:
    flags: tuple[str, ...]
    key: str  # the setting it gives: two features of one key are one setting's values, never combined
    procs: int = 1  # processes under torchrun (a pipeline's stages, data-parallel replicas)
    moe: bool = False  # needs a mixture-of-experts model


FEATURES: dict[str, Feature] = {
    "int8": Feature(("--frozen-dtype", "int8"), "frozen"),
    "nf4": Feature(("--frozen-dtype", "nf4"), "frozen"),
    "pipeline2": Feature(("--pipeline", "2"), "pipeline", procs=2),
    "dp2": Feature((), "dp", procs=2),
    "experts": Feature(("--experts", "top:0.5"), "experts", moe=True),
    "lowrank": Feature(("--expand", "lowrank"), "expand"),
    "sgd": Feature(("--expand", "sgd", "--expand-lr", "0.01"), "expand"),
    "keep": Feature(("--keep-optimizer-state",), "keep"),
    "fused": Feature(("--fused-step",), "fused"),
    "adamw8bit": Feature(("--optimizer", "adamw8bit"), "optimizer"),
    "bf16": Feature(("--precision", "bf16-mixed"), "precision"),
    "stores-on": Feature(("--pre-inference", "on"), "stores"),
    "stores-auto": Feature(("--pre-inference", "auto"), "stores"),
    "ufp-auto": Feature(("--ufp", "auto", "--separate-ends", "--memory-budget", "3MiB"), "partition"),
}

# The combinations the largest runs need (issue 44): a pipeline of 24 GB cards with frozen codes, 8-bit state,
# the fused step and expansion; the same in one process from stores and with the automatic partition.
LARGEST = [
    ("pipeline2", "nf4", "adamw8bit", "fused", "lowrank"),
    ("nf4", "adamw8bit", "fused", "lowrank", "stores-on"),
    ("nf4", "adamw8bit", "fused", "ufp-auto"),
    ("dp2", "int8", "adamw8bit", "fused", "lowrank"),
]


def combinations() -> list[tuple[str, ...]]:
    """Every pair of features of different settings, then `LARGEST`."""
    pairs = [pair for pair in itertools.combinations(FEATURES, 2)
             if FEATURES[pair[0]].key != FEATURES[pair[1]].key]
    return [*pairs, *LARGEST]


# Features that change how a run computes, not what it computes: without them a combination ends with the same
# weights (float32, relative 1e-5): stores equal live (invariant 3), the fused step equals the unfused one, a pipeline
# of 2 equals one process over the same micro-batches (invariant 10; checked where no data-parallel replica is).
EXACT_REWRITES = ("stores-on", "stores-auto", "fused", "pipeline2")


def reference(combination: tuple[str, ...]) -> tuple[str, ...] | None:
    """The combination without its exact rewrites (`EXACT_REWRITES`), which must end with its weights; None where
    it has none. The fused step and a pipeline stay where the partition is chosen by memory (the fused step needs
    less, and a pipeline's stages are priced each as its own card, so the blocks may differ), a pipeline where
    data-parallel replicas are (their one-process run reads other batches)."""
    kept = {"pipeline2"} if "dp2" in combination else set()
    rewrites = set(EXACT_REWRITES) - kept - ({"fused", "pipeline2"} if "ufp-auto" in combination else set())
    plain = tuple(f for f in combination if f not in rewrites)
    return plain if plain != combination else None


def name(combination: tuple[str, ...]) -> str:
    return "+".join(combination)


def procs(combination: tuple[str, ...]) -> int:
    """Processes the combination runs on (a pipeline of 2 with data parallel 2 is a mesh of 4)."""
    return max(1, sum(FEATURES[f].procs for f in combination if FEATURES[f].procs > 1))


def bcd_args(combination: tuple[str, ...], corpus: str, out: Path) -> list[str]:
    """`preinfer bcd` arguments of `combination`: 2 blocks (unless the partition is chosen), 2 steps a visit, 2
    sweeps, batches of 4 samples of 16 tokens from the first 32 samples of each split. A pipeline splits each batch
    into 2 micro-batches; every other run (its one-process reference too) reads the same micro-batches,
    accumulating 2 per step."""
    moe = any(FEATURES[f].moe for f in combination)
    args = ["bcd", "--model", "tiny-moe" if moe else "tiny-llama", "--data", corpus, "--seq-len", "16",
            "--max-samples", "32", "--samples-per-shard", "8", "--eval-fraction", "0.2", "--eval-tokens", "64",
            "--steps-per-visit", "2", "--sweeps", "2", "--lr", "1e-3", "--seed", "0", "--out", str(out)]
    if not any(f.startswith("stores") for f in combination):
        args += ["--pre-inference", "off"]
    if "ufp-auto" not in combination:
        args += ["--blocks", "2"]
    if "expand" not in {FEATURES[f].key for f in combination}:
        args += ["--expand", "none"]  # the feature under test alone (auto expands where it runs)
    if "pipeline2" in combination:
        args += ["--batch-size", "4", "--microbatches", "2"]
    else:
        args += ["--batch-size", "2", "--grad-accum", "2"]
    for feature in combination:
        args += FEATURES[feature].flags
    return args


def refusal_table() -> dict[str, str]:
    """docs/combinations.md's table of refused combinations: {name: reason}."""
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) \|$", DOC.read_text(), flags=re.M)
    return {row: reason for row, reason in rows}


def outcome(arguments: list[str]) -> dict:
    """`preinfer ARGUMENTS` in this process: {"code": its exit code, "err": its stderr, "loaded": whether a model
    was built}."""
    err = io.StringIO()
    with ModelBuilds() as builds, contextlib.redirect_stderr(err):
        try:
            code = main(arguments)
        except SystemExit as exit_:
            code = exit_.code
    return {"code": code, "err": err.getvalue(), "loaded": builds.count > 0}


def quick_finish(setattr_) -> None:
    """Leave out, by `setattr_` (a monkeypatch's, or `setattr` in a process of its own), what the combinations do
    not check: the loss plot and the fsync of each write (durability is tested where it is built)."""
    import pipelines.training.run_directory
    import preinfer.atomic_write

    setattr_(pipelines.training.run_directory, "plot_losses", lambda *args, **kwargs: None)
    setattr_(preinfer.atomic_write, "_fsync", lambda *args, **kwargs: None)


class ModelBuilds:
    """Counts the preset models built (`preinfer.presets.build_preset`'s `from_config`) while it is installed: a
    combination refused before any model loads builds none."""

    def __init__(self):
        import preinfer.presets

        self.module, self.real, self.count = preinfer.presets, preinfer.presets.AutoModelForCausalLM, 0

    def from_config(self, *args, **kwargs):
        self.count += 1
        return self.real.from_config(*args, **kwargs)

    def __enter__(self) -> "ModelBuilds":
        self.module.AutoModelForCausalLM = self
        return self

    def __exit__(self, *exc) -> None:
        self.module.AutoModelForCausalLM = self.real


class StopAfter:
    """Sends this process SIGTERM after the `steps`-th step record, as a user stopping the run would (the CLI's
    handler then checkpoints and stops with exit code 143)."""

    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def wrap(self, emit):
        def emitting(trainer, record):
            emit(trainer, record)
            if type(record).__name__ == "StepRecord":
                self.seen += 1
                if self.seen == self.steps:
                    os.kill(os.getpid(), signal.SIGTERM)
        return emitting
