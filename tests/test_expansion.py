"""Landscape expansion over the suffix (`--expand`): the merged low-rank update is the dense update it stands for,
the sgd step is plain SGD on the model's own gradients, only layers above the active block change (so stores stay
valid and exact, and fingerprints change exactly with their prefix), and a resumed run ends bit for bit."""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import preinfer
from pipelines import training
from pipelines.cache import open_cache
from pipelines.data.batches import ReaderBatches
from pipelines.models.suffix import load_suffix
from pipelines.training import partition_for, train
from preinfer.batch_source import LiveSources
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.config.rules import expand_problems, resolved_expand
from preinfer.expansion import LowRankExpansion, expansion_of, linear_weights
from preinfer.fingerprint import prefix_digest
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from tests.helpers.corpus_samples import paragraphs_corpus
from tests.helpers.trainers import assert_resumes_as, live_batches, make_trainer, snapshot
from tests.helpers.training_runs import (
    BothRanks, assert_close, cache_and_model, cache_records, config_for, torchrun, weights,
)


def test_expand_none_adds_no_hook_and_the_visit_steps_the_block_alone():
    trainer = make_trainer(blocks__expand="none")
    assert trainer.lifecycle.hooks == ()
    block = trainer.partition.blocks[0]
    visit = trainer.lifecycle.activate(block, trainer.position)
    groups = visit.optimizer.param_groups
    assert len(groups) == 1 and [id(p) for p in groups[0]["params"]] == [id(p) for p in block.params]
    assert trainer.lifecycle.checkpointed(visit) == []


def test_a_run_with_no_expand_flag_trains_as_expand_lowrank_and_records_it():
    """The default, auto, is lowrank in a dense model's BCD run: the same weights bit for bit as --expand lowrank
    given, and each visit's record names it but the top block's (no layer above it)."""
    records = []
    default = make_trainer(on_record=records.append)
    assert default.config.blocks.expand == "auto"
    default.fit()
    explicit = make_trainer(blocks__expand="lowrank")
    explicit.fit()
    for (name, param), other in zip(default.staged.model.named_parameters(), explicit.staged.model.parameters()):
        assert torch.equal(param, other), name
    none = make_trainer(blocks__expand="none")
    none.fit()
    top = default.partition.blocks[-1].params
    assert any(not torch.equal(p, q) for p, q in zip(top, none.partition.blocks[-1].params))
    visits = [r for r in records if r.kind == "visit"]
    assert [r.expand for r in visits] == ["lowrank", "lowrank", None]
    assert [v.get("expand") for v in default.position.visits] == ["lowrank", "lowrank", None]


@pytest.mark.parametrize("change", [dict(blocks__active="1-2"), dict(blocks__experts="top:0.5"),
                                    dict(optim__keep_state=True), dict(run__mode="full")])
def test_auto_is_none_where_lowrank_does_not_run_and_refuses_nothing(change):
    config = Config()
    assert resolved_expand(config) == "lowrank"
    for key, value in change.items():
        section, name = key.split("__")
        setattr(getattr(config, section), name, value)
    assert resolved_expand(config) == "none"
    assert list(expand_problems(config)) == []


@pytest.mark.parametrize("frozen", ["bf16", "int8", "nf4"])
def test_auto_is_lowrank_and_both_expansions_run_beside_frozen_codes(frozen):
    config = Config()
    config.model.frozen_dtype = frozen
    assert resolved_expand(config) == "lowrank"
    for expand in ("lowrank", "sgd"):
        config.blocks.expand = expand
        assert list(expand_problems(config)) == []


def test_auto_is_none_on_a_mixture_of_experts_model_and_lowrank_asked_for_is_kept():
    staged = preinfer.stage(build_preset("tiny-moe", seed=0))
    config = Config()
    assert expansion_of(staged, config) == "none"
    config.blocks.expand = "lowrank"
    assert expansion_of(staged, config) == "lowrank"
    assert expansion_of(preinfer.stage(build_preset("tiny-llama", seed=0)), Config()) == "lowrank"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_the_merged_low_rank_update_is_the_dense_update_it_stands_for(preset):
    """Factors set to random values: the framework's forward with them equals its forward after the merge, and each
    merged weight is W + B A (computed in float64) within 1e-6; the embedding, the head and the block stay as
    they were."""
    model = build_preset(preset, seed=0)
    staged = preinfer.stage(model)
    block = make_partition(staged, num_blocks=3).blocks[0]
    expansion = LowRankExpansion(staged, rank=4, lr=None)
    factors = expansion.activate(block)
    modules = list(linear_weights(list(staged.layers[block.stop:])))
    assert modules and len(factors) == 2 * len(modules)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in factors[1::2]:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    before = snapshot(model)
    ids = torch.randint(0, 258, (2, 12), generator=gen)
    with torch.no_grad():
        hooked = model(ids).logits
    expected = {id(module.weight): module.weight.detach().double() + (
        (b.double() @ a.double()).t() if transposed else b.double() @ a.double())
        for (module, transposed), a, b in zip(modules, factors[0::2], factors[1::2])}
    expansion.deactivate(block)
    with torch.no_grad():
        merged = model(ids).logits
    assert (merged - hooked).abs().max() <= 1e-5 * hooked.abs().max()
    after = dict(model.named_parameters())
    suffix = {id(p) for layer in staged.layers[block.stop:] for p in layer.parameters()}
    for name, param in after.items():
        if id(param) in expected:
            assert (param.double() - expected[id(param)]).abs().max() <= 1e-6, name
        elif id(param) not in suffix:
            assert torch.equal(param, before[name]), name
    assert all(not module._forward_hooks for module, _ in modules)


def test_an_sgd_step_is_plain_sgd_on_the_model_s_own_gradients():
    """One step of block 0 with --expand sgd: every suffix parameter is w - lr g, with g the gradient torch's
    autograd gives the framework's own loss on the same batch (relative 1e-6 of w); nothing below the suffix but the
    block moved, and no suffix gradient is left."""
    lr = 0.5
    trainer = make_trainer(blocks__expand="sgd", blocks__expand_lr=lr, stop__total_steps=1)
    model = trainer.staged.model
    reference = copy.deepcopy(model)
    batch = live_batches(1)[0]
    loss = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss
    block = trainer.partition.blocks[0]
    reference_layers = preinfer.stage(reference).layers
    suffix = [(name, p) for layer in reference_layers[block.stop:] for name, p in layer.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in suffix])
    before = snapshot(model)
    trainer.fit()
    assert [v["steps"] for v in trainer.position.visits] == [1]
    trained = [p for layer in trainer.staged.layers[block.stop:] for p in layer.parameters()]
    for (name, start), grad, now in zip(suffix, grads, trained):
        expected = start.detach() - lr * grad
        assert (now.detach() - expected).norm() <= 1e-6 * expected.norm(), name
        assert (lr * grad).norm() >= 1e-4 * start.norm(), name  # a step well above that tolerance
        assert now.grad is None and not now.requires_grad
    suffix_ids = {id(p) for p in trained} | {id(p) for p in block.params}
    for name, param in model.named_parameters():
        if id(param) not in suffix_ids:
            assert torch.equal(param, before[name]), name


@pytest.mark.parametrize("expand", ["lowrank", "sgd"])
def test_only_layers_above_the_active_block_change_and_fingerprints_follow_their_prefix(expand):
    """A visit of the middle block: every layer below it stays bit for bit, the suffix above it moved, and the
    prefix digest of every boundary changed exactly where a tensor of its prefix did."""
    trainer = make_trainer(blocks__expand=expand, blocks__expand_lr=0.05, stop__steps_per_visit=3)
    staged, block = trainer.staged, trainer.partition.blocks[1]
    boundaries = range(staged.num_layers + 1)
    digests = [prefix_digest(staged, b) for b in boundaries]
    before = [[t.detach().clone() for m in staged.prefix_modules(b) for t in m.parameters()] for b in boundaries]
    visit = trainer.lifecycle.activate(block, trainer.position, trainer.visit_sources.train)
    for _ in range(3):
        trainer.lifecycle.train_step(block, trainer.visit_sources.train, visit)
    trainer.lifecycle.deactivate(block, visit, trainer.position)
    for b in boundaries:
        now = [t for m in staged.prefix_modules(b) for t in m.parameters()]
        changed = any(not torch.equal(x, y) for x, y in zip(before[b], now))
        assert changed == (b > block.start), b
        assert (prefix_digest(staged, b) != digests[b]) == changed, b
    suffix_before = before[-1][len(before[block.stop]):]
    suffix_now = [t for m in staged.prefix_modules(staged.num_layers) for t in m.parameters()][len(before[block.stop]):]
    assert any(not torch.equal(x, y) for x, y in zip(suffix_before, suffix_now))


def expansion_run(directory: Path, corpus: str, name: str, mode: str, order: str, expand: str) -> tuple:
    """(config, result) of a two-sweep run in `order` with pre-inference `mode` and `expand`."""
    config = config_for(directory, corpus, name, mode=mode)
    config.blocks.order, config.blocks.sweeps = order, 2
    config.blocks.expand, config.blocks.expand_lr = expand, 0.05
    return config, training.run(config, quiet=True)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """`plain_run(order, corpus)`: the run in `order` without expansion (stores on), made once per order, so that
    both expansions of an order compare their stores with the same one."""
    directory, made = tmp_path_factory.mktemp("plain"), {}

    def run(order: str, corpus: str) -> tuple:
        if order not in made:
            made[order] = expansion_run(directory, corpus, order, "on", order, "none")
        return made[order]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("expand", ["lowrank", "sgd"])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_bcd_from_stores_ends_as_live_with_expansion(tmp_path, corpus, expand, order, pinned_rates, plain_run):
    """Pre-inference on (stores, rolled forward where ascending) and off (live), expansion on: the same weights
    (relative 1e-5) and eval losses, every visit above the input read from a store, and the stores made and
    reused as without expansion (it never makes one stale that the block's own training does not; the plans from
    pinned throughputs, so that how a store is made does not follow the machine's load)."""
    off_config, off = expansion_run(tmp_path, corpus, "off", "off", order, expand)
    on_config, on = expansion_run(tmp_path, corpus, "on", "on", order, expand)
    plain_config, _ = plain_run(order, corpus)
    assert_close(weights(on_config.run.out), weights(off_config.run.out))
    assert [v["eval_loss"] for v in on["visits"]] == pytest.approx([v["eval_loss"] for v in off["visits"]], rel=1e-5)
    assert all(v["source_boundary"] > 0 for v in on["visits"] if v["block"] > 0)
    how = sorted((r.boundary, r.how) for r in cache_records(on_config.run.out))  # records of concurrent writes
    assert how == sorted((r.boundary, r.how) for r in cache_records(plain_config.run.out))  # come in any order
    assert not weights(on_config.run.out).keys() - weights(plain_config.run.out).keys()
    assert any(not torch.equal(t, weights(plain_config.run.out)[k]) for k, t in weights(on_config.run.out).items())


@pytest.mark.parametrize("expand,precision,lr", [("lowrank", "fp32", None), ("lowrank", "fp32", 3e-3),
                                                 ("lowrank", "bf16-mixed", 3e-3), ("sgd", "fp32", 0.05),
                                                 ("sgd", "bf16-mixed", 0.05)])
def test_resume_mid_visit_is_bit_identical(tmp_path, expand, precision, lr):
    overrides = dict(blocks__sweeps=2, blocks__expand=expand, blocks__expand_lr=lr, optim__warmup_steps=2,
                     optim__decay="cosine", stop__steps_per_visit=4, run__precision=precision)
    reference = make_trainer(run_dir=tmp_path / "a", **overrides)
    halted = make_trainer(run_dir=tmp_path / "b", **overrides)
    reference.fit()
    halted.fit(max_total_steps=2)  # mid-visit: block 0, step 2 of 4, the suffix above it expanded
    saved = load_file(str(tmp_path / "b" / "checkpoint" / "state.safetensors"))
    masters = sum(name.startswith("master.") for name in saved)
    own = 0 if precision == "fp32" else len(halted.partition.blocks[0].params)
    assert masters == own + (halted.lifecycle.extras if expand == "lowrank" else 0)
    assert_resumes_as(reference, tmp_path / "b", **overrides)


def test_expand_lr_puts_the_factors_in_a_group_of_their_own_on_the_visit_s_schedule():
    trainer = make_trainer(blocks__expand="lowrank", blocks__expand_lr=2e-2, optim__warmup_steps=4)
    block = trainer.partition.blocks[0]
    visit = trainer.lifecycle.activate(block, trainer.position)
    own, factors = visit.optimizer.param_groups
    assert len(own["params"]) == len(block.params) and len(factors["params"]) == trainer.lifecycle.extras > 0
    visit.set_rate(0)
    assert (own["lr"], factors["lr"]) == pytest.approx((1e-3 / 4, 2e-2 / 4))


@pytest.mark.parametrize("change,message", [
    (dict(active="1-2"), "[blocks] expand = 'sgd': expected none with [blocks] active"),
    (dict(precision="fp16-mixed"), "[blocks] expand = 'sgd': expected lowrank or none under [run] precision"),
    (dict(expand_rank=0), "[blocks] expand_rank = 0: expected an integer >= 1"),
])
def test_what_expansion_does_not_run_with_is_refused_in_one_line(change, message):
    config = Config()
    config.stop.steps_per_visit, config.blocks.expand = 3, "sgd"
    for key, value in change.items():
        section = next(s for s in (config.blocks, config.optim, config.run, config.model) if hasattr(s, key))
        setattr(section, key, value)
    with pytest.raises(UsageError) as error:
        config.validate()
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# (expand, expand lr, frozen dtype) of the two-rank runs, all of them in one torchrun launch (`two_rank_runs`).
TWO_RANK_CASES = [("lowrank", 3e-3, "auto"), ("sgd", 0.05, "auto"), ("lowrank", 3e-3, "nf4"), ("sgd", 0.05, "int8")]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One model, its cache above boundary 2, and `train --store` of each of TWO_RANK_CASES on two gloo ranks, in
    one torchrun job: (the model directory, the store, the root whose `two-<index>` holds each run)."""
    root = tmp_path_factory.mktemp("two-ranks")
    corpus = paragraphs_corpus(root / "corpus.txt")
    model_dir, store = cache_and_model(root, corpus)
    torchrun(root, 2, [["train", "--store", store, "--model", model_dir, "--steps-per-visit", "3", "--lr", "1e-3",
                        "--blocks", "2", "--seed", "0", "--batch-size", "2", "--expand", expand, "--expand-lr",
                        str(lr), "--frozen-dtype", frozen, "--out", str(root / f"two-{index}")]
                       for index, (expand, lr, frozen) in enumerate(TWO_RANK_CASES)])
    return model_dir, store, root


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("expand,lr,frozen", TWO_RANK_CASES)
def test_torchrun_two_ranks_expand_as_one_process_with_the_same_global_batch(tmp_path, two_rank_runs, expand, lr,
                                                                             frozen):
    """`train --store` (two blocks above boundary 2) with expansion on two gloo ranks ends with the weights of one
    process whose batch is both ranks' batches: the factors' gradients are summed with the block's, the sgd step's
    over the replicas; under a frozen dtype too (the suffix model's meta prefix not held, its layers in codes)."""
    model_dir, store, root = two_rank_runs
    config = Config()
    config.model.name = model_dir
    config.data.batch_size = 4
    config.blocks.ufp, config.blocks.blocks = None, 2
    config.blocks.expand, config.blocks.expand_lr = expand, lr
    config.model.frozen_dtype = frozen
    config.optim.lr = 1e-3
    config.stop.steps_per_visit = 3
    config.run.out = str(tmp_path / "one")
    stores = open_cache(store, splits=["train", "eval"])
    staged = preinfer.stage(load_suffix(model_dir, 2).model)
    partition, _ = partition_for(staged, config, first_layer=2)
    sources = LiveSources(BothRanks(stores["train"], 2, 2, 0), ReaderBatches(stores["eval"], 2, 4, 0, shuffle=False))
    train(config, staged, partition, None, sources, resume=False, quiet=True)
    one, two = weights(str(tmp_path / "one")), weights(str(root / f"two-{TWO_RANK_CASES.index((expand, lr, frozen))}"))
    assert_close(one, two)
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    assert not torch.equal(two["model.layers.3.mlp.up_proj.weight"], start["model.layers.3.mlp.up_proj.weight"])


@pytest.mark.parametrize("expand", ["lowrank", "sgd"])
def test_recompute_trains_the_same_expansion(expand):
    """Each layer run again in backward (`--recompute`) runs its factors' hooks again: the same weights (relative
    1e-5) as without."""
    trained = []
    for recompute in (False, True):
        trainer = make_trainer(blocks__expand=expand, blocks__expand_lr=3e-3 if expand == "lowrank" else 0.05,
                               run__recompute=recompute)
        trainer.fit()
        trained.append(snapshot(trainer.staged.model))
    assert_close(trained[1], trained[0])
