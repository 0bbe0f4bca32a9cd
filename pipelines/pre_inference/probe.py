"""The first estimates of a run with pre-inference, before any store is made: one layer's forward, timed on a
training batch, and (for `auto`, when stores could pay at all) the disk, timed by a small probe store; until a
store measures them, the assumed speeds below."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from preinfer.boundary_state import BoundaryState
from preinfer.metrics import CacheRecord
from preinfer.staged import StagedModel
from pipelines.cache import CacheOptions, cache_boundary
from pipelines.cache.directory import check_out
from pipelines.pre_inference import sweep_plan
from pipelines.pre_inference.rates import read_bps
from pipelines.pre_inference.sweep_plan import Throughputs, Workload, plan_sweep
from storage import Location, blobs_for, owning

# Timed forwards of one layer over one training batch that give the first estimate of the prefix's speed.
LAYER_PROBES = 5
# Before the first plan of `auto` (when a store could pay at all), a store of the first training samples (one
# shard, at most this many bytes of states) is written, read back and deleted, to time the store's disk, codec
# and format on this machine.
PROBE_BYTES = 8 * 2**20
# `on` plans without the probe: until a store has been written and read, it assumes these speeds (bytes/s).
ASSUMED_WRITE_BPS = 150e6
ASSUMED_READ_BPS = 300e6
# Until the probe or a store has measured it, a store's fixed cost (seconds: open, check, finalize, index, delete;
# the probe measured 0.04-0.17 s on the development machine, later stores 0.01-0.04 s).
ASSUMED_STORE_OVERHEAD_S = 0.05


def first_estimate(staged: StagedModel, batch: dict) -> Throughputs:
    """The measured layer forward (`layer_seconds`) and the assumed store speeds and fixed cost."""
    return Throughputs(layer_seconds(staged, batch), ASSUMED_WRITE_BPS, ASSUMED_READ_BPS, ASSUMED_STORE_OVERHEAD_S)


@torch.no_grad()
def layer_seconds(staged: StagedModel, batch: dict) -> float:
    """Median time of one layer's no_grad forward over one sample, measured once on a training batch (after one
    untimed forward: the first allocates): the first layer this process holds (a pipeline stage holds a few), over
    the batch's embedding or, on a stage without it, random hidden states of the batch's shape."""
    device = next(p for p in staged.model.parameters() if not p.is_meta).device
    ids, mask, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
    layer = next(i for i, module in enumerate(staged.layers) if not any(p.is_meta for p in module.parameters()))
    if layer == 0:
        state = staged.embed(ids, mask, labels)
    else:
        draws = torch.Generator(device).manual_seed(0)  # the run's own random state stays untouched
        hidden = torch.randn(*ids.shape, staged.hidden_size, dtype=staged.compute_dtype, device=device,
                             generator=draws)
        state = BoundaryState.right_padded(hidden, mask, labels)
    staged.run(state, layer, layer + 1)
    times = []
    for _ in range(LAYER_PROBES):
        started = time.perf_counter()
        staged.run(state, layer, layer + 1)
        times.append(time.perf_counter() - started)
    return statistics.median(times) / len(ids)


def probe_samples(shard: int, train_samples: int, sample_bytes: int) -> int:
    """The probe store's samples: the first training samples, one shard, at most `PROBE_BYTES` of states."""
    return max(1, min(shard, train_samples, PROBE_BYTES // sample_bytes))


def probe_seconds(samples: int, sample_bytes: int, rates: Throughputs) -> float:
    """What the probe will cost, priced as a store of `samples` at boundary 1 with `rates` (the layer forward
    measured on this run's model and machine, the disk assumed until the probe times it): its forward, its bytes
    written once and read twice, and a store's fixed cost. Its forward is what grows with the model (one layer of
    SmolLM2 over 28 samples: about 1 s of the 1.9 s it measured there, where a constant 0.2 s was assumed)."""
    nbytes = samples * sample_bytes
    return (samples * rates.build_layer + nbytes / rates.write_bps + 2 * nbytes / rates.read_bps
            + rates.store_overhead_s)


def stores_could_pay(work: Workload, rates: Throughputs, shard: int) -> bool:
    """Whether stores could save more than the probe would cost (`probe_seconds`) beyond `STORE_MARGIN` on a disk
    that costs nothing to write and read, each store still costing its fixed overhead (if not, timing the disk
    cannot pay for itself, and the probe is not made)."""
    probe_s = probe_seconds(probe_samples(shard, work.train_samples, work.sample_bytes), work.sample_bytes, rates)
    free = plan_sweep(work, dataclasses.replace(rates, write_bps=math.inf, read_bps=math.inf), "auto")
    return free.best_store is not None and (
        free.best_store.seconds + probe_s < (1 - sweep_plan.STORE_MARGIN) * free.live.seconds)


def probe_store(staged: StagedModel, train, tokenizer, out: Location, options: CacheOptions, shard: int,
                batch_size: int, sample_bytes: int, rates: Throughputs) -> tuple[Throughputs, CacheRecord]:
    """`rates` with the first estimate of the builds' layer forward, the write and read speeds and a store's fixed
    cost, and the probe's record: the store at boundary 1 of `probe_samples`, made by the caching job's code at
    `out`, read back twice (the faster pass: the first pays the reader's start, which a visit pays once over many
    more bytes) and deleted. The first real store replaces the estimates."""
    started = time.perf_counter()
    samples = probe_samples(shard, len(train), sample_bytes)
    check_out(out, ["probe"], "overwrite", "--store-dir")  # a directory that is not a probe's is refused, untouched
    with owning(out, "--store-dir", temporary=True):  # held around the caching job's own hold of it
        try:
            result = cache_boundary(staged, {"probe": train.head(samples)}, tokenizer, 1, out, options)
            if result.write_seconds > 0:
                rates = dataclasses.replace(rates, write_bps=samples * sample_bytes / result.write_seconds)
            if result.forward_seconds > 0:
                rates = dataclasses.replace(rates, build_layer_seconds=result.forward_seconds / samples)
            speeds = [s for s in (read_bps(out, "probe", batch_size, sample_bytes) for _ in range(2)) if s]
            if speeds:
                rates = dataclasses.replace(rates, read_bps=max(speeds))
        finally:
            deleting = time.perf_counter()
            blobs_for(out).remove_all()  # the probe's own store (the directory goes with the lock)
    # the store's fixed cost (open, check, finalize, index, delete) until the first real store measures it
    overhead = result.seconds - result.forward_seconds - result.write_seconds + time.perf_counter() - deleting
    rates = dataclasses.replace(rates, store_overhead_s=max(overhead, 0.0))
    return rates, CacheRecord(boundary=1, how="probe", seconds=time.perf_counter() - started,
                              bytes=result.bytes_written)
