"""Whole-sweep pre-inference plans (pure: no I/O, no torch): which visits of a sweep read a store of boundary
states, how each store is made (from the input, rolled forward from a lower store, or reused), when each is
deleted, the disk the plan needs at its peak, and its predicted seconds against running every visit live.

A sweep's stores pay over the sweep, not over one visit: in an ascending sweep the store for block 1 is rolled
forward for block 2 at the cost of block 1's layers only; in a descending (or fixed) sweep a store built at the
start serves every visit above it; every visit's evaluation reads the eval split of its store. `plan_sweep`
prices every choice of reading visits (all of them up to `EXHAUSTIVE_VISITS` candidates, a local search
beyond), each with two timings of the builds (each store made as early as it stays valid, which lets one store
feed the next; just before its reader; or just before its reader and from the input, which holds the least
disk), and keeps the cheapest plan that fits the free disk.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# Keep this share of the free disk space untouched: a plan needs at most the rest at its peak.
DISK_RESERVE = 0.1
# Re-plan the rest of a sweep when a measured throughput (layer forward, write or read bytes/s) differs from the
# one the plan assumed by more than this fraction of it.
REVISE_MARGIN = 0.25
# Until a visit of a block has been timed, one training step over a layer costs this many no_grad forwards of it
# (forward, backward through activations and weights).
TRAIN_FACTOR = 3.0
# `auto` reads stores only when their plan is predicted to take at most this fraction less than live: within it,
# live is at worst this much slower than the stores if the prediction is right, and it is safe from what the model
# misses (a store's first open in a process, the disk's jitter), which only ever makes stores slower.
STORE_MARGIN = 0.02
# Store overheads below this many seconds are not worth a new plan, however they compare in relative terms.
OVERHEAD_FLOOR_S = 0.1
# Up to this many visits that could read a store, every choice of them is priced; beyond, a local search.
EXHAUSTIVE_VISITS = 10
# The timings of a plan's builds: (eager, roll); see `plan_for`. FROM_INPUT: those of stores that cannot be rolled
# forward (a pipeline's), each made from the input just before its reader.
Timings = tuple[tuple[bool, bool], ...]
TIMINGS: Timings = ((True, True), (False, True), (False, False))
FROM_INPUT: Timings = ((False, False),)


@dataclass(frozen=True)
class Visit:
    """One visit of a sweep: the block, the boundary its input comes from (0: the input) and its expected steps."""

    block: int
    start: int
    steps: int


@dataclass(frozen=True)
class Throughputs:
    """What this run measured (or assumes until it has): seconds and bytes per second."""

    layer_seconds: float  # no_grad forward of one layer over one sample, as a live prefix and an evaluation run it
    write_bps: float
    read_bps: float
    store_overhead_s: float = 0.0  # a store beyond its forward and its bytes (open, check, finalize, delete)
    step_seconds: Mapping[int, float] = field(default_factory=dict)  # block -> one step from its own boundary
    build_layer_seconds: float | None = None  # the same inside a store's build (None: not measured yet)

    @property
    def build_layer(self) -> float:
        """One layer's forward over one sample in a store's build (the caching job's batches, beside its writer
        thread): measured by the probe and every build; until then, `layer_seconds`."""
        return self.layer_seconds if self.build_layer_seconds is None else self.build_layer_seconds

    def differs(self, other: Throughputs, margin: float = REVISE_MARGIN) -> list[str]:
        """The throughputs that differ from `other`'s by more than `margin` of `other`'s (the store overhead: by
        more than `OVERHEAD_FLOOR_S` too)."""
        names = ("layer_seconds", "build_layer", "write_bps", "read_bps")
        moved = [n for n in names if abs(getattr(self, n) - getattr(other, n)) > margin * getattr(other, n)]
        change = abs(self.store_overhead_s - other.store_overhead_s)
        if change > max(margin * other.store_overhead_s, OVERHEAD_FLOOR_S):
            moved.append("store_overhead_s")
        return moved


@dataclass(frozen=True)
class Workload:
    """A sweep (or what remains of it) and what its stores cost in samples, bytes and disk."""

    visits: tuple[Visit, ...]
    num_layers: int
    samples_per_step: int
    train_samples: int
    eval_split_samples: int  # a store holds the whole eval split
    eval_samples: int  # samples one evaluation reads
    sample_bytes: int  # one sample's boundary state in the store
    free_bytes: float  # math.inf on object storage (no disk limit)
    stores: frozenset[int] = frozenset()  # boundaries with a valid store on disk now
    ranks: int = 1  # data-parallel ranks; each computes and writes 1/ranks of every store it builds

    @property
    def store_bytes(self) -> int:
        return (self.train_samples + self.eval_split_samples) * self.sample_bytes

    @property
    def disk_budget(self) -> float:
        return (1 - DISK_RESERVE) * self.free_bytes


@dataclass(frozen=True)
class Build:
    """Make the store at `boundary` before visit number `slot`, from the input (source 0) or the store at source."""

    boundary: int
    source: int
    slot: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    """One plan for a sweep. Times count events: 2t is the builds before visit t, 2t + 1 is visit t."""

    sources: tuple[int, ...]  # per visit: the boundary it reads (0: the input, prefix run live)
    builds: tuple[Build, ...]
    reused: tuple[int, ...]  # stores already on disk that the plan reads or rolls forward from
    deletes: tuple[tuple[int, int], ...]  # (boundary, time after which it is deleted)
    peak_bytes: int  # new store bytes on disk at the plan's peak
    visit_seconds: tuple[float, ...]

    @property
    def seconds(self) -> float:
        return sum(self.visit_seconds) + sum(b.seconds for b in self.builds)

    @property
    def reads_stores(self) -> bool:
        return any(self.sources)

    def describe(self) -> str:
        """E.g. `live` or `stores at 2 (from the input before visit 1), 4 (rolled forward from 2 before visit 2)`."""
        if not self.reads_stores:
            return "live"
        made = {b.boundary: b for b in self.builds}
        parts = []
        for k in sorted({k for k in self.sources if k}):
            build = made.get(k)
            how = "reused" if build is None else (
                f"{'from the input' if build.source == 0 else f'rolled forward from {build.source}'} "
                f"before visit {build.slot}")
            parts.append(f"{k} ({how})")
        return "stores at " + ", ".join(parts)


@dataclass(frozen=True)
class SweepPlan:
    """The plan chosen and what it was compared with."""

    chosen: Plan
    live: Plan
    best_store: Plan | None  # the cheapest plan that reads a store and fits the disk (None: none fits)
    no_reuse: bool  # every store would be made from the input just before its only reader

    @property
    def alternative(self) -> Plan | None:
        return self.best_store if self.chosen is self.live else self.live


def plan_sweep(work: Workload, rates: Throughputs, mode: str = "auto", roll: bool = True) -> SweepPlan:
    """`auto`: the cheapest plan that fits the disk, if it beats live by more than `STORE_MARGIN`, else live;
    `on`: every visit above the input reads a store, timed to fit the disk if any timing does. Without `roll`
    (stores that cannot be rolled forward), every store is made from the input just before its reader."""
    timings = TIMINGS if roll else FROM_INPUT
    live = plan_for(work, rates, (False,) * len(work.visits))
    eligible = tuple(v.start > 0 for v in work.visits)
    everything = [plan_for(work, rates, eligible, *timing) for timing in timings]
    fitting = [p for p in _candidates(work, rates, eligible, timings)
               if p.reads_stores and p.peak_bytes <= work.disk_budget]
    best_store = min(fitting, key=lambda p: p.seconds, default=None)
    if mode == "on":
        fits = [p for p in everything if p.peak_bytes <= work.disk_budget]
        chosen = min(fits, key=lambda p: p.seconds) if fits else min(everything, key=lambda p: p.peak_bytes)
    else:
        wins = best_store is not None and best_store.seconds < (1 - STORE_MARGIN) * live.seconds
        chosen = best_store if wins else live
    all_stores = min(everything, key=lambda p: p.seconds)
    no_reuse = bool(all_stores.builds) and not all_stores.reused and all(
        b.source == 0 and all_stores.sources.index(b.boundary) == b.slot for b in all_stores.builds)
    return SweepPlan(chosen=chosen, live=live, best_store=best_store, no_reuse=no_reuse)


def _candidates(work: Workload, rates: Throughputs, eligible: tuple[bool, ...], timings: Timings) -> Iterator[Plan]:
    """Plans for every choice of reading visits (each of `timings`), or a local search when there are many."""
    positions = [i for i, ok in enumerate(eligible) if ok]
    if len(positions) <= EXHAUSTIVE_VISITS:
        for chosen in itertools.product((False, True), repeat=len(positions)):
            uses = [False] * len(eligible)
            for i, use in zip(positions, chosen):
                uses[i] = use
            for timing in timings:
                yield plan_for(work, rates, tuple(uses), *timing)
        return
    for start in ((False,) * len(eligible), eligible):
        yield from _local_search(work, rates, start, positions, timings)


def _local_search(work: Workload, rates: Throughputs, uses: tuple[bool, ...], positions: list[int],
                  timings: Timings) -> Iterator[Plan]:
    """Flip one visit at a time while that makes the plan cheaper (and fit the disk); yields every plan kept."""
    def best(choice: tuple[bool, ...]) -> Plan:
        plans = [plan_for(work, rates, choice, *timing) for timing in timings]
        fits = [p for p in plans if p.peak_bytes <= work.disk_budget]
        return min(fits or plans, key=lambda p: (p.peak_bytes > work.disk_budget, p.seconds))

    current = best(uses)
    yield current
    improved = True
    while improved:
        improved = False
        for i in positions:
            flipped = tuple(not u if j == i else u for j, u in enumerate(uses))
            plan = best(flipped)
            if plan.peak_bytes <= work.disk_budget and plan.seconds < current.seconds:
                uses, current, improved = flipped, plan, True
                yield current


def plan_for(work: Workload, rates: Throughputs, uses: tuple[bool, ...], eager: bool = False,
             roll: bool = True) -> Plan:
    """The plan in which visit i reads the store at its own boundary iff uses[i]; with `eager`, each store is made
    as soon as no visit before its reader will change the layers below it, else just before its reader; with
    `roll`, each from the cheapest valid source (a lower store or the input), else from the input."""
    visits = work.visits
    slots: dict[int, list[int]] = {}
    reused: set[int] = set()
    for i, visit in enumerate(visits):
        if not uses[i]:
            continue
        changed = [p for p in range(i) if visits[p].start < visit.start]
        if visit.start in work.stores and not changed:
            reused.add(visit.start)
            continue
        slots.setdefault((changed[-1] + 1 if changed else 0) if eager else i, []).append(visit.start)

    valid = set(work.stores)
    born: dict[int, int] = {}
    last_use = {k: -1 for k in work.stores}
    builds = []
    for t in range(len(visits)):
        if t:
            valid -= {k for k in valid if k > visits[t - 1].start}
        for k in sorted(slots.get(t, [])):
            source, seconds = store_cost(work, rates, k, [j for j in valid if j < k and roll])
            builds.append(Build(boundary=k, source=source, slot=t, seconds=seconds))
            if source:
                last_use[source] = 2 * t
                reused.update({source} & work.stores)
            valid.add(k)
            born[k], last_use[k] = 2 * t, 2 * t
        if uses[t]:
            last_use[visits[t].start] = 2 * t + 1
    sources = tuple(v.start if use else 0 for v, use in zip(visits, uses))
    return Plan(
        sources=sources,
        builds=tuple(builds),
        reused=tuple(sorted(reused)),
        deletes=tuple(sorted((k, max(t, 0)) for k, t in last_use.items())),
        peak_bytes=_peak(born, last_use, len(visits), work.store_bytes),
        visit_seconds=tuple(visit_seconds(work, rates, v, k) for v, k in zip(visits, sources)),
    )


def store_cost(work: Workload, rates: Throughputs, boundary: int, below: list[int]) -> tuple[int, float]:
    """(source boundary, seconds) of the cheapest way to make the store at `boundary`: a fresh prefix run from
    the input, or a roll-forward from one of the valid stores `below` it (each rank making its share), its
    forward at the builds' own rate (`Throughputs.build_layer`)."""
    samples = (work.train_samples + work.eval_split_samples) / work.ranks
    nbytes = work.store_bytes / work.ranks
    write = nbytes / rates.write_bps + rates.store_overhead_s
    options = [(boundary * rates.build_layer * samples + write, 0)]
    options += [((boundary - j) * rates.build_layer * samples + write + nbytes / rates.read_bps, j)
                for j in below]
    seconds, source = min(options)
    return source, seconds


def switch_seconds(work: Workload, rates: Throughputs, visit: Visit, stores_read: bool, roll: bool = True) -> float:
    """What a visit costs beyond the steps of its own layers (`--stop gain`'s switching cost): when the plan reads
    stores, making its store the cheapest way (`store_cost`, rolled forward only with `roll`; 0 when a valid one is
    at its boundary); when it runs live, its prefix's forward over the visit's samples; 0 for a visit at the
    input."""
    if visit.start == 0:
        return 0.0
    if not stores_read:
        return visit.steps * work.samples_per_step * visit.start * rates.layer_seconds
    if visit.start in work.stores:
        return 0.0
    return store_cost(work, rates, visit.start, [k for k in work.stores if k < visit.start and roll])[1]


def _peak(born: dict[int, int], last_use: dict[int, int], visits: int, store_bytes: int) -> int:
    """The most bytes of new stores on disk at any time (stores already on disk are not counted)."""
    return max((sum(store_bytes for k, t in born.items() if t <= now <= last_use[k]) for now in range(2 * visits)),
               default=0)


def visit_seconds(work: Workload, rates: Throughputs, visit: Visit, source: int) -> float:
    """A visit's predicted seconds: its steps and its evaluation, reading the store at `source` or (0) running
    its prefix live."""
    per_sample = work.sample_bytes / rates.read_bps if source else visit.start * rates.layer_seconds
    above = work.num_layers - visit.start
    step = rates.step_seconds.get(visit.block, TRAIN_FACTOR * above * rates.layer_seconds * work.samples_per_step)
    samples = visit.steps * work.samples_per_step
    return visit.steps * step + samples * per_sample + work.eval_samples * (per_sample + above * rates.layer_seconds)
