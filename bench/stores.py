"""Benchmark of the activation stores on real activations: compression, write and read speed per backend/codec.

Hidden states of `small-llama` over byte-tokenised `pydoc_data.topics` (every layer's output is a sample), in
bfloat16 and float32. Each variant is written, then read back through the trainer's reader (shuffled, prefetching),
and compared with a raw safetensors write/read (`save_file` + fsync per shard; `load` of each file's bytes) of the same
bytes in the same run; each cold read of a variant is paired with a raw read just before it (the cores are shared).
Reads are cold (page cache dropped) when the OS allows it. Prints a table, writes bench/out/storage.json.

With --trained RUN_DIR instead: the states of a trained BCD run (its train split) at --boundaries, cached by the
caching job in every store dtype (float32, bfloat16, float8_e4m3, float8_e5m2, int8; zarr, blosc-zstd): disk size
against the bfloat16 store, the decoding error against the float32 states, the entropy of the stored values
(bits per value; sign, exponent, mantissa; given the channel) with other codecs and layouts, and how a
roll-forward from a lossy store compounds the error (bench/out/storage_lossy.json).

    python -m bench.stores [--sequences 256] [--repeats 3] [--threads 2]
    python -m bench.stores --trained runs/trained [--boundaries 2,4]
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

import numpy as np
import numcodecs
import safetensors.torch
import torch
import zarr

from bench.lib.common import median_seconds, table, write_json
from bench.lib.trained import cache_split, trained_model
from storage import Fingerprint, create_store, open_store

VARIANTS = [("zarr", "blosc-zstd"), ("zarr", "zstd"), ("zarr", "none"), ("safetensors", "none")]
SEQ_LEN = 256


def activations(sequences: int, seed: int = 0) -> torch.Tensor:
    """Float32 hidden states [sequences * layers, SEQ_LEN, hidden] of small-llama over the default corpus."""
    from pydoc_data.topics import topics

    from preinfer.presets import build_preset

    text = "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    needed = sequences * SEQ_LEN
    text = (text * (needed // len(text) + 1))[:needed]
    tokens = torch.tensor(list(text), dtype=torch.long).view(sequences, SEQ_LEN)
    model = build_preset("small-llama", seed).eval()
    states = []
    with torch.inference_mode():
        for batch in tokens.split(16):
            hidden = model(input_ids=batch, output_hidden_states=True).hidden_states
            states.append(torch.cat(hidden[1:]))  # every decoder layer's output (not the embedding)
    return torch.cat(states)


def drop_caches() -> bool:
    """Flush and drop the OS page cache; False when not permitted (not root, or a container forbids it)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Case:
    """One dtype's data cut into shards, and the stores and raw files written from it."""

    def __init__(self, data: torch.Tensor, per_shard: int, root: pathlib.Path) -> None:
        self.data, self.per_shard, self.root = data, per_shard, root
        self.shards = [data[i : i + per_shard].contiguous() for i in range(0, len(data), per_shard)]
        self.nbytes = data.numel() * data.element_size()

    def write_raw(self) -> None:
        raw = self.root / "raw"
        shutil.rmtree(raw, ignore_errors=True)
        raw.mkdir(parents=True)
        for i, shard in enumerate(self.shards):
            path = raw / f"{i:06d}.safetensors"
            safetensors.torch.save_file({"hidden": shard}, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())

    def read_raw(self, seed: int) -> None:
        for i in np.random.default_rng(seed).permutation(len(self.shards)):
            safetensors.torch.load((self.root / "raw" / f"{i:06d}.safetensors").read_bytes())

    def write_store(self, backend: str, codec: str) -> None:
        store = create_store(
            self.root / f"{backend}-{codec}", fields={"hidden": (tuple(self.data.shape[1:]), self.data.dtype)},
            num_samples=len(self.data), samples_per_shard=self.per_shard, fingerprint=Fingerprint("bench"),
            format=backend, codec=codec, overwrite=True,
        )
        for i, shard in enumerate(self.shards):
            store.write_shard(i, {"hidden": shard})
        store.finalize()

    def read_store(self, backend: str, codec: str, batch_size: int, threads: int, seed: int) -> None:
        store = open_store(self.root / f"{backend}-{codec}")
        for _ in store.reader(batch_size, seed=seed, threads=threads, prefetch=4):
            pass

    def stored_bytes(self, name: str) -> int:
        return sum(p.stat().st_size for p in (self.root / name).rglob("*") if p.is_file())


# ---- lossy store dtypes on trained states (issue 14) -------------------------------------------------------------

STORE_DTYPES = ("float32", "bfloat16", "float8_e4m3", "float8_e5m2", "int8")
LOSSY = ("float8_e4m3", "float8_e5m2", "int8")


def hidden_states(path: pathlib.Path) -> torch.Tensor:
    """Every stored hidden state of a store, decoded into float32."""
    store = open_store(path)
    names = [name for name in store.fields if name in ("hidden", "hidden_scale")]
    return torch.cat([store.decode(store.read_shard(i, names), torch.float32)["hidden"]
                      for i in range(store.num_shards)])


def rel_rms(a: torch.Tensor, reference: torch.Tensor) -> float:
    """sqrt(sum((a - reference)^2) / sum(reference^2))."""
    return float((a.double() - reference.double()).square().sum().sqrt() / reference.double().square().sum().sqrt())


def entropy(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy in bits of each row of `counts` (histograms)."""
    p = counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=-1)


def byte_entropy(values: np.ndarray) -> tuple[float, float]:
    """(order-0 entropy, mean entropy given the channel) in bits of 8-bit `values` [tokens, channels]."""
    channels = values.shape[1]
    per_channel = np.bincount((np.arange(channels) * 256 + values).reshape(-1), minlength=256 * channels)
    per_channel = per_channel.reshape(channels, 256)
    return float(entropy(per_channel.sum(axis=0))), float(entropy(per_channel).mean())


def field_entropy(bits: np.ndarray, shift: int, width: int) -> tuple[float, float]:
    """byte_entropy of the bit field [shift, shift + width) of 8-bit `bits`."""
    return byte_entropy(((bits >> shift) & ((1 << width) - 1)).astype(np.uint8))


# codecs compared per shard of 64 samples: the default (blosc-zstd 1, byte shuffle, 1 MiB blocks) and alternatives
ENTROPY_CODECS = {
    "blosc-zstd": numcodecs.Blosc("zstd", 1, numcodecs.Blosc.SHUFFLE, 1 << 20),
    "blosc-zstd bitshuffle": numcodecs.Blosc("zstd", 1, numcodecs.Blosc.BITSHUFFLE, 1 << 20),
    "blosc-zstd level 9": numcodecs.Blosc("zstd", 9, numcodecs.Blosc.SHUFFLE, 1 << 20),
    "blosc-lz4hc": numcodecs.Blosc("lz4hc", 9, numcodecs.Blosc.SHUFFLE, 1 << 20),
}


def compressed_bits(values: np.ndarray, shard_rows: int) -> dict[str, float]:
    """Bits per value of `values` [tokens, channels] compressed shard by shard (`shard_rows` tokens) by each of
    ENTROPY_CODECS, and by blosc-zstd with each shard transposed to channel-major order (a channel's values
    together)."""
    shards = [values[i : i + shard_rows] for i in range(0, len(values), shard_rows)]
    out = {name: sum(len(codec.encode(a)) for a in shards) * 8 / values.size for name, codec in ENTROPY_CODECS.items()}
    transposed = sum(len(ENTROPY_CODECS["blosc-zstd"].encode(np.ascontiguousarray(a.T))) for a in shards)
    out["blosc-zstd channel-major"] = transposed * 8 / values.size
    return out


def code_entropy(states: torch.Tensor, per_shard: int = 64) -> list[dict]:
    """How many bits each stored value of `states` [samples, tokens, hidden] carries, per store dtype: the entropy
    of the stored bytes (order 0, and given the channel: what a coder that sees each channel apart could reach),
    of their sign, exponent and mantissa fields (float formats), and the bits per value of the default codec and
    of alternatives, shard by shard; the scale's bits per value (blosc-zstd) apart."""
    from storage import ENCODINGS

    hidden, shard_rows = states.shape[-1], per_shard * states.shape[-2]
    bf16 = states.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1, hidden)
    high, low = (bf16 >> 8).astype(np.uint8), (bf16 & 0xFF).astype(np.uint8)
    (h_high, c_high), (h_low, c_low) = byte_entropy(high), byte_entropy(low)
    exponent = byte_entropy(((bf16 >> 7) & 0xFF).astype(np.uint8))
    rows = [dict(dtype="bfloat16", h0=h_high + h_low, h_channel=c_high + c_low, scale_bits=0.0,
                 sign=field_entropy(high, 7, 1)[0], exponent=exponent[0], exponent_channel=exponent[1],
                 mantissa=field_entropy(low, 0, 7)[0], **compressed_bits(bf16, shard_rows))]
    for name, encoding in ENCODINGS.items():
        codes, scale = encoding.encode(states)
        bits = codes.contiguous().view(torch.uint8).numpy().reshape(-1, hidden)
        h0, h_channel = byte_entropy(bits)
        scale_bytes = sum(len(ENTROPY_CODECS["blosc-zstd"].encode(part.contiguous().numpy()))
                          for part in scale.split(per_shard))
        row = dict(dtype=name, h0=h0, h_channel=h_channel, scale_bits=scale_bytes * 8 / states.numel())
        if encoding.code_dtype.is_floating_point:
            mantissa = 3 if name == "float8_e4m3" else 2
            exponent = field_entropy(bits, mantissa, 7 - mantissa)
            row.update(sign=field_entropy(bits, 7, 1)[0], exponent=exponent[0], exponent_channel=exponent[1],
                       mantissa=field_entropy(bits, 0, mantissa)[0])
        rows.append({**row, **compressed_bits(bits, shard_rows)})
    return rows


def entropy_ratios(boundary: int, rows: list[dict]) -> list[dict]:
    """code_entropy's rows with the hidden states' bits per value (codes and scale) over bfloat16's under the
    default codec: as compressed (default_x_bf16), and the floor of a coder that reaches the codes' entropy given
    the channel (floor_x_bf16)."""
    bf16 = next(r for r in rows if r["dtype"] == "bfloat16")["blosc-zstd"]
    return [dict(boundary=boundary, **row, default_x_bf16=(row["blosc-zstd"] + row["scale_bits"]) / bf16,
                 floor_x_bf16=(row["h_channel"] + row["scale_bits"]) / bf16) for row in rows]


def lossy_sizes(run_dir: str, boundaries: list[int], root: pathlib.Path) -> dict:
    """Disk size (codecs blosc-zstd and none) and decoding error of every store dtype at each boundary, the
    entropy of the stored values (code_entropy); roll-forward error compounding."""
    staged, data = trained_model(run_dir)
    rows, rolls, entropies = [], [], []
    for k in boundaries:
        for codec in ("blosc-zstd", "none"):
            for dtype in STORE_DTYPES:
                name = f"{dtype}-{k}" if codec == "blosc-zstd" else f"{dtype}-{k}-{codec}"
                result = cache_split(staged, data, k, root / name, dtype, codec)
                store = open_store(root / name / "train")
                hidden = sum(rec["files"][key]["size"] for rec in store.manifest["shards"].values()
                             for key in rec["files"] if key.split("/")[1] in ("hidden", "hidden_scale"))
                rows.append(dict(boundary=k, codec=codec, dtype=dtype, store=name,
                                 train_MiB=result.splits["train"].stored_bytes / 2**20, hidden_MiB=hidden / 2**20,
                                 error=store.encoding_error().get("hidden")))
            bf16 = next(r for r in rows if (r["boundary"], r["codec"], r["dtype"]) == (k, codec, "bfloat16"))
            for row in rows[-len(STORE_DTYPES):]:
                row["x_bf16_store"] = row["train_MiB"] / bf16["train_MiB"]
                row["x_bf16_hidden"] = row["hidden_MiB"] / bf16["hidden_MiB"]
        reference = hidden_states(root / f"float32-{k}" / "train")
        entropies.extend(entropy_ratios(k, code_entropy(reference)))
        for row in entropies[-len(STORE_DTYPES) + 1:]:
            print(f"boundary {k} {row['dtype']}: {row['h0']:.2f} bits per code (given the channel "
                  f"{row['h_channel']:.2f}), blosc-zstd {row['blosc-zstd']:.2f} + scale {row['scale_bits']:.2f}; "
                  f"x bf16 {row['default_x_bf16']:.3f}, floor {row['floor_x_bf16']:.3f}", flush=True)
        for row in rows[-2 * len(STORE_DTYPES):]:
            row["rms_vs_float32"] = rel_rms(hidden_states(root / row["store"] / "train"), reference)
            print(table([row], ["boundary", "codec", "dtype", "train_MiB", "hidden_MiB", "x_bf16_store",
                                "x_bf16_hidden", "rms_vs_float32"]).splitlines()[-1], flush=True)
    low, high = boundaries[0], boundaries[-1]
    reference = hidden_states(root / f"float32-{high}" / "train")
    for dtype in LOSSY:
        cache_split(staged, data, high, root / f"{dtype}-roll-{high}", dtype, source=root / f"{dtype}-{low}")
        rolls.append(dict(dtype=dtype, source=low, boundary=high,
                          fresh_rms=rel_rms(hidden_states(root / f"{dtype}-{high}" / "train"), reference),
                          rolled_rms=rel_rms(hidden_states(root / f"{dtype}-roll-{high}" / "train"), reference)))
        rolls[-1]["compounding"] = rolls[-1]["rolled_rms"] / rolls[-1]["fresh_rms"]
        print(rolls[-1], flush=True)
    return dict(run_dir=run_dir, samples_per_shard=64, rows=rows, roll_forward=rolls, entropy=entropies,
                roll_forward_codec="blosc-zstd", train_samples=len(data.train), seq_len=data.train.seq_len,
                hidden_size=staged.hidden_size)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stores", description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256, help="sequences of 256 tokens (6 samples each)")
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="reader threads")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--trained", metavar="RUN_DIR",
                        help="instead: store dtypes (exact and lossy) on the states of this trained BCD run at "
                             "--boundaries; disk size against bfloat16, decoding error, roll-forward compounding")
    parser.add_argument("--boundaries", default="2,4", help="with --trained [2,4]")
    args = parser.parse_args()
    if args.trained:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="storage-bench-lossy-", dir=args.dir))
        try:
            result = lossy_sizes(args.trained, [int(b) for b in args.boundaries.split(",")], scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        print(f"wrote {write_json('storage_lossy', result)}")
        return

    # Concurrency: zarr decodes chunks on its thread pool; blosc itself stays single-threaded inside those threads.
    zarr.config.set({"async.concurrency": 64, "threading.max_workers": args.threads})
    numcodecs.blosc.set_nthreads(1)
    torch.set_num_threads(os.cpu_count() or 2)

    start = time.perf_counter()
    hidden = activations(args.sequences)
    print(f"activations: {tuple(hidden.shape)} float32 in {time.perf_counter() - start:.1f} s")
    cold = drop_caches()
    rows, scratch = [], pathlib.Path(tempfile.mkdtemp(prefix="storage-bench-", dir=args.dir))
    try:
        for dtype in (torch.bfloat16, torch.float32):
            case = Case(hidden.to(dtype), args.samples_per_shard, scratch / str(dtype).removeprefix("torch."))
            prep = drop_caches if cold else None
            raw_write = median_seconds(case.write_raw, args.repeats)
            raw_mb = case.nbytes / 1e6
            for backend, codec in VARIANTS:
                write = median_seconds(lambda: case.write_store(backend, codec), args.repeats)
                # Cold reads of the variant and of the raw files alternate, so that both see the same machine load
                # (other jobs share the cores); x_raw is the median of the per-pair ratios.
                raw_reads, reads = [], []
                for _ in range(args.repeats):
                    raw_reads.append(median_seconds(lambda: case.read_raw(seed=1), 1, prep))
                    reads.append(median_seconds(
                        lambda: case.read_store(backend, codec, args.batch_size, args.threads, seed=1), 1, prep
                    ))
                raw_read, read = statistics.median(raw_reads), statistics.median(reads)
                warm = median_seconds(
                    lambda: case.read_store(backend, codec, args.batch_size, args.threads, seed=1), args.repeats
                )
                rows.append({
                    "dtype": str(dtype).removeprefix("torch."), "backend": backend, "codec": codec, "MB": raw_mb,
                    "ratio": case.nbytes / case.stored_bytes(f"{backend}-{codec}"),
                    "write_MB/s": raw_mb / write, "write_x_raw": raw_write / write,
                    "read_MB/s": raw_mb / read,
                    "read_x_raw": statistics.median(r / v for r, v in zip(raw_reads, reads)),
                    "warm_read_MB/s": raw_mb / warm, "raw_write_MB/s": raw_mb / raw_write,
                    "raw_read_MB/s": raw_mb / raw_read,
                })
                print(table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    columns = ["dtype", "backend", "codec", "MB", "ratio", "write_MB/s", "write_x_raw", "read_MB/s", "read_x_raw",
               "warm_read_MB/s", "raw_write_MB/s", "raw_read_MB/s"]
    print(table(rows, columns))
    print(f"cold reads (page cache dropped): {cold}; medians of {args.repeats} runs; reader threads {args.threads}")
    path = write_json("storage", {
        "rows": rows, "cold_reads": cold, "repeats": args.repeats, "threads": args.threads,
        "samples": len(hidden), "sample_shape": list(hidden.shape[1:]), "samples_per_shard": args.samples_per_shard,
        "batch_size": args.batch_size, "cpus": os.cpu_count(), "platform": platform.platform(),
        "versions": {"torch": torch.__version__, "zarr": zarr.__version__, "numcodecs": numcodecs.__version__},
        "medians": "each speed is total bytes / median time; write_x_raw = raw time / variant time (same run); read_x_raw = median over repeats of raw cold read time / variant cold read time, the two read back to back",
        "raw": "safetensors.torch.save_file + fsync per shard; safetensors.torch.load(file bytes) per shard in shuffled order (load_file alone maps the file lazily and reads nothing)",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
