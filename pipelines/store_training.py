"""Training from a store in one's own loop: `StoreBatches`, the batches of a cache's split in the order
`preinfer train --store` reads them (shuffled by the seed, split across data-parallel ranks, resumable through
`state_dict`), and `load_store_suffix`, the layers above the store's boundary and the head, loaded as `train --store`
loads them (the prefix's weights never read). A plain PyTorch loop over the two ends as `train --store` with one
block above the boundary does (docs/pre-inference.md, "Training from a store in your own loop")."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

import preinfer
from preinfer.config import DEFAULT_ATTENTION
from preinfer.config.choices import DEFAULT_LOSS_CHUNK
from preinfer.errors import UsageError
from preinfer.partition import make_partition
from preinfer.forward_backward import batch_state
from pipelines.cache import open_cache
from pipelines.data.batches import ReaderBatches
from pipelines.models.suffix import load_suffix, meta_model, to_device


class StoreBatches(torch.utils.data.IterableDataset):
    """The batches of split `split` of the cache at `cache` (a directory written by `preinfer cache`): dicts of the
    boundary state's fields (hidden, attention_mask, labels, ...), hidden in float32. Iterating goes on from where
    it stands, epoch after epoch, as `train --store` reads; `state_dict`/`load_state_dict` save and restore the
    position. Use it as is, or in `DataLoader(batches, batch_size=None)`."""

    def __init__(self, cache: str, split: str = "train", batch_size: int = 8, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True):
        store = open_cache(cache, splits=[split])[split]
        self.boundary = int(store.fingerprint.parts["boundary"])  # the layer whose input the store holds
        self.batches = ReaderBatches(store, self.boundary, batch_size, seed, rank, world_size, shuffle)

    @property
    def batches_per_epoch(self) -> int:
        return self.batches.batches_per_epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.batches

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)


class StoreSuffix(nn.Module):
    """The layers from `boundary` on and the head of a model whose prefix stays on the meta device (never read).
    Called on a `StoreBatches` batch it returns the mean next-token loss over the batch's supervised tokens, as
    the trainer computes it (`loss`: the trainer's `--loss` choice, auto by default: chunked where the head is one
    linear map); `trainable_parameters()` are the ones `train --store --blocks 1` trains (the only ones that
    require a gradient)."""

    def __init__(self, model: nn.Module, boundary: int, loss: str = "auto", loss_chunk: int = DEFAULT_LOSS_CHUNK):
        super().__init__()
        self.model, self.boundary = model, boundary
        self.staged = preinfer.stage(model)
        self.staged.use_loss(loss, loss_chunk)
        # what `train --blocks 1` trains above the boundary (a tied embedding stays frozen, as the prefix's)
        self.block = make_partition(self.staged, num_blocks=1, first_layer=boundary).blocks[0]
        model.requires_grad_(False)
        for param in self.block.params:
            param.requires_grad_(True)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.block.params)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device = self.block.params[0].device
        state = batch_state(self.staged, {k: v.to(device) for k, v in batch.items()}, self.boundary)
        return self.staged.loss(self.staged.run(state, self.boundary, self.staged.num_layers))


def load_store_suffix(model: str, boundary: int, device: str = "cpu", seed: int = 0,
                      attention: str = DEFAULT_ATTENTION, loss: str = "auto",
                      loss_chunk: int = DEFAULT_LOSS_CHUNK) -> StoreSuffix:
    """The suffix of `model` (a preset, save_pretrained or run directory) above `boundary`, on `device`, as
    `train --store` loads it (a preset is built from `seed`; its prefix then dropped), computing the loss as
    `--loss` and `--loss-chunk` say. A boundary outside
    [1, layers] (where a store can be) is refused in one line before anything is loaded."""
    layers = preinfer.stage(meta_model(model, attention)).num_layers
    if isinstance(boundary, bool) or not isinstance(boundary, int) or not 1 <= boundary <= layers:
        raise UsageError(f"load_store_suffix: boundary {boundary!r} is outside [1, {layers}]: {model} has {layers} "
                         f"layers and a store at boundary k holds the input of layer k")
    suffix = load_suffix(model, boundary, seed, attention)
    return StoreSuffix(to_device(suffix.model, device), boundary, loss, loss_chunk)
