"""The rules of how data-parallel replicas agree, torch-free (the config's rules and `preinfer plan` read them):
`--dp-sync` (`preinfer.replica_sync`) and `--grad-compression` (`preinfer.grad_compression`) parsed, and what
they do not run with."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from preinfer.errors import UsageError

DP_SYNC_GRAMMAR = "step, visit or every:N (N an integer >= 1)"


@dataclass(frozen=True)
class DpSync:
    """`--dp-sync` parsed: `every` is the steps between syncs inside a visit (None: none)."""

    mode: str  # step, visit or every
    every: int | None = None

    @property
    def per_step(self) -> bool:
        """Gradients summed at every step (the replicas never differ)."""
        return self.mode == "step"


def dp_sync_problems(c: Any) -> Iterator[tuple[str, str, str]]:
    """The config rules of `--dp-sync` and `--grad-compression` (`preinfer.config.rules`' problems): their grammars,
    the outer step only where replicas train apart, compression only of step sync, and what does not compose."""
    r = c.run
    try:
        parse_dp_sync(r.dp_sync)
    except UsageError:
        yield "run", "dp_sync", DP_SYNC_GRAMMAR
        return
    if r.dp_sync == "step" and (r.outer_lr != 1.0 or r.outer_momentum != 0.0):
        key = "outer_lr" if r.outer_lr != 1.0 else "outer_momentum"
        yield "run", key, "its default with {run.dp_sync} step (the outer step averages replicas that trained " \
                          "apart: visit or every:N)"
    elif r.dp_sync != "step" and r.pipeline > 1:
        yield "run", "dp_sync", "step on a pipeline (its stages' replicas sum each step's gradients; averaging " \
                                "them at syncs is not built for stages)"
    try:
        parse_grad_compression(r.grad_compression)
    except UsageError:
        yield "run", "grad_compression", COMPRESSION_GRAMMAR
        return
    if r.grad_compression != "none" and r.dp_sync != "step":
        yield "run", "grad_compression", "none with {run.dp_sync} " + r.dp_sync + " (it compresses step sync's " \
                                         "gradient sums; the replicas' average is sent whole)"
    elif r.grad_compression != "none" and r.pipeline > 1:
        yield "run", "grad_compression", "none on a pipeline (not built for its stages' sums)"


def parse_dp_sync(text: str) -> DpSync:
    """`step`, `visit` or `every:N`; a UsageError otherwise."""
    if text in ("step", "visit"):
        return DpSync(text)
    head, _, count = text.partition(":")
    if head == "every" and count.isdigit() and int(count) >= 1:
        return DpSync("every", int(count))
    raise UsageError(f"--dp-sync {text}: expected {DP_SYNC_GRAMMAR}")


COMPRESSION_GRAMMAR = ("none, bf16 or powersgd:R[:W] (R an integer >= 1, the rank; W an integer >= 0, the steps "
                       "of each visit summed uncompressed first, 0 by default)")


def parse_grad_compression(text: str) -> tuple[int, int] | None:
    """PowerSGD's rank and warm-up steps of `text` (None for none and bf16); a UsageError when it is none of the
    three."""
    if text in ("none", "bf16"):
        return None
    head, *numbers = text.split(":")
    if head == "powersgd" and len(numbers) in (1, 2) and all(n.isdigit() for n in numbers) and int(numbers[0]) >= 1:
        return int(numbers[0]), int(numbers[1]) if len(numbers) == 2 else 0
    raise UsageError(f"--grad-compression {text}: expected {COMPRESSION_GRAMMAR}")
