"""BCD inside `transformers.Trainer` (`preinfer.hf`): the same weights as our own trainer over the same batches, a
mid-visit resume, what a visit may touch, the precision flags, and TRL's SFTTrainer."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments
from trl import SFTConfig, SFTTrainer

import preinfer
from pipelines.data.batches import live_sources
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.frozen_weights import FrozenWeight
from preinfer.hf import BlockCoordinateDescent
from preinfer.memory.meter import MemoryMeter
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from preinfer.trainer import Trainer as BlockTrainer
from tests.helpers.chat_templates import save_tokenizer
from tests.helpers.trainers import drive_as_hf_trainer, live_batches, make_trainer, random_tokens, snapshot

pytestmark = pytest.mark.slow

OPTIONS = dict(blocks=3, steps_per_visit=3, lr=1e-3, order="descending", warmup_steps=1, decay="cosine")


def hf_args(out, **overrides) -> TrainingArguments:
    """Sequential batches of 4 samples, no clipping, no logging or reporting, on the CPU."""
    settings = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=9, report_to=[], save_strategy="no",
                    max_grad_norm=0.0, train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True,
                    logging_strategy="no")
    return TrainingArguments(**{**settings, **overrides})


def samples_of(batches: list[dict]) -> list[dict]:
    """The batches' samples, in order: a Trainer batching them by 4 in sequence gets the same batches back."""
    return [{key: value[i] for key, value in batch.items()} for batch in batches for i in range(len(batch["input_ids"]))]


def hf_run(out, data, callbacks=(), resume=None, precision="fp32", meter=False, loss_scale=None, options=None,
           **overrides):
    """A tiny Llama trained by BCD (OPTIONS, with `options`) through transformers.Trainer (with a memory meter;
    under fp16-mixed from `loss_scale`); returns the model and the BCD object."""
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, precision=precision, meter=MemoryMeter(model) if meter else None,
                                 **{**OPTIONS, **(options or {})})
    if loss_scale is not None:
        bcd.optimizer.scaler.scale = loss_scale
    trainer = Trainer(model=model, args=hf_args(out, **overrides), train_dataset=data, optimizers=bcd.optimizers,
                      callbacks=[bcd.callback, *callbacks])
    trainer.train(resume_from_checkpoint=resume)
    return model, bcd


def test_hf_trainer_ends_with_preinfer_bcd_s_weights_over_the_same_batches(tmp_path):
    """Gradient accumulation 2: Trainer's loss over the micro-batch's label tokens, divided by the step's
    supervised tokens (num_items_in_batch), is our loss over the global batch's supervised tokens."""
    config = Config()
    config.optim.lr, config.optim.warmup_steps, config.optim.decay, config.optim.grad_accum = 1e-3, 1, "cosine", 2
    config.stop.steps_per_visit, config.blocks.order, config.run.precision = 3, "descending", "fp32"
    staged = preinfer.stage(build_preset("tiny-llama", seed=0))
    sources = live_sources(random_tokens(), random_tokens(n=8, seed=1, split="eval"), 4, samples_per_shard=8, seed=0)
    ours = BlockTrainer(staged, make_partition(staged, num_blocks=3), config, sources,
                        meter=MemoryMeter(staged.model))
    ours.fit()

    model, bcd = hf_run(tmp_path, samples_of(live_batches(18)), gradient_accumulation_steps=2, meter=True)
    kept = ("params", "masters", "grads", "optimizer")  # the meter's peaks of the two, activations aside
    assert [{k: memory[k] for k in kept} for memory in bcd.optimizer.visit_memory] == [
        {k: visit["memory"][k] for k in kept} for visit in ours.position.visits]
    expected, got = snapshot(staged.model), snapshot(model)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(value, snapshot(build_preset("tiny-llama", seed=0))[name])
               for name, value in got.items())


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_a_resume_from_a_mid_visit_checkpoint_ends_as_the_uninterrupted_run(tmp_path, precision):
    """fp16-mixed from a scale that overflows at first: steps are skipped before the checkpoint, and the loss
    scaler's state (GradScaler's scale and growth tracker, the skipped steps) resumes with it."""
    data = samples_of(live_batches(9))
    scale = 2.0**20 if precision == "fp16-mixed" else None
    whole, bcd = hf_run(tmp_path / "a", data, precision=precision, save_strategy="steps", save_steps=4,
                        loss_scale=scale)
    saved = torch.load(tmp_path / "a" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert saved["position"] == dict(sweep=0, visit=1, visit_step=1, global_step=4)  # block 1, step 2 of 3
    assert saved["order"] == [2, 1, 0]
    factors = 2 * 7  # the default expansion's (lowrank): A and B of each linear of the one layer above block 1
    assert len(saved["masters"]) == (0 if precision == "fp32" else len(bcd.partition.blocks[1].params)) + factors
    resumed, again = hf_run(tmp_path / "b", data, precision=precision, resume=str(tmp_path / "a" / "checkpoint-4"))
    expected, got = snapshot(whole), snapshot(resumed)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    if precision == "fp16-mixed":
        assert 0 < saved["loss_scaler"]["skipped"] < 4 and saved["loss_scaler"]["scale"] < scale
        assert again.optimizer.scaler.state_dict() == bcd.optimizer.scaler.state_dict()


class VisitWatch(TrainerCallback):
    """Around each optimizer step: which weights changed, which had gradients, what the optimizer holds."""

    def __init__(self, bcd: BlockCoordinateDescent):
        self.bcd, self.meter, self.steps = bcd, MemoryMeter(bcd.staged.model), []

    def on_step_begin(self, args, state, control, **kwargs):
        self.block, self.before = self.bcd.optimizer.block, snapshot(self.bcd.staged.model)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.bcd.staged.model
        self.grads = {id(p) for p in [*model.parameters(), *self.bcd.optimizer.active.masters] if p.grad is not None}

    def adam_stepped(self, adam: torch.optim.Optimizer) -> None:
        """Right after the active block's Adam stepped (before a visit's last step switches blocks)."""
        self.meter.reset()
        self.meter.sample(adam)
        self.stepped = {id(p) for p in adam.state}
        self.optimizer_bytes = self.meter.report()["optimizer"]

    def on_step_end(self, args, state, control, **kwargs):
        after = snapshot(self.bcd.staged.model)
        mine = {id(p) for p in self.block.params}
        names = {name for name, p in self.bcd.staged.model.named_parameters() if id(p) in mine}
        self.steps.append(dict(block=self.block, grads=self.grads, stepped=self.stepped, mine=mine,
                               optimizer_bytes=self.optimizer_bytes,
                               changed={n for n in after if not torch.equal(after[n], self.before[n])},
                               names=names))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_visit_touches_only_its_block_and_holds_optimizer_state_for_it_alone(tmp_path, monkeypatch, precision):
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, precision=precision, expand="none", **OPTIONS)
    watch = VisitWatch(bcd)
    real_step = torch.optim.Adam.step

    def spy_step(adam, *args, **kwargs):
        out = real_step(adam, *args, **kwargs)
        watch.adam_stepped(adam)
        return out

    monkeypatch.setattr(torch.optim.Adam, "step", spy_step)
    Trainer(model=model, args=hf_args(tmp_path), train_dataset=samples_of(live_batches(9)),
            optimizers=bcd.optimizers, callbacks=[bcd.callback, watch]).train()
    assert [step["block"].index for step in watch.steps] == [2, 2, 2, 1, 1, 1, 0, 0, 0]
    for step in watch.steps:
        assert step["changed"] and step["changed"] <= step["names"]  # every frozen weight bit-identical
        assert step["changed"] == step["names"] or precision != "fp32"  # (a bf16 norm weight may round back)
        if precision == "fp32":  # the gradients are the block's own
            assert step["grads"] == step["mine"] == step["stepped"]
        else:  # every 16-bit gradient went into its fp32 master, which the optimizer steps
            assert step["grads"] == step["stepped"] and not step["grads"] & {id(p) for p in model.parameters()}
        assert len(step["stepped"]) == len(step["block"].params)
        adam = sum(2 * 4 * p.numel() + 4 for p in step["block"].params)  # fp32 moments and step counter
        assert step["optimizer_bytes"] == adam


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_trainer_s_autocast_flags_are_refused_for_bcd_s_precision(tmp_path, flag):
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, **OPTIONS)
    with pytest.raises(UsageError, match=f"drop {flag}=True and pass precision='{flag}-mixed'"):
        Trainer(model=model, args=hf_args(tmp_path, **{flag: True}), train_dataset=samples_of(live_batches(1)),
                optimizers=bcd.optimizers, callbacks=[bcd.callback])


def test_trl_sft_trainer_trains_by_blocks(tmp_path):
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, **OPTIONS)
    before = snapshot(model)
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, report_to=[],
                     save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no", max_grad_norm=0.0,
                     bf16=False)  # SFTConfig autocasts in bf16 by default: BCD refuses it (precision= instead)
    data = Dataset.from_list([{"input_ids": sample["input_ids"].tolist()} for sample in samples_of(live_batches(4))])
    tokenizer = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / "tokenizer"))
    SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, optimizers=bcd.optimizers,
               callbacks=[bcd.callback]).train()
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p)}
    trained = {name for name, p in model.named_parameters() if any(p is q for b in bcd.partition.blocks[1:]
                                                                   for q in b.params)}
    assert changed == trained  # 3 steps of block 2, 1 of block 1; block 0 untouched
    assert (bcd.optimizer.visit, bcd.optimizer.visit_step) == (1, 1)


def stepped_state(steps: int, **options) -> dict:
    """The optimizer state of a BCD (OPTIONS, with `options`) after `steps` steps on the live batches."""
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, **{**OPTIONS, **options})
    for batch in live_batches(steps):
        model(**batch).loss.backward()
        bcd.optimizer.step()
        bcd.scheduler.step()
    return bcd.optimizer.state_dict()


def test_resume_with_a_smaller_steps_per_visit_is_refused_in_one_line():
    """Issue 36: resumed at visit step 2 of 3 with visits of 2, the run stayed on one block for ever."""
    state = stepped_state(5)  # block 1, its step 3 of 3 next
    assert state["position"]["visit_step"] == 2 and state["steps_per_visit"] == 3
    older = {k: v for k, v in state.items() if k not in ("steps_per_visit", "config")}  # states saved before them
    for saved in (state, older):
        bcd = BlockCoordinateDescent(build_preset("tiny-llama", seed=0), **{**OPTIONS, "steps_per_visit": 2})
        with pytest.raises(UsageError, match="^steps_per_visit=2: the checkpoint") as refused:
            bcd.optimizer.load_state_dict(saved)
        assert len(str(refused.value).splitlines()) == 1
    again = BlockCoordinateDescent(build_preset("tiny-llama", seed=0), **OPTIONS)
    again.optimizer.load_state_dict(state)  # the same length resumes
    assert (again.optimizer.visit, again.optimizer.visit_step) == (1, 2)


@pytest.mark.parametrize("changed", [dict(lr=2e-3), dict(weight_decay=0.1), dict(betas=(0.8, 0.95))])
def test_resume_with_another_learning_rate_or_optimizer_setting_is_refused_in_one_line(changed):
    """Issue 36: torch's load_state_dict brought the saved rate back, silently."""
    state = stepped_state(2)
    bcd = BlockCoordinateDescent(build_preset("tiny-llama", seed=0), **{**OPTIONS, **changed})
    name = next(iter(changed))
    with pytest.raises(UsageError, match=f"^{name}=.*: the checkpoint was trained with {name}=") \
            as refused:
        bcd.optimizer.load_state_dict(state)
    assert len(str(refused.value).splitlines()) == 1


def test_a_second_block_coordinate_descent_on_one_bf16_model_replaces_the_first():
    """Issue 36: both held the model's gradient hooks, and the second's backward raised AttributeError."""
    model = build_preset("tiny-llama", seed=0).to(torch.bfloat16)
    first = BlockCoordinateDescent(model, **OPTIONS)
    batch = live_batches(1)[0]
    second = BlockCoordinateDescent(model, **OPTIONS)
    before = snapshot(model)
    model(**batch).loss.backward()
    second.optimizer.step()
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p)}
    assert changed and changed <= {name for name, p in model.named_parameters()
                                   if any(p is q for q in second.optimizer.partition.blocks[2].params)}
    with pytest.raises(UsageError, match="replaced by one made later on the same model") as refused:
        first.optimizer.step()
    assert len(str(refused.value).splitlines()) == 1


class ClipWatch(TrainerCallback):
    """The Trainer's and the optimizer's clipping norms at each optimizer step."""

    def __init__(self, bcd: BlockCoordinateDescent):
        self.bcd, self.seen = bcd, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.seen.append((args.max_grad_norm, self.bcd.optimizer.grad_clip))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_optimizer_clips_in_fp32_and_the_trainer_not_again(tmp_path, precision):
    """Under every precision the optimizer clips what it steps (the fp32 masters under mixed precision), as
    `preinfer bcd` does; the Trainer's own clipping is off while it trains, and its arguments are as given after."""
    runs = {}
    for norm in (0.05, 0.0):
        model = build_preset("tiny-llama", seed=0)
        bcd = BlockCoordinateDescent(model, precision=precision, **OPTIONS)
        args, watch = hf_args(tmp_path / str(norm), max_grad_norm=norm), ClipWatch(bcd)
        Trainer(model=model, args=args, train_dataset=samples_of(live_batches(9)), optimizers=bcd.optimizers,
                callbacks=[bcd.callback, watch]).train()
        assert watch.seen == [(0.0, norm)] * 9 and args.max_grad_norm == norm
        runs[norm] = snapshot(model)
    assert any(not torch.equal(runs[0.05][name], runs[0.0][name]) for name in runs[0.0])


EXPANSIONS = [("lowrank", "fp32"), ("lowrank", "bf16-mixed"), ("sgd", "fp32"), ("sgd", "bf16-mixed")]


@pytest.mark.parametrize("expand, precision", EXPANSIONS)
def test_the_hf_path_with_expansion_ends_with_our_trainer_s_weights_bit_for_bit(expand, precision):
    """Descending, so blocks 1 and 0 have a suffix: the HF `BlockOptimizer` driven as `transformers.Trainer`
    drives it (backward, step, scheduler step) over our trainer's batches, each micro-batch's loss computed as our
    trainer computes it, ends with its weights, bit for bit; the expansion moved the suffix."""
    expansion = dict(expand=expand, expand_lr=0.05, expand_rank=4)
    ours = make_trainer(blocks__blocks=3, blocks__order="descending", optim__warmup_steps=1, optim__decay="cosine",
                        run__precision=precision, **{f"blocks__{key}": value for key, value in expansion.items()})
    ours.fit()
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, precision=precision, **OPTIONS, **expansion)
    drive_as_hf_trainer(bcd, live_batches(9))
    bcd.close()
    expected, got = snapshot(ours.staged.model), snapshot(model)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    without = make_trainer(blocks__blocks=3, blocks__order="descending", optim__warmup_steps=1,
                           optim__decay="cosine", run__precision=precision, blocks__expand="none")
    without.fit()
    plain = snapshot(without.staged.model)
    layer_0 = [name for name in got if ".layers.0." in name]  # block 0's own weights: block 1's suffix too
    assert any(not torch.equal(got[name], plain[name]) for name in layer_0 if name.endswith("proj.weight"))


@pytest.mark.parametrize("expand, precision", [("lowrank", "fp32"), ("lowrank", "bf16-mixed"), ("sgd", "fp32")])
def test_a_mid_visit_resume_with_expansion_ends_as_the_uninterrupted_run(tmp_path, expand, precision):
    """The checkpoint at step 4 is mid-visit of block 1, whose factors (lowrank) it carries with the masters."""
    data, options = samples_of(live_batches(9)), dict(expand=expand, expand_lr=0.05)
    whole, bcd = hf_run(tmp_path / "a", data, precision=precision, save_strategy="steps", save_steps=4,
                        options=options)
    saved = torch.load(tmp_path / "a" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    factors = 2 * 7 if expand == "lowrank" else 0  # A and B of each linear of the one suffix layer above block 1
    block = len(bcd.partition.blocks[1].params) if precision != "fp32" else 0
    assert len(saved["masters"]) == block + factors
    resumed, _ = hf_run(tmp_path / "b", data, precision=precision, options=options,
                        resume=str(tmp_path / "a" / "checkpoint-4"))
    expected, got = snapshot(whole), snapshot(resumed)
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_an_expansion_the_hf_path_cannot_run_is_refused_by_its_argument():
    with pytest.raises(UsageError, match="expand") as refused:
        BlockCoordinateDescent(build_preset("tiny-llama", seed=0), expand="sgd", precision="fp16-mixed", **OPTIONS)
    assert len(str(refused.value).splitlines()) == 1 and "precision" in str(refused.value)


@pytest.mark.parametrize("saved, resumed", [(dict(expand="lowrank"), dict(expand="none")),
                                            (dict(expand="none"), dict(expand="lowrank")), ({}, dict(expand="none")),
                                            (dict(expand="lowrank"), dict(expand="lowrank", expand_rank=4))])
def test_a_resume_with_another_expansion_is_refused_in_one_line(saved, resumed):
    state = stepped_state(4, **saved)  # block 1, whose suffix is one layer
    bcd = BlockCoordinateDescent(build_preset("tiny-llama", seed=0), **{**OPTIONS, **resumed})
    with pytest.raises(UsageError, match="the checkpoint was trained with expand") \
            as refused:
        bcd.optimizer.load_state_dict(state)
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("optimizer, frozen", [("adamw8bit", "auto"), ("adam8bit", "int8"), ("adamw8bit", "nf4")])
def test_the_hf_front_end_gives_the_cli_trainer_s_losses_with_expansion_and_8_bit_state(tmp_path, optimizer, frozen):
    """Issue 44 part 4: one config and one visit lifecycle (its hooks, `preinfer.visit_optimizer`) behind both
    front-ends. In fp32, with lowrank expansion, 8-bit moments and frozen weights in int8 or nf4, the trainer
    `preinfer bcd` runs (its step records) and BlockCoordinateDescent under transformers.Trainer (the loss of each
    training forward) see the same losses over the same batches, and end with the same weights (masters)."""
    settings = dict(optimizer=optimizer, expand="lowrank", expand_rank=4, expand_lr=0.05, precision="fp32",
                    frozen_dtype=frozen)
    records = []
    ours = make_trainer(blocks__blocks=3, blocks__order="descending", optim__warmup_steps=1, optim__decay="cosine",
                        optim__name=optimizer, blocks__expand="lowrank", blocks__expand_rank=4,
                        blocks__expand_lr=0.05, run__precision="fp32", model__frozen_dtype=frozen,
                        on_record=records.append)
    ours.fit()
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, **OPTIONS, **settings)
    losses = []
    model.register_forward_hook(lambda module, args, out: losses.append(out.loss.item()) if module.training else None)
    held = []  # the moments' kinds at each step's end: 8-bit codes (torchao's OptimState8bit) for the large tensors

    class Moments(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            held.extend(type(moments["exp_avg"]).__name__ for moments in bcd.optimizer.state.values() if moments)

    Trainer(model=model, args=hf_args(tmp_path), train_dataset=samples_of(live_batches(9)), optimizers=bcd.optimizers,
            callbacks=[bcd.callback, Moments()]).train()
    steps = [record.loss for record in records if record.kind == "step"]
    assert len(steps) == len(losses) == 9
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(steps), rtol=1e-6, atol=0.0)
    assert len(set(steps)) == 9  # every step trained
    assert "OptimState8bit" in held
    codes = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and isinstance(m.weight, FrozenWeight)]
    assert bool(codes) == (frozen != "auto")  # the layers outside the open visit's block run from codes
    expected, got = snapshot(ours.staged.model), snapshot(model)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)

