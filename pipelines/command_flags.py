"""The flags that set no config key: those several commands share (`SHARED_FLAGS`) and each command's own
(`COMMAND_FLAGS`); and `FLAGS`, every shared flag by name. Torch-free at import."""

from __future__ import annotations

from preinfer.config import BlockConfig
from preinfer.memory.settings import DTYPES, GPUS, Settings
from preinfer.memory.traffic import COMPRESSION, STORE_DTYPES
from pipelines.flag_table import (
    ON, PRE_INFERENCE_FLAGS, STORE, STORE_FLAGS, TRAINING_FLAGS, CORPUS, Flag,
)
from pipelines.flag_types import (
    local_directory, non_negative_int, positive_float, positive_int, store_location, token_count, unit_fraction,
)


# Flags of several commands that set no config field.
SHARED_FLAGS: list[Flag] = [
    Flag("--config", help="a TOML config file; flags override its values"),
    Flag("--resume", help="continue the run in --out from its last checkpoint with its own config.toml; flags may "
                          "change only --checkpoint-every, --device, --token-store, --dask and (to train on) --sweeps, "
                          "each recorded in metrics.jsonl", options=ON),
    Flag("--s3-endpoint", help="S3-compatible endpoint of s3:// stores, e.g. http://127.0.0.1:9000 (sets "
                               "AWS_ENDPOINT_URL_S3)", options=dict(metavar="URL"),
         unset="AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS"),
    Flag("path", help=STORE, options=dict(metavar="STORE", type=store_location)),
    Flag("--quiet", help="no progress bar", options=ON),
    Flag("--json", help="print the result as JSON instead of text", options=ON),
]


def _prices() -> str:
    """The GPU table's prices as one phrase."""
    return ", ".join(f"{name} ${gpu['price']:.2f}" for name, gpu in GPUS.items() if gpu["price"] is not None)


# Flags of one command (its meaning of a name other commands use differently, too). Defaults that are a job's
# options (CacheOptions, TokenizeOptions) come from the command, which imports the job.
COMMAND_FLAGS: dict[str, list[Flag]] = {
    "cache": [
        Flag("--boundary", help="K in [1, layers]: store the input of layer K (embedding and layers [0, K) are run)",
             options=dict(type=int, required=True)),
        Flag("--out", help="cache directory: one store per split in OUT/<split>/ and an index OUT/cache.json; a "
                           "local path or s3://BUCKET/PATH", options=dict(type=store_location, required=True)),
        Flag("--splits", help="comma-separated splits to cache"),
        Flag("--from-store", help="roll forward: run only layers [K, --boundary) over the cache (or store) at "
                                  "boundary K", options=dict(metavar="STORE_K", type=store_location)),
        Flag("--codec", help="zarr codec: blosc-zstd, blosc-lz4, zstd, none", unset="blosc-zstd; none for safetensors"),
        Flag("--samples-per-shard", help="samples per shard (the unit of writing, resuming and Dask tasks)",
             options=dict(type=positive_int), unset="about 64 MiB of hidden states per shard, at least 1"),
        Flag("--workers", help="1: one process, writing overlapped with compute; N > 1 is --dask local:N",
             options=dict(type=positive_int), default=1),
        Flag("--retries", help="times a failed shard is retried before the job gives up on it",
             options=dict(type=non_negative_int)),
        Flag("--resume", help="compute only the shards missing from the store at --out (the default)", options=ON),
        Flag("--overwrite", help="replace a store with another fingerprint (or layout) at --out", options=ON),
    ],
    "eval": [
        Flag("--split", help="the split to evaluate", options=dict(choices=["eval", "train"]), default="eval"),
    ],
    "verify": [
        Flag("--sample", help="samples per store to recompute and compare, chosen at random",
             options=dict(type=non_negative_int), default=8),
        Flag("--seed", help="seed of the sample choice", options=dict(type=int), default=0),
        Flag("--model-seed", "run", "seed", "initialisation seed of a preset", dict(type=int)),
    ],
    "tokenize": [
        Flag("--data", help=f"the corpus to tokenise: {CORPUS}"),
        Flag("--text-column", help="the field (.jsonl) or column (.parquet) that holds LM text"),
        Flag("--out", help="the token store's directory: OUT/train/ and OUT/eval/ (zarr stores) and "
                           "OUT/token-store.json", options=dict(required=True)),
        Flag("--workers", help="processes that tokenise; the store is the same for any number",
             options=dict(type=positive_int)),
        Flag("--samples-per-shard", help="samples per shard (the unit of writing, resuming and reading)",
             options=dict(type=positive_int), unset="about 4 MiB of ids"),
        Flag("--overwrite", help="replace a token store of another corpus or setting at --out (a resumable, "
                                 "unfinished one too); without it, an interrupted run of the same command resumes",
             options=ON),
    ],
    "plan": [
        Flag("--model", help="a preset (tiny-llama, small-llama, ...), a local model directory, a config.json, or a "
                             "size: 1.5b, 7b, 13b, 20b (standard shapes)", options=dict(required=True)),
        Flag("--arch", help="shape family for a size given to --model", options=dict(choices=["llama", "gpt2"]),
             default="llama"),
        Flag("--device", help="cuda: a GPU's memory (--gpu, --gpu-mem or --memory-budget) is the budget; cpu: the "
                              "run trains on this machine's CPU, its physical memory (or --memory-budget) is the "
                              "budget and the frozen weights' host masters count in it", options=dict(
                                  choices=["cuda", "cpu"]), default="cuda"),
        Flag("--gpu", help="GPU type: memory, peak FLOPs and default price", options=dict(choices=list(GPUS)),
             default=Settings.gpu),
        Flag("--gpu-mem", help="GPU memory in GB, overriding the --gpu table's",
             options=dict(type=positive_float, metavar="GB")),
        Flag("--micro-batch", help="sequences per micro-batch step", options=dict(type=positive_int),
             default=Settings.micro_batch),
        Flag("--ufp", help="unfrozen parameter fraction per visit, e.g. 1/3 or 0.25: ceil(1/UFP) blocks",
             options=dict(type=unit_fraction), default=BlockConfig.ufp),
        Flag("--dtype", help="float32; bf16-mixed (bf16 weights, 2 bytes/parameter; the trainable parameters' "
                             "float32 masters, gradients and Adam moments, 16 bytes more, as the trainer holds "
                             "them); bf16 (everything bf16)", options=dict(choices=list(DTYPES)),
             default=Settings.dtype),
        Flag("--recompute", help="activation recomputation for the BCD rows (the full-Adam row is shown both ways)",
             options=ON),
        Flag("--tokens", help="dataset / training token budget, e.g. 1e9: store size on disk, transfer times and "
                              "cost", options=dict(type=token_count)),
        Flag("--bandwidth-gbps", help="link bandwidth in Gbit/s for the traffic comparisons (a pipeline's stages; "
                                      "--nodes' data-parallel replicas, one link each)",
             options=dict(type=positive_float), default=Settings.bandwidth_gbps),
        Flag("--nodes", help="data-parallel replicas: price each --dp-sync mode's seconds per step against the "
                             "step's compute, and the scaling efficiency", options=dict(type=positive_int),
             default=Settings.nodes),
        Flag("--pipeline", help="pipeline degree for the traffic comparison", options=dict(type=positive_int),
             unset="the plan's own, at least 2"),
        Flag("--store-dtype", help="storage dtype of boundary states; float8_e4m3, float8_e5m2, int8: 8-bit codes "
                                   "plus a float32 scale per token", options=dict(choices=list(STORE_DTYPES)),
             unset="float32 when training in float32, else bfloat16"),
        Flag("--compression", help="store codec ratio", options=dict(type=positive_float),
             unset=", ".join(f"{ratio:g} for {kind} stores" for kind, ratio in COMPRESSION.items())),
        Flag("--price-per-hour", help="GPU price per hour", options=dict(type=positive_float, metavar="USD"),
             unset=f"the paper's: {_prices()}"),
        Flag("--mfu", help="assumed model-FLOPs utilisation for the cost estimate", options=dict(type=unit_fraction),
             default=Settings.mfu),
    ],
    "demo": [
        Flag("--out", help="directory for the two run directories and demo.png; an earlier demo there is replaced",
             options=dict(type=local_directory), default="runs/demo"),
    ],
}

FLAGS: dict[str, Flag] = {flag.name: flag for flag in [*TRAINING_FLAGS, *PRE_INFERENCE_FLAGS, *STORE_FLAGS,
                                                       *SHARED_FLAGS]}
