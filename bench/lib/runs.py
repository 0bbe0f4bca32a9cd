"""One `preinfer bcd` run as the peer benchmarks make and read it: its flags (bench.peers' settings) and config,
its model, blocks and batches, the metered forward and backward of a plain loop, its result read back from
metrics.jsonl, and the eval loss of saved weights, one function for every method."""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

import torch


def bcd_flags(args: argparse.Namespace, out: Path, steps: int, ranges: str, seq_len: int, batch: int,
              active: str | None = None, pre_inference: str = "off", expand: str = "none") -> list[str]:
    """The `preinfer bcd` flags of one run (the workers parse the same flags into the same config), by default
    without landscape expansion: the plain loops and BAdam it is compared with train the active block alone
    (`expand="auto"`: `preinfer bcd`'s default)."""
    flags = ["--model", args.model, "--data", args.data, "--seq-len", str(seq_len), "--batch-size", str(batch),
             "--sweeps", "1", "--order", "ascending", "--steps-per-visit", str(steps), "--optimizer", "adam",
             "--lr", str(args.lr), "--weight-decay", "0", "--warmup-steps", "0", "--grad-clip", "0",
             "--precision", args.precision, "--eval-tokens", str(seq_len * batch), "--seed", "0",
             "--pre-inference", pre_inference, "--expand", expand, "--out", str(out)]
    if args.max_samples:
        flags += ["--max-samples", str(args.max_samples)]
    if args.attention:
        flags += ["--attention", args.attention]
    return flags + (["--ranges", ranges, "--active", active] if active else ["--ranges", ranges])


def parse_config(flags: list[str]):
    """The config `preinfer bcd FLAGS` runs with."""
    from pipelines.cli import build_parser
    from pipelines.flags import config_for_command

    return config_for_command(build_parser().parse_args(["bcd", *flags]))


def prepared(config):
    """Model (resident dtype of the run's precision), its partition, and the run's token batches (every sweep's),
    as `preinfer bcd` makes them."""
    import preinfer
    from pipelines.data import batches as sources
    from pipelines.models import resolve_model
    from pipelines.training import load_datasets, partition_for, samples_per_shard
    from preinfer.precision import apply_precision

    data = load_datasets(config, quiet=True)
    model = resolve_model(config.model.name, seed=config.run.seed, attention=config.model.attention)
    precision = apply_precision(model, config.run.precision)
    staged = preinfer.stage(model)
    partition, active = partition_for(staged, config, precision=precision)
    reader = sources.token_batches(data.train, config.data.batch_size, samples_per_shard(config, staged),
                                   config.run.seed)
    blocks = partition.blocks if active is None else [partition.blocks[active]]
    batches = [next(reader) for _ in range(config.stop.steps_per_visit * len(blocks) * config.blocks.sweeps)]
    reader.close()
    return model, precision, blocks, batches


def block_names(model: torch.nn.Module, blocks) -> list[list[str]]:
    """Each block's parameter names (BAdam's `block_prefix_list`: full names match only themselves)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in block.params] for block in blocks]


class MeteredLoop:
    """The forward and backward every worker's step shares, and the memory meter on the steps the trainer meters
    (`MemoryMeter.due`: the first steps of each block)."""

    def __init__(self, model: torch.nn.Module):
        from preinfer.memory.meter import MemoryMeter

        self.model, self.meter, self.peak = model, MemoryMeter(model), 0
        self.metered = False

    def new_block(self) -> None:
        self.peak = max(self.peak, self.meter.report()["tracked_peak"])
        self.meter.reset()

    def loss(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one batch (tracked when the meter is due)."""
        self.metered = self.meter.due()
        with self.meter.track() if self.metered else nullcontext():
            loss = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"]).loss
            loss.backward()
        return loss

    def sample(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step of a metered step: masters, gradients and optimizer state are all present."""
        if self.metered:
            self.meter.sample(optimizer)


def preinfer_result(out: Path) -> dict:
    """Steps, training seconds (visits' wall_s plus store building), per-step stamps and tracked peak of a
    `preinfer bcd` run directory."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["kind"] == "step"]
    visits = [r for r in records if r["kind"] == "visit"]
    caching = sum(r.get("seconds", 0.0) for r in records if r["kind"] == "cache")
    return dict(steps=len(steps), train_s=sum(v["wall_s"] for v in visits) + caching, caching_s=caching,
                stamps=[r["visit_s"] for r in steps], times=[r["time"] for r in steps],
                tracked_peak=max(v["memory"]["tracked_peak"] for v in visits),
                sources=[v["source_boundary"] for v in visits], model_dir=str(out / "export"))


def eval_loss(model_dir: str, batches: list[dict]) -> float:
    """Mean next-token loss of the weights in `model_dir` (cast to float32) over `batches` (`mean_loss`). One
    function for every method."""
    from transformers import AutoModelForCausalLM

    return mean_loss(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), batches)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: list[dict]) -> float:
    """The framework's forward and loss over `batches`, in eval mode, weighted by each batch's supervised tokens;
    the model is left in the mode it was in."""
    training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = int((batch["labels"][:, 1:] != -100).sum())
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        total, count = total + float(loss) * n, count + n
    model.train(training)
    return total / count


def cli_result(out: Path) -> dict:
    """A `preinfer bcd` run's result, with its eval-loss curve at every visit's end (steps and tokens so far)
    against training time: the visits' wall time, store building (`cache` records) and an importance order's
    measurements (`importance` records), in the order the run spent them."""
    result = preinfer_result(out)
    curve, train_s, steps = [], 0.0, 0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] in ("cache", "importance"):
            train_s += record.get("seconds", 0.0)
        elif record["kind"] == "visit":
            train_s += record["wall_s"]
            steps += record["steps"]
            curve.append(dict(step=steps, tokens=record["tokens"], train_s=train_s, eval_loss=record["eval_loss"]))
    result["curve"] = curve
    return result


def split_batches(flags: list[str], split: str, count: int) -> list[dict]:
    """The first `count` batches of a split of the run `flags` describe, in order (no shuffling)."""
    from pipelines.data import batches as sources
    from pipelines.training import load_datasets

    config = parse_config(flags)
    data = load_datasets(config, quiet=True)
    reader = sources.token_batches(getattr(data, split), config.data.batch_size, 64, shuffle=False)
    return [batch for _, batch in zip(range(count), reader.one_pass())]
