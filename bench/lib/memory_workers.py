"""bench.memory's workers, one per configuration, each in a process of its own: full Adam and BCD live, the
caching job of a store configuration, and BCD from a store with the suffix alone loaded."""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import torch

import preinfer
from preinfer.config import Config, load_config
from preinfer.memory.meter import MemoryMeter
from preinfer.partition import Block, Partition, make_partition
from preinfer.presets import build_preset
from preinfer.batch_source import LiveSources
from preinfer.trainer import Trainer


def rss_now() -> int:
    """Current resident set size of this process in bytes (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_config(args: argparse.Namespace, mode: str, ufp: str | None, recompute: bool) -> Config:
    """The training config of one memory run: Adam, a few steps per visit, one sweep, one eval batch, BCD as the
    paper runs it (no landscape expansion)."""
    return load_config(overrides=dict(
        model=dict(name=args.model, attention=args.attention),
        data=dict(seq_len=args.seq_len, batch_size=args.batch_size, eval_tokens=args.seq_len * args.batch_size),
        blocks=dict(ufp=ufp or "1", sweeps=1, order="ascending", expand="none"),
        optim=dict(name="adam", lr=1e-4),
        stop=dict(steps_per_visit=args.steps),
        run=dict(mode=mode, seed=0, recompute=recompute, precision=args.precision),
    ))


def visit_row(visit: dict, block: Block) -> dict:
    """One visit's measurement: the block, the meter's report."""
    return dict(block=visit["block"], label=visit["label"], start=block.start, stop=block.stop,
                source_boundary=visit["source_boundary"], num_params=block.num_params, memory=visit["memory"])


def live_worker(args: argparse.Namespace, mode: str, ufp: str | None, recompute: bool) -> dict:
    """Full Adam (mode full) or live BCD-Adam at `ufp`: every block visited once, the whole model resident."""
    from pipelines.training import live_sources, load_datasets, samples_per_shard

    config = worker_config(args, mode, ufp, recompute)
    torch.manual_seed(0)
    data = load_datasets(config)
    rss_start = rss_now()
    model = build_preset(args.model, seed=0, attention=args.attention)
    staged = preinfer.stage(model)
    if mode == "full":
        partition = make_partition(staged, num_blocks=1)
    else:
        partition = make_partition(staged, ufp=float(Fraction(ufp)))
    trainer = Trainer(staged, partition, config, live_sources(data, config, samples_per_shard(config, staged)), None,
                      MemoryMeter(model))
    visits = trainer.fit()
    return dict(rss_start=rss_start, partition=partition.report(),
                visits=[visit_row(v, partition.blocks[v["block"]]) for v in visits])


def store_path(args: argparse.Namespace, boundary: int) -> Path:
    return Path(args.result).parent / "_stores" / f"{args.model}-s{args.seq_len}-k{boundary}"


def upper_blocks(staged: preinfer.StagedModel, ufp: str) -> list[Block]:
    """The blocks of a UFP partition above boundary 0 (those a run from a store trains)."""
    return [block for block in make_partition(staged, ufp=float(Fraction(ufp))).blocks if block.start > 0]


@torch.inference_mode()
def cache_worker(args: argparse.Namespace, ufp: str) -> dict:
    """The caching step (its own process): run the frozen prefix over the first --store-samples training samples
    and write the boundary states at each upper block's start boundary k to a zarr store through `storage`, in
    the compute dtype. All stores come from the initial weights: in a real ascending sweep the store
    at a higher boundary is rolled forward after the block below has trained; its shapes, all that memory sees,
    are the same."""
    import storage
    from pipelines.training import load_datasets, samples_per_shard
    from preinfer.fingerprint import boundary_fingerprint, prefix_digest

    from preinfer.precision import apply_precision

    config = worker_config(args, "bcd", ufp, recompute=False)
    data = load_datasets(config)
    model = build_preset(args.model, seed=0, attention=args.attention).eval()
    apply_precision(model, args.precision)
    staged = preinfer.stage(model)
    dtype = staged.compute_dtype
    n, t, h = min(args.store_samples, len(data.train)), args.seq_len, staged.hidden_size
    paths = {}
    for block in upper_blocks(staged, ufp):
        k = block.start
        digest, parts = boundary_fingerprint(prefix_digest(staged, k), k, data.train.fingerprint(), "byte", t,
                                             str(dtype).removeprefix("torch."), staged.attention, args.model)
        fields = {"hidden": ((t, h), dtype), "attention_mask": ((t,), torch.bool),
                  "position_ids": ((t,), torch.int64), "labels": ((t,), torch.int64)}
        per_shard = min(n, samples_per_shard(config, staged))
        path = store_path(args, k)
        store = storage.create_store(path, fields, n, per_shard, storage.Fingerprint(digest, parts), overwrite=True)
        for shard in store.missing_shards():
            lo, hi = store.shard_range(shard)
            batch = data.train[torch.arange(lo, hi)]
            state = staged.run(staged.embed(batch["input_ids"], batch["attention_mask"], batch["labels"]), 0, k)
            store.write_shard(shard, state.to_dict())
        store.finalize()
        paths[k] = str(path)
    return dict(stores=paths, samples=n)


def store_worker(args: argparse.Namespace, ufp: str, recompute: bool) -> dict:
    """BCD-Adam from a store, as `preinfer train --store` runs it: for each block above boundary 0 in ascending
    order, the model is loaded with only its suffix from the block's start boundary k in memory
    (`pipelines.models.suffix.load_suffix`: the prefix's tensors are dropped, never used), the visit reads boundary
    states at k from the store the caching worker wrote (through `storage`'s reader), and the real Trainer
    trains the block for a few steps."""
    import storage
    from pipelines.data.batches import ReaderBatches
    from pipelines.models.suffix import load_suffix

    config = worker_config(args, "bcd", ufp, recompute)
    torch.manual_seed(0)
    rss_start = rss_now()
    whole = make_partition(preinfer.stage(build_preset(args.model, seed=0)), ufp=float(Fraction(ufp)))
    report, starts = whole.report(), [block.start for block in whole.blocks if block.start > 0]
    del whole
    gc.collect()
    rows = []
    for start in starts:
        model = load_suffix(args.model, start, 0, args.attention).model
        staged = preinfer.stage(model)
        block = next(b for b in make_partition(staged, ufp=float(Fraction(ufp))).blocks if b.start == start)
        total = sum(p.numel() for p in model.parameters())
        single = Partition((replace(block, index=0),), total, total, ())
        store = storage.open_store(store_path(args, start))
        train = ReaderBatches(store, start, args.batch_size, seed=0)
        evaluation = ReaderBatches(store, start, args.batch_size, seed=0, shuffle=False)
        # every visit reads the store at the visited block's start boundary
        trainer = Trainer(staged, single, config, LiveSources(train, evaluation), None, MemoryMeter(model))
        (visit,) = trainer.fit()
        train.close()
        visit["block"] = block.index
        rows.append(visit_row(visit, block))
        del trainer, single, block, train, evaluation, store, model, staged
        gc.collect()
    return dict(rss_start=rss_start, partition=report, visits=rows,
                store="real zarr stores of real prefix states (storage.create_store, read by pipelines.data.batches."
                      "ReaderBatches); the suffix loaded by pipelines.models.suffix.load_suffix (prefix not resident)")


def parse_configuration(name: str) -> tuple[str, str | None, bool]:
    """'live:1/3+recompute' -> ('live', '1/3', True); 'full' -> ('full', None, False)."""
    base, _, extra = name.partition("+")
    kind, _, ufp = base.partition(":")
    return kind, ufp or None, extra == "recompute"


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    kind, ufp, recompute = parse_configuration(args.worker)
    if kind == "full":
        result = live_worker(args, "full", None, recompute)
    elif kind == "live":
        result = live_worker(args, "bcd", ufp, recompute)
    elif kind == "store":
        result = store_worker(args, ufp, recompute)
    elif args.worker.startswith("cache:"):
        Path(args.result).write_text(json.dumps(cache_worker(args, args.worker.split(":", 1)[1])))
        return
    else:
        raise SystemExit(f"unknown worker '{args.worker}'")
    result["rss_peak"] = max(v["memory"]["rss_peak"] for v in result["visits"])
    result["wall_s"] = time.perf_counter() - started
    Path(args.result).write_text(json.dumps(result))
