"""Pre-inference on a pipeline (`bcd --pipeline N --pre-inference on`): every visit of a block starting at layer
k > 0 trains from a store of the boundary states at k, which the stages below k make together.

The store is made by the caching job's own code (`pipelines.cache.cache_boundary`) on the rank of the first
replica whose stage holds layer k (the writer), through `PipelinePrefix`: the stages below it run their layers
over the same batches in the same order (`serve`, forward only) and send the hidden states up; the writer runs
its own layers below k and writes the shards. The store's prefix digest combines each stage's digest of the
prefix tensors it holds (no rank holds the whole prefix). The store is reused while that digest holds, and
deleted once a visit below it makes it stale, or at the end of the run (unless --keep-stores). During a visit from a store, the stages wholly
below k run nothing (their ranks idle, logged), and the stage holding k takes the stored states as its input.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from preinfer.config import Config
from preinfer.fingerprint import hash_tensors, named_prefix_tensors
from preinfer.memory.layer_spans import LayerSpan
from preinfer.metrics import CacheRecord, Record
from preinfer.partition import Block
from preinfer.run_dir import RunDir
from preinfer.batch_source import BatchSource, LiveSources
from preinfer.staged import StagedModel
from preinfer.boundary_state import BoundaryState
from storage import location, remove_tree
from pipelines.cache import CacheOptions, cache_boundary, open_cache
from pipelines.pipeline_parallel.mesh import PipelineMesh
from pipelines.pipeline_parallel.stage_module import StageModule
from pipelines.pipeline_parallel.visit import receive_hidden, stage_of
from pipelines.data.batches import ReaderBatches


class PipelineStores:
    """A `preinfer.batch_source.VisitSources`: live token batches for blocks at the input, stores above it."""

    def __init__(self, staged: StagedModel, stages: list[LayerSpan], mesh: PipelineMesh, datasets: dict,
                 tokenizer, config: Config, live: LiveSources, shard: int, quiet: bool = False):
        self.staged, self.stages, self.mesh, self.datasets = staged, stages, mesh, datasets
        self.tokenizer, self.config, self.live, self.shard = tokenizer, config, live, shard
        self.quiet = quiet or dist.get_rank() != 0
        self.root = location(config.pre_inference.store_dir or RunDir(config.run.out).stores)
        self.device = torch.device(config.run.device)
        self.made: dict[int, str] = {}  # boundary -> the combined prefix digest of the store there
        self.emit: Callable[[Record], None] = lambda record: None

    def attach(self, emit: Callable[[Record], None]) -> None:
        self.emit = emit

    def sweep_started(self, blocks: list[Block]) -> None:
        """Nothing to plan: `on` reads a store for every visit above the input."""

    def sources(self, block: Block) -> tuple[BatchSource, BatchSource]:
        boundary = block.start
        if block.has_embed or boundary == 0:
            return self.live.train, self.live.eval
        digest = self._prefix_digest(boundary)
        path = self.root / f"boundary-{boundary}"
        if self.made.get(boundary) == digest:
            self.emit(CacheRecord(boundary=boundary, how="reuse", seconds=0.0, bytes=0))
        else:
            self._make(boundary, digest, path)
        idle = stage_of(self.stages, boundary)
        if idle and not self.quiet:
            tqdm.write(f"block {block.index}: from the store at boundary {boundary}; stage(s) 0-{idle - 1} below it "
                       f"run nothing this visit")
        stores = open_cache(path, splits=["train", "eval"])
        batch, seed = self.config.data.batch_size, self.config.run.seed
        return (ReaderBatches(stores["train"], boundary, batch, seed, self.mesh.replica, self.mesh.replicas),
                ReaderBatches(stores["eval"], boundary, batch, seed, shuffle=False))

    def visit_finished(self, block: Block) -> None:
        """Delete the stores the visit made stale (those above its first layer), unless --keep-stores."""
        for boundary in [b for b in self.made if b > block.start]:
            self._delete(boundary, f"block {block.index} changed layers below it")

    def close(self) -> None:
        """At the end of the run: delete the stores left, unless --keep-stores."""
        for boundary in list(self.made):
            self._delete(boundary, "the run is over")

    def _delete(self, boundary: int, reason: str) -> None:
        self.made.pop(boundary)
        if self.config.pre_inference.keep_stores:
            return  # kept on disk, and made again when a visit reads it (its digest is no longer known)
        dist.barrier()
        if dist.get_rank() == 0:
            remove_tree(self.root / f"boundary-{boundary}")
        self.emit(CacheRecord(boundary=boundary, how="deleted", reason=reason, seconds=0.0, bytes=0))

    def _prefix_digest(self, boundary: int) -> str:
        """The digests of the prefix tensors each stage holds below `boundary`, hashed together (every rank)."""
        mine = hash_tensors((name, t) for name, t in named_prefix_tensors(self.staged, boundary) if not t.is_meta)
        local = torch.tensor(list(bytes.fromhex(mine)), dtype=torch.uint8)
        every = [torch.zeros_like(local) for _ in range(self.mesh.stages)]
        dist.all_gather(every, local, group=self.mesh.pipe_group)
        upto = stage_of(self.stages, boundary)
        return hashlib.sha256(b"".join(bytes(d.tolist()) for d in every[:upto + 1])).hexdigest()

    def _make(self, boundary: int, digest: str, path) -> None:
        """The first replica's stages up to the one holding `boundary` make the store; every rank waits."""
        writer = stage_of(self.stages, boundary)
        opts = CacheOptions(store_format=self.config.pre_inference.store_format,
                            store_dtype=self.config.pre_inference.store_dtype, samples_per_shard=self.shard,
                            mode="overwrite", progress=False, retries=0, model_name=self.config.model.name,
                            device=str(self.device))
        seconds = written = 0
        if self.mesh.replica == 0 and self.mesh.stage == writer:
            prefix = PipelinePrefix(self.staged, self.stages[writer], self.mesh, self.device)
            result = cache_boundary(prefix, self.datasets, self.tokenizer, boundary, path, opts, prefix=digest)
            seconds, written = result.seconds, result.bytes_written
        elif self.mesh.replica == 0 and self.mesh.stage < writer:
            serve(self.staged, self.stages[self.mesh.stage], self.mesh, self.datasets, self.shard, opts.batch_size,
                  self.device)
        made = torch.tensor([seconds, written], dtype=torch.float64)
        dist.all_reduce(made, op=dist.ReduceOp.MAX)  # the writer's numbers, on every rank (and a barrier)
        self.made[boundary] = digest
        self.emit(CacheRecord(boundary=boundary, how="input", from_=0, seconds=float(made[0]), bytes=int(made[1])))


class PipelinePrefix:
    """The writer's view of the prefix [0, k) for the caching job: the hidden states the stages below send
    (or its own embedding on the first stage), then its own layers below k."""

    def __init__(self, staged: StagedModel, stage: LayerSpan, mesh: PipelineMesh, device: torch.device):
        self.staged, self.stage, self.mesh, self.device = staged, stage, mesh, device
        self.model, self.num_layers = staged.model, staged.num_layers
        self.hidden_size, self.compute_dtype = staged.hidden_size, staged.compute_dtype
        self.attention = staged.attention  # what the store's fingerprint records

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              labels: torch.Tensor | None = None) -> BoundaryState:
        if self.stage.embed:
            return self.staged.embed(input_ids, attention_mask, labels)
        hidden = receive_hidden(self.staged, self.mesh, input_ids.shape, self.device)
        return BoundaryState.right_padded(hidden, attention_mask, labels)

    def run(self, state: BoundaryState, start: int, stop: int, recompute: bool = False) -> BoundaryState:
        return self.staged.run(state, self.stage.start, stop)


@torch.inference_mode()
def serve(staged: StagedModel, stage: LayerSpan, mesh: PipelineMesh, datasets: dict, per_shard: int,
          batch_size: int, device: torch.device) -> None:
    """A stage below the writer: its layers over every split's samples, in the caching job's shards and batches,
    sending each batch's hidden states up."""
    module = StageModule(staged, stage)
    for dataset in datasets.values():
        total = len(dataset)
        for lo in range(0, total, per_shard):
            for a in range(lo, min(lo + per_shard, total), batch_size):
                batch = dataset[a:min(a + batch_size, lo + per_shard, total)]
                ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
                x = ids if stage.embed else receive_hidden(staged, mesh, ids.shape, device)
                dist.send(module(x, mask).contiguous(), mesh.rank_of(mesh.stage + 1))
