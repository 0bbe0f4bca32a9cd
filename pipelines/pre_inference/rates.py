"""The throughputs a run with pre-inference plans with: first estimated (`probe`), then measured over every store
it makes and every visit it trains, and agreed across data-parallel ranks."""

from __future__ import annotations

import dataclasses
import time

import torch

from pipelines.cache import open_cache
from pipelines.pre_inference.ranks import agreed
from pipelines.pre_inference.writers import Built
from pipelines.pre_inference.sweep_plan import Throughputs, Visit, Workload, visit_seconds
from storage import Location


@dataclasses.dataclass
class Tally:
    """Sums over the stores this run has made: each throughput is a ratio of two sums, steadier on a loaded
    machine than the last store's alone (so the plan is not revised on one slow or fast build)."""

    forward_seconds: float = 0.0
    layer_samples: int = 0  # one layer's forward over one sample, counted over every build
    write_seconds: float = 0.0
    write_bytes: int = 0
    overhead_seconds: float = 0.0  # each build's time beyond its forward and its bytes, and each deletion
    builds: int = 0


def read_bps(path: Location, split: str, batch_size: int, sample_bytes: int) -> float | None:
    """Read speed: one pass over a store's split; None when the pass took no measurable time or read nothing."""
    store = open_cache(path, splits=[split])[split]
    started = time.perf_counter()
    samples = sum(len(batch["hidden"]) for batch in store.reader(batch_size, shuffle=False))
    seconds = time.perf_counter() - started
    return samples * sample_bytes / seconds if seconds > 0 and samples else None


class MeasuredRates:
    """The throughputs in force (`current`: None until the first estimate), and the sums they are measured from."""

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device
        self.current: Throughputs | None = None
        self.tally = Tally()

    def agree(self) -> Throughputs:
        """The slowest rank's throughputs under data parallelism, in force from now on."""
        self.current = agreed(self.current, self.world, self.device)
        return self.current

    def update(self, **changes: float | dict) -> None:
        self.current = dataclasses.replace(self.current, **changes)

    def add_overhead(self, seconds: float, built: bool = False) -> None:
        """A store's fixed cost: its build beyond its forward and bytes (`built`: counts one more store), and its
        deletion."""
        self.tally.builds += built
        self.tally.overhead_seconds += seconds
        if self.tally.builds:
            self.update(store_overhead_s=self.tally.overhead_seconds / self.tally.builds)

    def add_build(self, result: Built, source: int, sample_bytes: int) -> None:
        """The builds' layer forward (`Throughputs.build_layer`: not the live prefix's, which runs in training's
        batches with no writer beside it) and write speed over every store made so far, the one just made
        included."""
        tally, rates = self.tally, self.current
        tally.forward_seconds += result.forward_seconds
        tally.layer_samples += (result.boundary - source) * result.samples_computed
        tally.write_seconds += result.write_seconds
        tally.write_bytes += result.samples_computed * sample_bytes  # the cost model's bytes: uncompressed
        self.update(
            build_layer_seconds=tally.forward_seconds / tally.layer_samples if tally.forward_seconds else
            rates.build_layer_seconds,
            write_bps=tally.write_bytes / tally.write_seconds if tally.write_seconds > 0 else rates.write_bps)

    def add_read(self, path: Location, split: str, batch_size: int, sample_bytes: int) -> None:
        """Read speed: one pass over a store's split (the probe's, then the first store's eval split)."""
        if (speed := read_bps(path, split, batch_size, sample_bytes)) is not None:
            self.update(read_bps=speed)

    def add_steps(self, work: Workload, visit: Visit, boundary: int, measured: float) -> None:
        """A visit's own step time: its wall time less what the plan charges for its input and its evaluation."""
        if visit.steps <= 0:
            return
        steps = {**self.current.step_seconds, visit.block: 0.0}
        rest = visit_seconds(work, dataclasses.replace(self.current, step_seconds=steps), visit, boundary)
        steps[visit.block] = max(measured - rest, 0.0) / visit.steps
        self.update(step_seconds=steps)
