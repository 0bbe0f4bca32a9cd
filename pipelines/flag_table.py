"""The flags that set a config key, defined once: `Flag` (its name, the `[section] key` it sets, whose default
`--help` shows and, for an enumerated key, whose choices it takes from the key's type) and the tables of `bcd` and
`train`. Torch-free at import, so that `preinfer plan` loads without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from preinfer.config import (
    DEFAULT_EPOCHS_PER_VISIT, DEFAULT_LR, DEFAULT_WEIGHT_DECAY, EXPERT_PARTS, TRACKERS, Config,
)
from preinfer.config.choices import choices_of, field_hint, is_names
from preinfer.memory.settings import GPUS, USABLE_FRACTION
from pipelines.flag_types import (
    device, float_pair, local_directory, memory_size, non_negative_int, positive_float, positive_int,
    store_location,
)


def shown(value: Any) -> str:
    """A default as --help writes it: floats without trailing zeros, lists as the flag takes them (0.9,0.95)."""
    if isinstance(value, list):
        return ",".join(shown(v) for v in value)
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Flag:
    """One flag: a training flag sets `[section] key` of the config, whose default its `--help` shows; any other
    flag has its own `default`. `unset` says what a default of None means, where --help should say it."""

    name: str  # --seq-len, or a positional's name
    section: str | None = None
    key: str | None = None
    help: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # argparse keywords: type, choices, action, metavar
    unset: str | None = None
    default: Any = None  # the value of a flag that sets no config field, unless the command gives its own

    def __post_init__(self) -> None:
        """A flag of an enumerated config key takes its choices from the key's type."""
        if self.section is not None and "choices" not in self.options:
            hint = field_hint(type(getattr(Config(), self.section)), self.key)
            if choices_of(hint) and not is_names(hint):
                object.__setattr__(self, "options", {**self.options, "choices": list(choices_of(hint))})

    def config_default(self) -> Any:
        """The config dataclass's default."""
        return getattr(getattr(Config(), self.section), self.key)

    def default_text(self, value: Any) -> str | None:
        """A default as --help shows it: nothing for a switch that is off, `unset` for None."""
        if value is None or value is False:
            return self.unset
        return shown(value)

    def help_text(self, default: str | None, note: str = "") -> str:
        """The help, a note, then the default as [default]."""
        text = f"{self.help}{note}"
        return text if default is None else f"{text} [{default.replace('%', '%%')}]"

    def add_to(self, parser: Any, text: str, *names: str, **options: Any) -> None:
        """Add the flag with help `text` (under `names` too) to a parser or a group of one."""
        options = {**self.options, **options}
        if self.name.startswith("-") and "action" not in options and "choices" not in options:
            options.setdefault("metavar", self.name.lstrip("-").upper().replace("-", "_"))
        parser.add_argument(self.name, *names, help=text, **options)


def per_optimizer(defaults: dict[str, float]) -> str:
    """A per-optimizer default table as one phrase: 'sgd 0.1, adam 5e-05, adamw 5e-05'."""
    return ", ".join(f"{name} {shown(value)}" for name, value in defaults.items())


SWITCH = dict(action="store_const", const=True)
ON = dict(action="store_true")

CORPUS = ("a .txt, .jsonl (either also .gz or .zst), .parquet or .arrow file, a directory or quoted glob of them "
          "(a datasets save_to_disk folder or a local dataset repository too), or builtin:pydoc")
STORE = "a cache directory (all its splits) or a single store: a local path or s3://BUCKET/PATH"
TRAINING_FLAGS: list[Flag] = [
    Flag("--model", "model", "name", "a preset (tiny-gpt2, tiny-llama, small-llama, medium-llama, tiny-moe), a "
                                     "save_pretrained directory, or a run directory (its current weights)"),
    Flag("--tokenizer", "model", "tokenizer", "auto: the model directory's own tokenizer (the run's for a run "
                                              "directory, the byte tokenizer for a preset); 'byte' (built-in); or a "
                                              "local HF tokenizer directory"),
    Flag("--chat-template", "model", "chat_template", "a file whose Jinja chat template renders chat and instruction "
                                                      "data instead of the tokenizer's own", unset="the tokenizer's"),
    Flag("--chat-template-name", "model", "chat_template_name",
         "which of the tokenizer's own named chat templates (tokenizer_config.json's list of {name, template}) renders "
         "chat data; a --chat-template file's are named FILE#NAME", unset="default, or the only one"),
    Flag("--attention", "model", "attention",
         "attention implementation: sdpa (PyTorch's scaled_dot_product_attention; on CUDA its flash and "
         "memory-efficient kernels, which keep no [T, T] attention probabilities for backward) or eager; the "
         "planner prices each, and a store records the one it was made with"),
    Flag("--stream-frozen", "model", "stream_frozen",
         "keep the frozen decoder layers in host memory (their codes under --frozen-dtype, else their weights; "
         "pinned on CUDA) and copy each to the device only while it computes, the next one copied on a side "
         "stream meanwhile: at most two frozen layers on the device (the model is loaded in host memory and never "
         "placed on the device whole). Each step runs its micro-batches layer-major "
         "(one copy serves them all, their activations held together), bit-identical to a resident run; one "
         "process, no --experts", SWITCH),
    Flag("--frozen-dtype", "model", "frozen_dtype",
         "how the linear weights of the decoder layers outside the active block are held for their forward: auto "
         "(the resident dtype, as today), bf16, int8 (per row) or nf4 (torchao, pip install preinfer[quant]); each "
         "block keeps an exact master in host memory, restored for its visit, and checkpoints, exports and stores "
         "are made from the masters"),
    Flag("--masters", "model", "masters",
         "where the masters live: host (memory) or disk, memory-mapped from safetensors files, never read whole into "
         "memory: the model directory's (never written) until a block has trained, then the run's own (masters/ in "
         "the run directory, each written crash-safe at its visit's end); a checkpoint then holds only what the "
         "files do not, and the export is written tensor by tensor. disk needs a save_pretrained directory as "
         "--model, one process (on a GPU, with --stream-frozen) and no --expand"),
    Flag("--data", "data", "path", f"a corpus: {CORPUS}; or a token store written by preinfer tokenize"),
    Flag("--dataset-split", "data", "dataset_split",
         "the split of a dataset folder or repository that --data reads (train, validation, test or another it names "
         "in its files); a corpus without splits is its train split. Not --split, which is a token store's train or "
         "eval share"),
    Flag("--skip-unrenderable", "data", "skip_unrenderable",
         "skip the conversations the chat template cannot render (counted in the token store and the run's first "
         "lines) instead of refusing the data at the first one", SWITCH),
    Flag("--token-store", "data", "token_store", "where a corpus is tokenised once (one directory per corpus, "
                                                 "tokenizer and settings) and read lazily by every job",
         unset="$XDG_CACHE_HOME/preinfer/tokens"),
    Flag("--seq-len", "data", "seq_len", "tokens per sample", dict(type=positive_int)),
    Flag("--batch-size", "data", "batch_size", "samples per batch (in training, per micro-batch)",
         dict(type=positive_int)),
    Flag("--eval-fraction", "data", "eval_fraction", "share of documents held out", dict(type=float)),
    Flag("--eval-tokens", "data", "eval_tokens", "evaluate on the first samples of the eval split holding this many "
                                                 "tokens, the same every visit; 0 = the whole split",
         dict(type=non_negative_int)),
    Flag("--max-samples", "data", "max_samples", "use only the first N samples of each split; 0 = all",
         dict(type=non_negative_int)),
    Flag("--samples-per-shard", "data", "samples_per_shard",
         "samples per store shard, which also shapes the sample order; 0 = about 64 MiB of boundary states",
         dict(type=non_negative_int)),
    Flag("--ufp", "blocks", "ufp", "unfrozen parameter fraction per block, e.g. 1/3; auto: the fewest visits whose "
                                   "every one fits --memory-budget (or --gpu), the embedding and head inside the "
                                   "first and last block or apart, by the planner of `preinfer plan`"),
    Flag("--memory-budget", "blocks", "memory_budget",
         "the memory each visit may fill, e.g. 22GiB, 512MiB, 24GB (10^9 bytes) or 1.5e9, instead of the GPU's "
         "usable memory: the automatic UFP (bcd --ufp auto, plan) is the fewest blocks that fit it",
         dict(type=memory_size, metavar="SIZE")),
    Flag("--gpu", "blocks", "gpu", f"with --ufp auto: the budget is this GPU's usable memory in the planner "
                                   f"({USABLE_FRACTION:.0%}% of its own, as `preinfer plan --gpu`)",
         dict(choices=list(GPUS))),
    Flag("--blocks", "blocks", "blocks", "number of blocks (instead of --ufp)", dict(type=positive_int)),
    Flag("--ranges", "blocks", "ranges", "explicit inclusive layer ranges, e.g. 0-3,4-7"),
    Flag("--separate-ends", "blocks", "separate_ends", "embedding and head form blocks of their own (with --ufp "
                                                       "auto too; without it auto chooses where they go)", SWITCH),
    Flag("--active", "blocks", "active",
         "train only this inclusive layer range as one block, e.g. 4-5; every other layer stays frozen"),
    Flag("--order", "blocks", "order", "block order within a sweep; importance: at each sweep's start, score every "
         "block by its gradient norm per parameter and visit those scoring at least the mean (and those "
         "--importance-floor makes due) in descending score; importance-cached: the same blocks in ascending order "
         "(stores rolled forward) unless their scores spread by more than --importance-margin"),
    Flag("--fixed-order", "blocks", "fixed_order", "block order for --order fixed, e.g. 2,0,1"),
    Flag("--start-block", "blocks", "start_block", "block each sweep begins with", dict(type=non_negative_int),
         unset="the order's first"),
    Flag("--sweeps", "blocks", "sweeps", "passes over all blocks", dict(type=positive_int)),
    Flag("--importance-batches", "blocks", "importance_batches", "importance orders: training batches (the first, "
         "in stored order) whose gradients score the blocks at each sweep's start", dict(type=positive_int)),
    Flag("--importance-floor", "blocks", "importance_floor", "importance orders: every block is visited at least "
         "once in any this many consecutive sweeps (1: every block every sweep, in score order)",
         dict(type=positive_int)),
    Flag("--importance-margin", "blocks", "importance_margin", "importance-cached: keep the ascending order unless "
         "the visited blocks' scores spread, (max - min) / max, by more than this", dict(type=float)),
    Flag("--experts", "blocks", "experts", "expert-granular blocks (mixture of experts): top:SHARE trains, in each "
         "sparse layer of a block, the fewest experts carrying SHARE of its routed tokens (ESFT)"),
    Flag("--experts-with", "blocks", "experts_with", f"what trains with the chosen experts: a comma list of "
         f"{', '.join(EXPERT_PARTS)} (rest: norms, dense MLPs, embedding, head), or none"),
    Flag("--experts-sample", "blocks", "experts_sample", "training batches whose routing picks the experts",
         dict(type=positive_int)),
    Flag("--expand", "blocks", "expand", "landscape expansion: each step also updates the decoder layers above the "
         "active block from the gradients its backward computes; lowrank: rank --expand-rank factors on their "
         "linear weights, stepped by the visit's optimizer and merged when the visit ends; sgd: a plain SGD step "
         "on their weights (under --frozen-dtype, on the masters of the codes); auto: lowrank where it runs (a dense "
         "model's BCD run without --active, --experts or --keep-optimizer-state; a pipeline's stages too), else "
         "none"),
    Flag("--expand-rank", "blocks", "expand_rank", "--expand lowrank: the factors' rank", dict(type=positive_int)),
    Flag("--expand-lr", "blocks", "expand_lr", "--expand: the expansion's rate (lowrank: the factors' rate in the "
         "visit's optimizer, on its schedule; sgd: the SGD step's)", dict(type=positive_float),
         unset="the visit's rate"),
    Flag("--optimizer", "optim", "name", "optimizer"),
    Flag("--lr", "optim", "lr", "learning rate", dict(type=positive_float), unset=per_optimizer(DEFAULT_LR)),
    Flag("--betas", "optim", "betas", "Adam betas", dict(type=float_pair)),
    Flag("--momentum", "optim", "momentum", "SGD momentum", dict(type=float)),
    Flag("--weight-decay", "optim", "weight_decay", "weight decay", dict(type=float),
         unset=per_optimizer(DEFAULT_WEIGHT_DECAY)),
    Flag("--warmup-steps", "optim", "warmup_steps", "linear warmup per visit (step 0 at 1/warmup of the rate)",
         dict(type=non_negative_int)),
    Flag("--warmup-ratio", "optim", "warmup_ratio", "instead of --warmup-steps: warmup over this share of each "
         "visit's steps, rounded up", dict(type=float)),
    Flag("--lr-decay", "optim", "decay", "the schedule after warmup, transformers.get_scheduler's by name (none: "
         "constant_with_warmup); linear and cosine fall to 0 at each visit's last step"),
    Flag("--grad-clip", "optim", "grad_clip", "max gradient norm; 0 = off", dict(type=float)),
    Flag("--grad-accum", "optim", "grad_accum", "micro-batches per step", dict(type=positive_int)),
    Flag("--keep-optimizer-state", "optim", "keep_state",
         "keep each block's optimizer state between its visits, in host memory (the device holds the active "
         "block's only; host memory holds every other block's: 2x the model's weights in fp32 for Adam, about a "
         "quarter of that for adam8bit/adamw8bit) instead of dropping it after each visit; its step count goes on, "
         "so bias correction does not restart", SWITCH),
    Flag("--fused-step", "optim", "fused_step", "step each tensor in backward as soon as its gradient is complete "
         "and free that gradient at once (no step's gradients all resident; data-parallel replicas step each tensor "
         "once its sum is back; refused with --grad-clip, fp16-mixed and a pipeline's replicas)", SWITCH),
    Flag("--block-lr", "optim", "block_lr", "per-block learning rates as factors of --lr: depth:LO..HI (linear in "
         "the block's index, LO at the first block, HI at the last) or a comma list of factors, one per block"),
    Flag("--steps-per-visit", "stop", "steps_per_visit", "step budget per visit", dict(type=positive_int)),
    Flag("--epochs-per-visit", "stop", "epochs_per_visit", "epoch budget per visit (one caching pass serves them "
         "all)", dict(type=positive_float),
         unset=f"{shown(DEFAULT_EPOCHS_PER_VISIT)} when no other stopping rule is given"),
    Flag("--patience", "stop", "patience", "plateau rule: steps without improvement", dict(type=positive_int)),
    Flag("--min-delta", "stop", "min_delta", "plateau rule: improvement that counts", dict(type=float)),
    Flag("--stop", "stop", "rule", "budget: a visit ends at its step or epoch budget or plateau; gain: also when its "
         "recent loss decrease per second falls below the best predicted for another block (its score over the "
         "active block's, times the active block's initial rate, less its switching cost); needs an importance "
         "order"),
    Flag("--gain-window", "stop", "gain_window", "gain rule: the loss decrease per second is taken over the last 2 x "
         "this many steps", dict(type=positive_int)),
    Flag("--total-steps", "stop", "total_steps", "the run's step budget: it ends once this many optimizer steps are "
         "done, the visit under way ending there (evaluated and recorded, stop reason total-steps), even mid-sweep; "
         "the run also ends after --sweeps", dict(type=positive_int)),
    Flag("--out", "run", "out", "run directory (local)", dict(type=local_directory)),
    Flag("--mode", "run", "mode", "bcd, or full-parameter training"),
    Flag("--seed", "run", "seed", "seed of a preset's initialisation, and of a run's data and block "
         "order", dict(type=int)),
    Flag("--checkpoint-every", "run", "checkpoint_every", "steps between checkpoints; 0 = after every visit",
         dict(type=non_negative_int)),
    Flag("--device", "run", "device", "cpu, cuda, cuda:1 ...; with --dask local:N and a bare cuda, worker i takes GPU "
                                      "i mod the visible GPUs", dict(type=device)),
    Flag("--precision", "run", "precision",
         "fp32, or every weight in 16 bits with fp32 masters, gradients and optimizer state for the active block "
         "only (fp16-mixed adds dynamic loss scaling); auto follows the model's weights"),
    Flag("--recompute", "run", "recompute",
         "activation checkpointing: every layer in the gradient path (the active block and the frozen layers "
         "above it) keeps only its input and runs its forward again in backward: less activation memory, a "
         "second forward of those layers", SWITCH),
    Flag("--offload", "run", "offload",
         "with --recompute: the hidden state each layer keeps for backward goes to host memory (pinned on CUDA) "
         "and comes back when backward runs the layer again: device memory for long sequences, a copy each way",
         SWITCH),
    Flag("--skip-memory-check", "run", "skip_memory_check",
         "run even where the planner's figure for the largest visit (preinfer plan's bcd live row for the same "
         "flags) is above the memory the device has: the host's MemAvailable on the CPU, the card's free memory on "
         "CUDA (checked before the model loads)", SWITCH),
    Flag("--loss", "run", "loss",
         "the next-token loss: chunked computes the head's logits --loss-chunk tokens at a time, in forward and "
         "again in backward, so the [tokens, vocab] logits never exist at once (equal to plain to rounding); "
         "auto is chunked wherever the model's head is one linear map (every family but those "
         "docs/precision-and-memory.md names), else plain; liger: Liger Kernel's fused linear cross entropy "
         "(CUDA, pip install 'preinfer[liger]')"),
    Flag("--loss-chunk", "run", "loss_chunk", "tokens per chunk of the chunked loss", dict(type=positive_int)),
    Flag("--pipeline", "run", "pipeline", "pipeline stages: under torchrun with N x D processes, D data-parallel "
         "replicas of an N-stage pipeline; each rank holds only its stage's layers", dict(type=positive_int)),
    Flag("--microbatches", "run", "microbatches", "micro-batches each --batch-size batch is split into on a "
         "pipeline; must divide it", dict(type=positive_int), unset="as many as --pipeline stages"),
    Flag("--pipeline-schedule", "run", "pipeline_schedule", "pipeline schedule (torch.distributed.pipelining)"),
    Flag("--dp-sync", "run", "dp_sync", "how data-parallel replicas agree: step (the active block's gradients "
         "summed at every step), visit (each replica trains the block on its own shard for the whole visit, then "
         "the replicas average it: the block's bytes once a visit), every:N (averaged every N steps of a visit "
         "and at its end)", dict(metavar="{step,visit,every:N}")),
    Flag("--outer-lr", "run", "outer_lr", "visit, every:N: the outer step's rate along the replicas' mean change "
         "(1 with --outer-momentum 0: the plain average; DiLoCo's: 0.7)", dict(type=positive_float)),
    Flag("--outer-momentum", "run", "outer_momentum", "visit, every:N: the outer step's Nesterov momentum, in "
         "[0, 1) (DiLoCo's: 0.9)", dict(type=float)),
    Flag("--grad-compression", "run", "grad_compression", "--dp-sync step: how the replicas sum the gradients: "
         "none (fp32), bf16 (half the bytes), powersgd:R[:W] (PowerSGD's rank-R factors with error feedback; the "
         "first W steps of each visit summed uncompressed, torch's start_powerSGD_iter, 0 by default)",
         dict(metavar="{none,bf16,powersgd:R[:W]}")),
    Flag("--report-to", "run", "report_to", f"experiment trackers the run's records go to (rank 0): a comma list of "
         f"{', '.join(TRACKERS)}, offline by default (event files, W&B offline, an MLflow file store in --out); "
         f"each needs its extra, pip install 'preinfer[tensorboard]'"),
]

# Flags of `bcd` only: where visits above the input get their boundary states.
PRE_INFERENCE_FLAGS: list[Flag] = [
    Flag("--pre-inference", "pre_inference", "mode",
         "train blocks above the input from stores of boundary states: on; never: off; auto plans each sweep "
         "(stores built, rolled forward, read; peak disk) against running it live, with measured throughputs, and "
         "reads stores when they are predicted to save more than 2%%"),
    Flag("--store-dir", "pre_inference", "store_dir", "where the run keeps its stores: a local path or "
         "s3://BUCKET/PATH", dict(type=store_location), unset="<out>/stores"),
    Flag("--store-format", "pre_inference", "store_format", "store format"),
    Flag("--store-dtype", "pre_inference", "store_dtype", "storage dtype of hidden states; auto = the compute dtype, "
         "bit-exact; float8_e4m3, float8_e5m2, int8: lossy 8-bit codes with a per-token scale, decoding error "
         "measured per shard"),
    Flag("--keep-stores", "pre_inference", "keep_stores", "keep stores that are no longer usable", SWITCH),
    Flag("--dask", "pre_inference", "dask",
         "build stores on Dask: local:N (a LocalCluster of N worker processes, one Dask thread and cores/N torch "
         "threads each) or tcp://HOST:PORT (an existing scheduler; not under torchrun)"),
]

# Flags of `train` only: the cache it trains from.
STORE_FLAGS: list[Flag] = [
    Flag("--store", "store", "path", "cache directory written by `preinfer cache` (its train and eval stores); "
                                     "its boundary K is where the trained suffix begins; a local path or "
                                     "s3://BUCKET/PATH", dict(metavar="CACHE", type=store_location)),
    Flag("--trust-store", "store", "trust", "use the store even if the model's weights below K differ from the "
                                            "ones it was made from", SWITCH),
]
