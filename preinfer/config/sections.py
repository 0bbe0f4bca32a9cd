"""The run configuration's sections, one typed dataclass each; `Config` holds them and validates itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from preinfer.config.choices import (
    DEFAULT_ATTENTION, DEFAULT_LOSS_CHUNK, DEFAULT_LR, DEFAULT_WEIGHT_DECAY, Attention, BlockOrder, Expand,
    ExpertPart, FrozenDtype, Loss, LrDecay, Masters, Mode, Names, Optimizer, PipelineSchedule, PreInferenceMode,
    Precision, StopRuleName, StoreDtype, StoreFormat, Tracker,
)
from preinfer.config.rules import Naming, check
from preinfer.sizes import parse_size



def comma_list(default: str | None) -> Any:
    """A key holding a comma list: TOML (and the HF arguments) may write it as a list, `[1, 0.5]` for "1,0.5"."""
    return field(default=default, metadata={"comma_list": True})


@dataclass
class ModelConfig:
    name: str = "small-llama"  # a preset, a save_pretrained directory, or a run directory
    tokenizer: str = "auto"  # auto (the model's own; byte for a preset), byte, or a local HF tokenizer directory
    chat_template: str | None = None  # a file whose Jinja chat template replaces the tokenizer's own
    attention: Attention = DEFAULT_ATTENTION  # the attention implementation every job runs the model with
    stream_frozen: bool = False  # frozen layers in host memory, each copied to the device only while it computes
    frozen_dtype: FrozenDtype = "auto"  # frozen decoder layers' linear weights for their forward; masters stay exact
    chat_template_name: str | None = None  # which of the tokenizer's named chat templates renders; None: default
    masters: Masters = "host"  # host memory, or disk: memory-mapped from the model's and the run's safetensors files


@dataclass
class DataConfig:
    path: str = "builtin:pydoc"  # a corpus (file, directory, glob or builtin:pydoc) or a `preinfer tokenize` output
    seq_len: int = 128  # tokens per sample
    batch_size: int = 8  # samples per micro-batch
    eval_fraction: float = 0.1  # share of documents held out for evaluation
    eval_tokens: int = 262144  # evaluate on the eval split's first samples holding this many tokens; 0: all
    token_store: str | None = None  # where corpora are tokenised once and kept; None: $XDG_CACHE_HOME/preinfer/tokens
    max_samples: int = 0  # use only the first N samples of each split; 0: all
    samples_per_shard: int = 0  # shard size of stores, which also shapes the sample order; 0: ~64 MiB of states
    # the split of a dataset folder or repository that is read (train, validation, test, ...; a corpus without
    # splits is its train split), and whether conversations the chat template cannot render are skipped (counted)
    dataset_split: str = "train"
    skip_unrenderable: bool = False


@dataclass
class BlockConfig:
    ufp: str | None = "1/3"  # unfrozen parameter fraction per block ("auto": the fewest blocks that fit the budget)
    # with ufp = "auto": bytes a visit may fill; the config file may write a size, e.g. "22GiB" or 1.5e9
    memory_budget: int | None = field(default=None, metadata={"parse": parse_size})
    gpu: str | None = None  # with ufp = "auto": the budget is this GPU's usable memory in the planner (4090, ...)
    blocks: int | None = None  # number of blocks (instead of ufp)
    ranges: str | None = comma_list(None)  # explicit inclusive layer ranges, e.g. "0-3,4-7" (instead of ufp)
    separate_ends: bool = False  # embedding and head as blocks of their own
    order: BlockOrder = "ascending"  # the block order within a sweep
    fixed_order: str | None = comma_list(None)  # e.g. "2,0,1" with order = "fixed"
    start_block: int | None = None  # the block every sweep begins with; None: the order's own first block
    sweeps: int = 1  # passes over all blocks
    importance_batches: int = 2  # importance orders: training batches whose gradients score the blocks
    importance_floor: int = 2  # importance orders: every block is visited at least once in this many sweeps
    importance_margin: float = 0.25  # importance-cached: ascending unless the scores spread by more than this
    active: str | None = None  # train only this inclusive layer range, e.g. "4-5"; the other blocks stay frozen
    experts: str | None = None  # "top:0.5": in sparse layers train only the experts carrying that share of tokens
    experts_with: Names[ExpertPart] = comma_list("router,shared,attention,rest")  # what trains with the chosen experts
    experts_sample: int = 8  # training batches whose routing picks the experts
    # landscape expansion: cheap updates of the layers above the active block each step; auto: lowrank where it
    # runs (a dense model's BCD run without active, experts, frozen_dtype, a pipeline or keep_state), else none
    expand: Expand = "auto"
    expand_rank: int = 8  # lowrank: the factors' rank
    expand_lr: float | None = None  # the expansion's rate; None: the visit's rate




@dataclass
class OptimConfig:
    name: Optimizer = "adam"  # the optimizer
    lr: float | None = None  # None: the paper's default (sgd 0.1, adam/adamw and their 8-bit kin 5e-5)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd only
    weight_decay: float | None = None  # None: sgd 1e-5, adam 0, adamw 0.01 (8-bit: as their 32-bit kin)
    warmup_steps: int = 0  # linear warmup at the start of every visit (step 0 at 1/warmup of the rate)
    warmup_ratio: float = 0.0  # instead of warmup_steps: this share of each visit's steps, rounded up
    decay: LrDecay = "none"  # a transformers schedule after warmup; linear, cosine... fall to 0 at a visit's last step
    grad_clip: float = 0.0  # max gradient norm of the active block; 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step
    keep_state: bool = False  # keep each block's optimizer state between its visits, in host memory
    fused_step: bool = False  # each tensor steps in backward once its gradient is complete, then freed at once
    block_lr: str | None = comma_list(None)  # per-block rates, factors of lr: depth:LO..HI (linear in block) or a list


# A visit's epoch budget when the config gives no stopping rule.
DEFAULT_EPOCHS_PER_VISIT = 1.0


@dataclass
class StopConfig:
    steps_per_visit: int | None = None  # optimizer steps per visit
    epochs_per_visit: float | None = None  # passes over the training split per visit (1 when no rule is set)
    patience: int | None = None  # plateau: smoothed loss not improved by min_delta for this many steps
    min_delta: float = 0.0  # plateau: the smallest improvement that counts
    smoothing: float = 0.9  # exponential smoothing of the training loss for the plateau rule
    rule: StopRuleName = "budget"  # budget (steps, epochs, plateau) or gain: also when another block gains more
    gain_window: int = 4  # gain: the loss decrease per second is taken over the last 2 x this many steps
    total_steps: int | None = None  # the run's step budget: it ends once this many steps are done, whatever sweep


@dataclass
class RunConfig:
    out: str = "runs/bcd"  # the run directory (local)
    mode: Mode = "bcd"  # bcd, or full (full-parameter baseline: one block)
    seed: int = 0  # seeds a preset's initialisation, the sample order and the run's random state
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: after every visit only
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    precision: Precision = "auto"  # auto follows the model's weights (bf16 -> bf16-mixed)
    recompute: bool = False  # keep one hidden state per layer in the gradient path; run the layer again in backward
    offload: bool = False  # with recompute: those kept hidden states in host memory until backward needs them
    skip_memory_check: bool = False  # run even where the plan puts the largest visit above the device's memory
    loss: Loss = "auto"  # the next-token loss: chunked (auto, where the head allows), plain, liger
    loss_chunk: int = DEFAULT_LOSS_CHUNK  # tokens per chunk of the chunked loss
    pipeline: int = 1  # pipeline stages (under torchrun: world size = pipeline x data-parallel replicas)
    microbatches: int = 0  # micro-batches per step through the pipeline; 0: as many as stages
    pipeline_schedule: PipelineSchedule = "1f1b"  # the pipeline's schedule (torch.distributed.pipelining)
    dp_sync: str = "step"  # data-parallel replicas agree: step (gradients), visit or every:N (the block averaged)
    outer_lr: float = 1.0  # visit, every:N: the outer step's rate (1 with momentum 0: the plain average)
    outer_momentum: float = 0.0  # visit, every:N: the outer step's Nesterov momentum (DiLoCo: 0.9)
    grad_compression: str = "none"  # step sync: how the gradients are summed: none (fp32), bf16 or powersgd:R[:W]
    report_to: Names[Tracker] = comma_list("none")  # experiment trackers, each named once (rank 0 reports)


@dataclass
class PreInferenceConfig:
    """How `bcd` feeds visits above the input: from stores of boundary states it builds, or live."""

    mode: PreInferenceMode = "auto"  # train blocks above the input from stores of boundary states
    store_dir: str | None = None  # where bcd keeps its stores; None: <out>/stores
    store_format: StoreFormat = "zarr"  # the stores' format
    store_dtype: StoreDtype = "auto"  # the hidden states' storage dtype; auto: the compute dtype, bit-exact
    keep_stores: bool = False  # keep stores that are no longer usable
    dask: str | None = None  # build stores on a Dask cluster: local:N or tcp://host:port


@dataclass
class StoreConfig:
    """The cache `preinfer train` trains from."""

    path: str | None = None  # a cache directory written by `preinfer cache`
    trust: bool = False  # use the store even if the model's prefix differs from the one it was made from


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    blocks: BlockConfig = field(default_factory=BlockConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pre_inference: PreInferenceConfig = field(default_factory=PreInferenceConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    naming = Naming()  # how the last `validate` named the keys by their sources; not a field (nor saved)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)

    def validate(self, naming: Naming | None = None) -> Config:
        """This config, if every rule that needs only the config holds (types, choices, ranges and the rules
        between keys, `preinfer.config.rules`); else a one-line UsageError naming the key as `naming` does (by
        default `[section] key = value`), its value and what was expected. `naming` is kept (`self.naming`), so
        that the rules of the resolved run name a key as its source gave it too."""
        check(self, naming)
        self.naming = naming or Naming()
        return self
