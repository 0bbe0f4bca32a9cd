"""A live BCD trainer on random tokens, and snapshots of a model's parameters."""

import torch

import preinfer
from pipelines.data.batches import live_sources
from pipelines.data.in_memory import TokenDataset
from preinfer.config import Config
from preinfer.forward_backward import forward_backward
from preinfer.moe import RouterLoss
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from preinfer.run_dir import RunDir
from preinfer.staged import supervised_tokens
from preinfer.trainer import Trainer


def random_tokens(n=24, t=16, vocab=258, seed=0, split="train") -> TokenDataset:
    """A token dataset of random sequences with some right padding."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (n, t), generator=gen)
    lengths = torch.randint(t // 2, t + 1, (n,), generator=gen)
    attention_mask = torch.arange(t) < lengths[:, None]
    return TokenDataset(input_ids, attention_mask, input_ids.masked_fill(~attention_mask, -100), "random", split)


def make_trainer(preset="tiny-llama", run_dir=None, on_record=None, clock=None, **overrides):
    """A trainer of 3 blocks on random tokens; `overrides` set config keys as section__key=value, `clock` replaces
    the trainer's clock."""
    config = Config()
    config.optim.lr = 1e-3
    config.stop.steps_per_visit = 3
    config.data.batch_size = 4
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(config, section), name, value)
    staged = preinfer.stage(build_preset(preset, seed=0))
    partition = make_partition(staged, num_blocks=config.blocks.blocks or 3)
    sources = live_sources(random_tokens(), random_tokens(n=8, seed=1, split="eval"), config.data.batch_size,
                           samples_per_shard=8, seed=config.run.seed)
    timing = {} if clock is None else {"clock": clock}
    return Trainer(staged, partition, config, sources, run_dir=run_dir and RunDir(run_dir), on_record=on_record,
                   **timing)


def live_batches(count: int, batch_size: int = 4) -> list[dict]:
    """The first `count` training batches `make_trainer`'s live source reads (its default seed and batch size)."""
    sources = live_sources(random_tokens(), random_tokens(n=8, seed=1, split="eval"), batch_size,
                           samples_per_shard=8, seed=0)
    return [next(sources.train) for _ in range(count)]


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_resumes_as(reference, run_dir, **overrides):
    """A trainer resumed from `run_dir`'s checkpoint and run to the end has `reference`'s weights, bit for bit, and
    its visits' eval losses; returns it."""
    resumed = make_trainer(run_dir=run_dir, **overrides)
    resumed.resume()
    resumed.fit()
    ref, got = snapshot(reference.staged.model), snapshot(resumed.staged.model)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert [v["eval_loss"] for v in resumed.position.visits] == [v["eval_loss"] for v in reference.position.visits]
    return resumed


def drive_as_hf_trainer(bcd, batches: list[dict]) -> None:
    """Step a `preinfer.hf.BlockCoordinateDescent` over `batches` as `transformers.Trainer` drives it (backward,
    `optimizer.step()`, `scheduler.step()`, `zero_grad`), each micro-batch's loss computed as our trainer computes
    it (`preinfer.forward_backward`), so that only the optimizer lifecycle differs from our trainer's."""
    optimizer, scheduler = bcd.optimizers
    router = RouterLoss(bcd.staged.model, bcd.staged.layers)
    for batch in batches:
        count = torch.tensor(float(supervised_tokens(batch["labels"])))
        forward_backward(bcd.staged, batch, optimizer.block, 0, count, optimizer.current.scale_loss, router, 1,
                         False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
