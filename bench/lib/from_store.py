"""bench.train's measurements of training from a store: steps/s live and from a store with the reader's wait
(parts 1 and 3), the pieces of one step (part 2), and the top block trained from lossy stores (issue 14)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import preinfer
from bench.lib.common import table
from bench.lib.train_runs import base_config, train_once
from bench.lib.trained import cache_split, trained_model
from pipelines.cache import CacheOptions, cache_boundary, open_cache
from pipelines.data.batches import ReaderBatches
from pipelines.models import resolve_model
from pipelines.models.suffix import load_suffix, to_device
from pipelines.training import live_sources, load_datasets, partition_for, samples_per_shard
from preinfer.batch_source import LiveSources
from preinfer.optim import build_optimizer
from preinfer.staged import causal_lm_loss, supervised_tokens


def throughput(args: argparse.Namespace, root: Path) -> dict:
    config = base_config(args, data=dict(eval_tokens=args.seq_len * args.batch_size, max_samples=args.samples),
                         stop=dict(steps_per_visit=args.warmup + args.steps),
                         pre_inference=dict(mode="off"))
    data = load_datasets(config)
    model = resolve_model(args.model, seed=0)
    staged = preinfer.stage(model)
    ufp_partition, _ = partition_for(staged, config)
    top = ufp_partition.blocks[-1]
    k, num_layers = top.start, staged.num_layers
    config.blocks.active = f"{k}-{num_layers - 1}"
    partition, active = partition_for(staged, config)
    shard = samples_per_shard(config, staged)

    started = time.perf_counter()
    built = cache_boundary(staged, {"train": data.train, "eval": data.eval}, data.tokenizer, k, root / f"store-{k}",
                           CacheOptions(samples_per_shard=shard, mode="overwrite", progress=False,
                                        model_name=args.model))
    build_s = time.perf_counter() - started
    stores = open_cache(root / f"store-{k}", splits=["train", "eval"])
    store_bytes = sum(s.stored_bytes for s in built.splits.values())

    suffix = load_suffix(args.model, k, seed=0)
    suffix_staged = preinfer.stage(to_device(suffix.model, "cpu"))
    suffix_partition, suffix_active = partition_for(suffix_staged, config, first_layer=k)

    def store_sources() -> LiveSources:
        b, seed = config.data.batch_size, config.run.seed
        return LiveSources(ReaderBatches(stores["train"], k, b, seed),
                           ReaderBatches(stores["eval"], k, b, seed, shuffle=False))

    runs: dict[str, list[dict]] = {"live": [], "store": []}
    for rep in range(args.repeats):
        for name in ("live", "store"):
            if name == "live":
                run = train_once(staged, partition, active, config, live_sources(data, config, shard))
            else:
                run = train_once(suffix_staged, suffix_partition, suffix_active, config, store_sources())
            runs[name].append(run.summary(args.warmup))
            r = runs[name][-1]
            print(f"[train] rep {rep} {name}: {r['steps_per_s']:.2f} steps/s, wait {100 * r['wait_fraction']:.2f}%,"
                  f" first step {r['first_step_s']:.3f} s (wait {r['first_wait_s']:.3f} s)", flush=True)
    loss_diff = max(abs(a - b) / abs(a) for live, store in zip(runs["live"], runs["store"])
                    for a, b in zip(live["losses"], store["losses"]))
    median = {name: statistics.median(r["steps_per_s"] for r in rs) for name, rs in runs.items()}
    store_runs = runs["store"]
    return dict(
        boundary=k, num_layers=num_layers, active=config.blocks.active, samples_per_shard=shard,
        train_samples=len(data.train), eval_samples=len(data.eval),
        store=dict(build_s=build_s, job_seconds=built.seconds, stored_MiB=store_bytes / 2**20),
        live_steps_per_s=median["live"], store_steps_per_s=median["store"],
        achieved=median["store"] / median["live"],
        wait_fraction=statistics.median(r["wait_fraction"] for r in store_runs),
        wait_fraction_with_first=statistics.median(
            (r["wait_s"] + r["first_wait_s"]) / (r["step_s"] + r["first_step_s"]) for r in store_runs),
        live_wait_fraction=statistics.median(r["wait_fraction"] for r in runs["live"]),
        max_rel_loss_diff=loss_diff, runs={n: [{k2: v for k2, v in r.items() if k2 != "losses"} for r in rs]
                                           for n, rs in runs.items()},
        staged=staged, partition=partition, active_index=active, data=data,
    )


# ---- 2: the pieces of one step -------------------------------------------------------------------------------


def pieces(args: argparse.Namespace, staged, partition, active: int, data) -> dict:
    """Median seconds of the prefix forward (no_grad), the suffix forward + backward and the Adam step."""
    block = partition.blocks[active]
    k, num_layers = block.start, staged.num_layers
    model = staged.model
    model.requires_grad_(False)
    for param in block.params:
        param.requires_grad_(True)
    model.train()
    for module in staged.prefix_modules(k):
        module.eval()
    optimizer = build_optimizer(list(block.params), base_config(args).optim)
    rows = data.train[: args.batch_size]
    ids, mask, labels = rows["input_ids"], rows["attention_mask"], rows["labels"]
    count = supervised_tokens(labels)

    def prefix():
        with torch.no_grad():
            return staged.run(staged.embed(ids, mask, labels), 0, k)

    state = prefix()

    def suffix():
        out = staged.run(state, k, num_layers)
        loss = causal_lm_loss(staged.logits(out), out.labels, reduction="sum") / count
        loss.backward()
        loss.item()

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"prefix": [], "suffix": [], "adam": []}
    for index in range(args.piece_repeats + 3):  # 3 warm-up rounds
        for name, fn in (("prefix", prefix), ("suffix", suffix), ("adam", step)):
            t0 = time.perf_counter()
            fn()
            if index >= 3:
                times[name].append(time.perf_counter() - t0)
    model.requires_grad_(False)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return dict(prefix_s=med["prefix"], suffix_s=med["suffix"], adam_s=med["adam"],
                ideal=(med["prefix"] + med["suffix"]) / med["suffix"],
                ideal_with_adam=(med["prefix"] + med["suffix"] + med["adam"]) / (med["suffix"] + med["adam"]),
                repeats=args.piece_repeats)


def store_dtype_runs(args: argparse.Namespace, root: Path) -> dict:
    """The top block of a trained run trained from a store in each dtype: final eval loss, reader wait."""
    staged, data = trained_model(args.trained)
    config = base_config(args, stop=dict(steps_per_visit=args.warmup + args.dtype_steps),
                         pre_inference=dict(mode="off"), optim=dict(decay=args.dtype_lr_decay))
    k = partition_for(staged, config)[0].blocks[-1].start
    config.blocks.active = f"{k}-{staged.num_layers - 1}"
    stores = {}
    for dtype in ["float32", *args.store_dtypes.split(",")]:
        cache_split(staged, data, k, root / dtype, dtype)
        stores[dtype] = open_cache(root / dtype, splits=["train", "eval"])
    rows = []
    for seed in [int(s) for s in args.dtype_seeds.split(",")]:
        config.run.seed = seed
        for dtype, split_stores in stores.items():
            suffix = preinfer.stage(to_device(load_suffix(args.trained, k, seed=0).model, "cpu"))
            partition, active = partition_for(suffix, config, first_layer=k)
            b = config.data.batch_size
            sources = LiveSources(ReaderBatches(split_stores["train"], k, b, seed),
                                  ReaderBatches(stores["float32"]["eval"], k, b, seed, shuffle=False))
            run = train_once(suffix, partition, active, config, sources)
            summary = run.summary(args.warmup)
            rows.append(dict(seed=seed, dtype=dtype, final_eval_loss=run.visit.eval_loss,
                             wait_fraction=summary["wait_fraction"], steps_per_s=summary["steps_per_s"],
                             first_wait_s=summary["first_wait_s"]))
        exact = rows[-len(stores)]["final_eval_loss"]
        for row in rows[-len(stores):]:
            row["rel_eval_loss_diff"] = (row["final_eval_loss"] - exact) / exact
            print(table([row], list(row)).splitlines()[-1], flush=True)
    by_dtype = {}
    for dtype in stores:
        diffs = [r["rel_eval_loss_diff"] for r in rows if r["dtype"] == dtype]
        waits = [r["wait_fraction"] for r in rows if r["dtype"] == dtype]
        by_dtype[dtype] = dict(seeds=len(diffs), mean_rel_eval_loss_diff=statistics.mean(diffs),
                               max_rel_eval_loss_diff=max(diffs), median_wait_fraction=statistics.median(waits))
    return dict(boundary=k, active=config.blocks.active, steps=args.dtype_steps, warmup=args.warmup,
                lr_decay=args.dtype_lr_decay, seq_len=args.seq_len, batch_size=args.batch_size, trained=args.trained,
                rows=rows, summary=by_dtype,
                eval="the exact (float32) eval store for every run; each seed's runs against that seed's exact run",
                targets=dict(rel_eval_loss_diff="<= 0.005", wait_fraction="<= 0.01"))
