"""How a pipeline's stages make pre-inference's stores (`bcd --pipeline N --pre-inference on`): the one executor
(`pipelines.pre_inference.PreInference`) plans each sweep, makes, reuses and deletes the stores and hands each
visit its batches; what differs on a pipeline is how a store is made, which `StageWriter` gives it.

Every visit of a block starting at layer k > 0 trains from a store of the boundary states at k, each made from the
input just before its reader (a pipeline does not roll stores forward). The store is made by the caching job's
own code (`pipelines.cache.cache_boundary`) on the rank of the first replica whose stage holds layer k (the
writer), through `StagePrefix`: the stages below it run their layers over the same batches in the same order
(`serve`, forward only) and send the hidden states up; the writer runs its own layers below k and writes the
shards. Layers held in fewer bits (`--frozen-dtype`) run their codes, as a live visit runs them, so training from
the store equals training live.
The store's prefix digest combines each stage's digest of the prefix tensors it holds (no rank holds the whole
prefix). During a visit from a store, the stages wholly below k run nothing (their ranks idle, logged), and the
stage holding k takes the stored states as its input.

The writer reaches the other stages through a `StageLink` (`pipelines.pipeline_parallel.visit.StageLink`): this
rank's place in the pipeline, its layers, and the hidden states from below and up.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from preinfer.batch_source import LiveSources
from preinfer.boundary_state import BoundaryState
from preinfer.config import Config
from preinfer.fingerprint import hash_tensors, named_prefix_tensors
from preinfer.memory.layer_spans import LayerSpan
from preinfer.partition import Block
from preinfer.staged import StagedModel
from storage import Location
from pipelines.cache import CacheOptions, cache_boundary
from pipelines.data.run_data import Datasets
from pipelines.pre_inference.executor import PreInference
from pipelines.pre_inference.writers import Built


class StageLink(Protocol):
    """This rank's place in a pipeline, as its stage writer asks."""

    spans: list[LayerSpan]  # every stage's layers
    stage: int  # this rank's stage
    replica: int  # this rank's replica
    replicas: int
    device: torch.device

    def holding(self, layer: int) -> int:
        """The stage holding `layer`."""
        ...

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """`tensor` of every stage of this replica, in stage order."""
        ...

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """This stage's layers over token ids (the first stage) or hidden states, without autograd."""
        ...

    def receive(self, shape: torch.Size) -> torch.Tensor:
        """The hidden states of a batch of `shape` (rows, tokens) from the stage below."""
        ...

    def send(self, hidden: torch.Tensor) -> None:
        """Hidden states to the stage above."""
        ...


def stage_pre_inference(staged: StagedModel, link: StageLink, data: Datasets, config: Config, live: LiveSources,
                        shard: int, quiet: bool) -> PreInference:
    """Pre-inference on this rank's stage: every rank of the pipeline takes the same decisions, each replica
    reads its share of the samples, and the stages make each store (`StageWriter`)."""
    datasets = {"train": data.train, "eval": data.eval}
    writer = StageWriter(staged, link, datasets, data.tokenizer, quiet or dist.get_rank() != 0)
    return PreInference(staged, datasets, data.tokenizer, config, live, shard, dist.get_rank(),
                        dist.get_world_size(), writer=writer, replica=link.replica, replicas=link.replicas)


class StageWriter:
    """A `pipelines.pre_inference.writers.StoreWriter`: the first replica's stages up to the one holding
    the boundary make each store together, from the input; every rank gets what the writer measured."""

    parts = 1  # one rank writes every shard
    rolls_forward = False

    def __init__(self, staged: StagedModel, link: StageLink, datasets: dict, tokenizer, quiet: bool):
        self.staged, self.link, self.datasets, self.tokenizer, self.quiet = staged, link, datasets, tokenizer, quiet

    def prefix_digest(self, boundary: int) -> str:
        """The digests of the prefix tensors each stage holds below `boundary`, hashed together (every rank)."""
        mine = hash_tensors((name, t) for name, t in named_prefix_tensors(self.staged, boundary) if not t.is_meta)
        every = self.link.gather(torch.tensor(list(bytes.fromhex(mine)), dtype=torch.uint8, device=self.link.device))
        upto = self.link.holding(boundary)
        return hashlib.sha256(b"".join(bytes(d.tolist()) for d in every[:upto + 1])).hexdigest()

    def write(self, boundary: int, source: Location | None, out: Location, options: CacheOptions) -> Built:
        """The writer runs the caching job over the hidden states the stages below send (`serve`); no shard is
        retried (the stages below would not send it again); every rank waits for it."""
        digest = self.prefix_digest(boundary)
        link, writer = self.link, self.link.holding(boundary)
        options = dataclasses.replace(options, retries=0, device=str(link.device))
        measured = [0.0] * 5
        if link.replica == 0 and link.stage == writer:
            prefix = StagePrefix(self.staged, link)
            result = cache_boundary(prefix, self.datasets, self.tokenizer, boundary, out, options, prefix=digest)
            measured = [result.seconds, result.forward_seconds, result.write_seconds, result.samples_computed,
                        result.stored_bytes]
        elif link.replica == 0 and link.stage < writer:
            serve(link, self.datasets, options.samples_per_shard, options.batch_size)
        made = torch.tensor(measured, dtype=torch.float64, device=link.device)
        dist.all_reduce(made, op=dist.ReduceOp.MAX)  # the writer's numbers, on every rank (and a barrier)
        seconds, forward, written, samples, stored = made.tolist()
        return Built(boundary, seconds, forward, written, int(samples), int(stored))

    def reading(self, block: Block, boundary: int) -> None:
        """Say which stages idle below the store."""
        idle = self.link.holding(boundary)
        if idle and not self.quiet:
            tqdm.write(f"block {block.index}: from the store at boundary {boundary}; stage(s) 0-{idle - 1} below it "
                       f"run nothing this visit")


class StagePrefix:
    """The writer's view of the prefix [0, k) for the caching job: the hidden states the stages below send
    (or its own embedding on the first stage), then its own layers below k."""

    def __init__(self, staged: StagedModel, link: StageLink):
        self.staged, self.link, self.span = staged, link, link.spans[link.stage]
        self.model, self.num_layers = staged.model, staged.num_layers
        self.hidden_size, self.compute_dtype = staged.hidden_size, staged.compute_dtype
        self.attention = staged.attention  # what the store's fingerprint records

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              labels: torch.Tensor | None = None) -> BoundaryState:
        if self.span.embed:
            return self.staged.embed(input_ids, attention_mask, labels)
        return BoundaryState.right_padded(self.link.receive(input_ids.shape), attention_mask, labels)

    def run(self, state: BoundaryState, start: int, stop: int, recompute: bool = False) -> BoundaryState:
        return self.staged.run(state, self.span.start, stop)


@torch.inference_mode()
def serve(link: StageLink, datasets: dict, per_shard: int, batch_size: int) -> None:
    """A stage below the writer: its layers over every split's samples, in the caching job's shards and batches,
    sending each batch's hidden states up."""
    embeds = link.spans[link.stage].embed
    for dataset in datasets.values():
        total = len(dataset)
        for lo in range(0, total, per_shard):
            for a in range(lo, min(lo + per_shard, total), batch_size):
                batch = dataset[a:min(a + batch_size, lo + per_shard, total)]
                ids, mask = batch["input_ids"].to(link.device), batch["attention_mask"].to(link.device)
                link.send(link.forward(ids if embeds else link.receive(ids.shape), mask))
