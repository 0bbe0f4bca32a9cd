"""Benchmark of the caching job against the bare prefix forward it wraps.

On `small-llama` (boundary 4 of 6) over the default corpus (`builtin:pydoc`, byte tokens, seq_len 128, the
first --samples samples of the train split), in one run:

    (a) forward     embedding + layers [0, 4) over the data in batches, nothing kept or written
    (b) zarr        `cache_boundary` into a zarr store, default codec (blosc-zstd level 1), one process
    (c) safetensors the same into a safetensors store
    (d) dask        the same with `dask="local:2"` (2 worker processes; the cluster is started and the model
                    loaded in its workers by an untimed warm-up run, as in a BCD run that caches after each visit)

Variants are interleaved within each repetition (a b c d, a b c d, ...) so that drifting load on a shared machine
hits them alike; medians over --repeats. tokens/s of each and its ratio to (a). Target: (b)/(a) >= 0.9. Prints a
table and writes bench/out/cache.json.

    python -m bench.cache [--samples 1024] [--samples-per-shard 128] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time

import torch

from bench.lib.common import table, write_json

MODEL, BOUNDARY, SEQ_LEN, DATA = "small-llama", 4, 128, "builtin:pydoc"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--samples", type=int, default=1024, help="train samples to run over (0 = all) [1024]")
    parser.add_argument("--samples-per-shard", type=int, default=128, help="[128: 16 MiB of hidden states]")
    parser.add_argument("--batch-size", type=int, default=16, help="forward batch [16]")
    parser.add_argument("--repeats", type=int, default=3, help="[3]")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads [torch's default]")
    parser.add_argument("--variants", default="forward,zarr,safetensors,dask", help="[all]")
    parser.add_argument("--dir", default=None, help="where stores are written [a temporary directory]")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import preinfer
    from pipelines.cache import CacheOptions, cache_boundary
    from pipelines.cache.dask_runner import shutdown_local_clusters
    from pipelines.data.in_memory import TokenDataset, load_data
    from preinfer.presets import build_preset
    from pipelines.data.tokenizers import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer("byte")
    full = load_data(DATA, tokenizer, SEQ_LEN, "train", 0.1)
    n = len(full) if args.samples <= 0 else min(args.samples, len(full))
    data = TokenDataset(full.input_ids[:n], full.attention_mask[:n], full.labels[:n], full.source, "train")
    staged = preinfer.stage(build_preset(MODEL, 0).eval())
    tokens = data.num_tokens
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="preinfer-bench-cache-"))
    root.mkdir(parents=True, exist_ok=True)

    def forward() -> None:
        with torch.inference_mode():
            for a in range(0, n, args.batch_size):
                rows = data[a:a + args.batch_size]
                state = staged.embed(rows["input_ids"], rows["attention_mask"], rows["labels"])
                staged.run(state, 0, BOUNDARY)

    def job(store_format: str, dask=None):
        def run() -> None:
            out = root / f"{store_format}{'-dask' if dask else ''}"
            shutil.rmtree(out, ignore_errors=True)
            options = CacheOptions(store_format=store_format, batch_size=args.batch_size,
                                   samples_per_shard=args.samples_per_shard, progress=False, dask=dask,
                                   model_name=MODEL, mode="overwrite")
            result = cache_boundary(staged, {"train": data}, tokenizer, BOUNDARY, out, options)
            name = store_format if not dask else "dask"
            sizes[name] = result.splits["train"].stored_bytes
            parts.setdefault(name, []).append((result.forward_seconds, result.write_seconds, result.blocked_seconds))
        return run

    sizes: dict[str, int] = {}
    parts: dict[str, list[tuple[float, float, float]]] = {}
    variants = {"forward": forward, "zarr": job("zarr"), "safetensors": job("safetensors"),
                "dask": job("zarr", "local:2")}
    chosen = [v for v in args.variants.split(",") if v]
    started = time.perf_counter()
    if "dask" in chosen:
        warm = time.perf_counter()
        variants["dask"]()  # starts the cluster and loads the model in its workers
        dask_warmup_s = time.perf_counter() - warm
        parts.pop("dask")
    else:
        dask_warmup_s = None
    forward()  # warm-up (allocator, kernels)
    times: dict[str, list[float]] = {v: [] for v in chosen}
    for _ in range(args.repeats):
        for name in chosen:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    shutdown_local_clusters()
    base = statistics.median(times["forward"]) if "forward" in times else None
    best_base = min(times["forward"]) if "forward" in times else None
    rows = []
    for name in chosen:
        seconds = statistics.median(times[name])
        split = [statistics.median(p[k] for p in parts[name]) for k in range(3)] if name in parts else [0, 0, 0]
        rows.append({
            "variant": name, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ratio_to_forward": base / seconds if base else float("nan"),
            "best_ratio": best_base / min(times[name]) if best_base else float("nan"),
            "stored_MiB": sizes.get(name, 0) / 2**20,
            "forward_s": split[0], "write_s": split[1], "blocked_s": split[2],
            "runs": " ".join(f"{t:.1f}" for t in times[name]),
        })
    print(f"{MODEL}, boundary {BOUNDARY}, {n} samples x {SEQ_LEN} tokens ({tokens:,} tokens), batch "
          f"{args.batch_size}, {args.samples_per_shard} samples/shard, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(table(rows, ["variant", "seconds", "tokens_per_s", "ratio_to_forward", "best_ratio", "stored_MiB",
                       "forward_s", "write_s", "blocked_s", "runs"]))
    print("seconds: median wall time; ratio_to_forward: median (a) / median (this); best_ratio: fastest (a) / fastest "
          "(this); forward_s / write_s: time in the forward / in writing, summed over shards (Dask: over tasks on "
          "all workers); blocked_s: the forward waiting on a full write queue")
    if dask_warmup_s is not None:
        print(f"dask warm-up (cluster start + model load in 2 workers + one job): {dask_warmup_s:.1f} s")
    path = write_json("cache", {
        "model": MODEL, "boundary": BOUNDARY, "seq_len": SEQ_LEN, "data": DATA, "samples": n, "tokens": tokens,
        "batch_size": args.batch_size, "samples_per_shard": args.samples_per_shard, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
        "platform": platform.platform(), "torch": torch.__version__, "rows": rows, "times": times,
        "dask_warmup_s": dask_warmup_s, "wall_s": time.perf_counter() - started,
        "target": "(b) zarr / (a) forward >= 0.9",
    })
    print(f"wrote {path}")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
