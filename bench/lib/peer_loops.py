"""The peers that run in a loop of their own, each in a process of its own: bench.peers' plain per-block loop,
BAdam's BlockOptimizer and `preinfer.hf` inside `transformers.Trainer`; bench.finetune's BAdam, peft LoRA and
QLoRA (LoRA on a torchao NF4 base). The same memory meter samples each inside its optimizer's step."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch

from bench.lib.runs import MeteredLoop, block_names, mean_loss, parse_config, prepared, split_batches

LORA_RANK = {"lora8": 8, "lora16": 16, "qlora": 16}
# A pacer stops after this many seconds, whether or not it was told to.
PACE_LIMIT_S = 3600


def sampled_in_step(base: torch.optim.Optimizer, loop: MeteredLoop) -> None:
    """Make `base.step` sample `loop`'s meter right after the update, inside BAdam's step, before it drops the
    gradients."""
    step = base.step

    def step_and_sample(*args, **kwargs):
        out = step(*args, **kwargs)
        loop.sample(base)
        return out

    base.step = step_and_sample


def badam_optimizer(model: torch.nn.Module, blocks, optim, steps_per_visit: int):
    """BAdam's BlockOptimizer over `blocks` in ascending order, and the Adam it wraps (no weight decay)."""
    from badam import BlockOptimizer

    base = torch.optim.Adam(model.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=0.0)
    optimizer = BlockOptimizer(base_optimizer=base, named_parameters_list=list(model.named_parameters()),
                               block_prefix_list=block_names(model, blocks), switch_block_every=steps_per_visit,
                               switch_mode="ascending", verbose=0)
    return optimizer, base


def adapted_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers peft's `all-linear` adapts: every `nn.Linear` but the output layer."""
    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]


def to_nf4_base(model: torch.nn.Module) -> None:
    """QLoRA's base: every adapted linear weight as torchao's NF4 tensor, frozen (`--frozen-dtype nf4`'s codes)."""
    from preinfer.frozen_weights import encode

    for linear in adapted_linears(model):
        linear.weight = torch.nn.Parameter(encode(linear.weight.detach(), "nf4")[0], requires_grad=False)


def from_nf4_base(model: torch.nn.Module) -> None:
    """Every NF4 weight of `to_nf4_base` dequantized to float32, for merging the adapters into it."""
    from preinfer.frozen_weights import decode

    for linear in adapted_linears(model):
        if hasattr(linear.weight, "get_original_weight"):
            linear.weight = torch.nn.Parameter(decode((linear.weight,), "nf4", torch.float32), requires_grad=False)


def loop_worker(method: str, flags: list[str], eval_count: int) -> dict:
    """BAdam's BlockOptimizer or peft LoRA over the run's batches; the eval loss after every visit's worth of
    steps (outside the clock)."""
    config = parse_config(flags)
    model, _, blocks, batches = prepared(config)
    evals = split_batches(flags, "eval", eval_count)
    o, per_visit = config.optim, config.stop.steps_per_visit
    if method == "badam":
        optimizer, base = badam_optimizer(model, blocks, o, per_visit)
    else:
        from peft import LoraConfig, get_peft_model

        rank = LORA_RANK[method]
        if method == "qlora":
            to_nf4_base(model)
        torch.manual_seed(config.run.seed)  # LoRA's A matrices start random: the same start in every run
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules="all-linear"))
        base = optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                                            betas=tuple(o.betas), weight_decay=0.0)
    loop = MeteredLoop(model)
    sampled_in_step(base, loop)
    curve, train_s = [], 0.0
    for index, batch in enumerate(batches):
        if index % per_visit == 0:
            loop.new_block()
        started = time.perf_counter()
        loss = loop.loss(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        train_s += time.perf_counter() - started
        if (index + 1) % per_visit == 0:
            curve.append(dict(step=index + 1, train_s=train_s, eval_loss=mean_loss(model, evals)))
    loop.new_block()
    if method != "badam":
        from_nf4_base(model)
        model = model.merge_and_unload()
    model.save_pretrained(config.run.out)
    return dict(steps=len(batches), train_s=train_s, caching_s=0.0, tracked_peak=loop.peak, curve=curve,
                model_dir=str(config.run.out))


def plain_worker(config, ready: Path | None = None, until: Path | None = None) -> dict:
    """The plain per-block loop. As a pacer (`ready`, `until`; one block), it creates `ready` after its first step
    and keeps stepping over its batches, round and round, until `until` exists."""
    model, precision, blocks, batches = prepared(config)
    loop, mixed, o = MeteredLoop(model), precision != "fp32", config.optim
    stamps, times, index, train_s = [], [], 0, 0.0
    steps = config.stop.steps_per_visit
    for block in blocks:
        started = time.perf_counter()
        loop.new_block()
        model.requires_grad_(False)
        for param in block.params:
            param.requires_grad_(True)
        masters = [p.detach().float().clone() for p in block.params] if mixed else list(block.params)
        optimizer = torch.optim.Adam(masters, lr=o.lr, betas=tuple(o.betas), weight_decay=0.0)
        for step in itertools.count():
            if until is None and step == steps:
                break
            if until is not None and step and (until.exists() or time.perf_counter() - started > PACE_LIMIT_S):
                break
            loss = loop.loss(batches[index % len(batches)])
            index += 1
            if mixed:
                for param, master in zip(block.params, masters):
                    master.grad, param.grad = param.grad.float(), None
            optimizer.step()
            if mixed:
                with torch.no_grad():
                    for param, master in zip(block.params, masters):
                        param.copy_(master)
            loop.sample(optimizer)
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            stamps.append(time.perf_counter() - started)
            times.append(time.time())
            if ready is not None and step == 0:
                ready.touch()
        train_s += stamps[-1]
        del optimizer, masters
    return finished(model, loop, stamps, times, train_s, config)


def badam_worker(config) -> dict:
    """BAdam's BlockOptimizer over the same blocks, batches and Adam."""
    model, _, blocks, batches = prepared(config)
    loop, steps = MeteredLoop(model), config.stop.steps_per_visit
    started = time.perf_counter()
    optimizer, base = badam_optimizer(model, blocks, config.optim, steps)
    sampled_in_step(base, loop)
    stamps, times, train_s = [], [], 0.0
    for index, batch in enumerate(batches):
        if index % steps == 0:
            loop.new_block()
            if index:
                started = time.perf_counter()
        loss = loop.loss(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        stamps.append(time.perf_counter() - started)
        times.append(time.time())
        if index % steps == steps - 1:
            train_s += stamps[-1]
    return finished(model, loop, stamps, times, train_s, config)


def hf_trainer_worker(config) -> dict:
    """`preinfer.hf.BlockCoordinateDescent` inside `transformers.Trainer`: the same blocks, batches (their samples
    in order, batched by the same size, no shuffling) and Adam; the meter is the integration's own."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from preinfer.hf import BlockCoordinateDescent
    from preinfer.memory.meter import MemoryMeter

    model, precision, blocks, batches = prepared(config)
    o, steps = config.optim, config.stop.steps_per_visit
    bcd = BlockCoordinateDescent(model, ranges=config.blocks.ranges, steps_per_visit=steps, optimizer="adam",
                                 lr=o.lr, betas=tuple(o.betas), weight_decay=0.0, precision=precision,
                                 expand=config.blocks.expand, meter=MemoryMeter(model))
    stamps, times, visits = [], [], []

    class Clock(TrainerCallback):  # each visit from its first step's start to its last step's end
        def on_step_begin(self, args, state, control, **kwargs):
            if bcd.optimizer.visit_step == 0:
                visits.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter() - visits[-1])
            times.append(time.time())

    samples = [{key: value[i] for key, value in batch.items()} for batch in batches
               for i in range(len(batch["input_ids"]))]
    args = TrainingArguments(output_dir=str(config.run.out), per_device_train_batch_size=config.data.batch_size,
                             max_steps=len(batches), train_sampling_strategy="sequential", max_grad_norm=0.0,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             use_cpu=config.run.device == "cpu", seed=config.run.seed)
    Trainer(model=model, args=args, train_dataset=samples, optimizers=bcd.optimizers,
            callbacks=[bcd.callback, Clock()]).train()
    ends = [stamps[(i + 1) * steps - 1] for i in range(len(blocks))]
    memory = [*bcd.optimizer.visit_memory, bcd.optimizer.meter.report()]
    model.save_pretrained(config.run.out)
    return dict(steps=len(stamps), train_s=sum(ends), stamps=stamps, times=times,
                tracked_peak=max(m["tracked_peak"] for m in memory), model_dir=str(config.run.out))


def finished(model: torch.nn.Module, loop: MeteredLoop, stamps: list[float], times: list[float], train_s: float,
             config) -> dict:
    """A worker's result (`times`: each step's end on the clock); its final weights saved with save_pretrained
    into the run's --out."""
    loop.new_block()
    model.save_pretrained(config.run.out)
    return dict(steps=len(stamps), train_s=train_s, stamps=stamps, times=times, tracked_peak=loop.peak,
                model_dir=str(config.run.out))


def run_worker(method: str, flags: list[str], result: Path, ready: Path | None, until: Path | None) -> None:
    config = parse_config(flags)
    Path(config.run.out).mkdir(parents=True, exist_ok=True)
    workers = {"badam": badam_worker, "hf-trainer": hf_trainer_worker}
    out = plain_worker(config, ready, until) if method == "plain" else workers[method](config)
    result.write_text(json.dumps(out))
