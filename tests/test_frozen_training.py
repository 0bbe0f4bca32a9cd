"""`--frozen-dtype` end to end: a BCD run holds every layer outside the active block in codes and its block restored
from the masters; checkpoints and exports hold the masters; stores are made from the codes and equal live
training; resume is bit for bit; auto is today's run."""

import pytest
import torch
from safetensors.torch import load_file

from pipelines import training
from pipelines.cache import CacheOptions
from pipelines.data.tokenizers import load_tokenizer
from pipelines.pre_inference.writers import LocalWriter
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.fingerprint import prefix_digest
from preinfer.frozen_weights import FrozenWeight, FrozenWeights
from preinfer.metrics import StepRecord
from tests.helpers.cache_jobs import (
    BATCH, PER_SHARD, assert_same_store, datasets_for, staged_model, store_tensors,
)
from tests.helpers.cli_run import failure_line, run_cli
from tests.helpers.corpus_samples import write_corpus
from tests.helpers.trainers import make_trainer, snapshot
from tests.helpers.training_runs import assert_close, config_for, weights

LAYER = "model.layers."


def layer_of(name: str) -> int | None:
    return int(name[len(LAYER):].split(".")[0]) if name.startswith(LAYER) else None


def quantized_layers(model) -> set[int]:
    return {layer_of(name) for name, param in model.named_parameters() if isinstance(param, FrozenWeight)}


@pytest.mark.parametrize("dtype", ["int8", "nf4"])
def test_every_step_runs_the_block_restored_and_every_other_layer_in_codes_which_never_change(dtype):
    seen = []

    def record(r):
        if isinstance(r, StepRecord):
            block = trainer.partition.blocks[r.block]
            frozen = {k: v for k, v in snapshot(trainer.staged.model).items()
                      if layer_of(k) is not None and not block.start <= layer_of(k) < block.stop}
            seen.append((block, quantized_layers(trainer.staged.model), frozen))

    trainer = make_trainer(on_record=record, model__frozen_dtype=dtype)
    before = snapshot(trainer.staged.model)
    trainer.fit()
    layers = trainer.staged.num_layers
    assert len(seen) == 3 * len(trainer.partition.blocks)
    for block, quantized, _ in seen:
        assert quantized == set(range(layers)) - set(range(block.start, block.stop))
    for block in trainer.partition.blocks:  # a frozen weight never changes during a visit, bit for bit
        steps = [frozen for b, _, frozen in seen if b is block]
        assert all(torch.equal(steps[0][k], later[k]) for later in steps[1:] for k in steps[0])
    after = snapshot(trainer.staged.model)
    assert any(not torch.equal(before[k], after[k]) for k in before if layer_of(k) is not None)  # it trained
    assert quantized_layers(trainer.staged.model) == set(range(layers))  # every block re-quantized at its end


def test_a_trained_block_re_quantized_re_activated_and_exported_equals_its_master_bit_for_bit(tmp_path):
    trained = {}

    def record(r):
        if isinstance(r, StepRecord) and r.block == 1:  # the last step's weights: what the visit ends with
            trained.update({k: v for k, v in snapshot(trainer.staged.model).items()
                            if layer_of(k) is not None and block.start <= layer_of(k) < block.stop})

    trainer = make_trainer(on_record=record, model__frozen_dtype="int8")
    block = trainer.partition.blocks[1]
    trainer.fit()
    hook = trainer.lifecycle.hooks[0]  # the frozen weights (expansion comes after it)
    masters = snapshot(trainer.staged.model)
    assert trained and all(torch.equal(masters[k], v) for k, v in trained.items())
    assert all(masters[k].device.type == "cpu" for k in trained if k.endswith("proj.weight"))
    hook.activate(block)  # re-activated: the masters on the device, as nn.Linear again
    assert quantized_layers(trainer.staged.model) == set(range(4)) - set(range(block.start, block.stop))
    assert all(torch.equal(p, trained[k]) for k, p in trainer.staged.model.named_parameters() if k in trained)
    hook.deactivate(block)
    trainer.staged.model.save_pretrained(tmp_path / "export")
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in masters.items() if k in exported)
    assert not any("code" in k for k in exported) and all(k in exported for k in trained)


@pytest.mark.parametrize("dtype,precision", [("int8", "fp32"), ("nf4", "fp32"), ("int8", "bf16-mixed")])
def test_resume_is_bit_identical(tmp_path, dtype, precision):
    overrides = dict(blocks__sweeps=2, optim__warmup_steps=2, optim__decay="cosine", stop__steps_per_visit=4,
                     run__precision=precision, model__frozen_dtype=dtype)
    reference = make_trainer(run_dir=tmp_path / "a", **overrides)
    halted = make_trainer(run_dir=tmp_path / "b", **overrides)
    reference.fit()
    halted.fit(max_total_steps=6)  # mid-visit: block 1, step 2 of 4
    saved = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    held = snapshot(halted.staged.model)
    assert set(saved) == set(held) and all(torch.equal(saved[k], v) for k, v in held.items())  # masters, no codes
    resumed = make_trainer(run_dir=tmp_path / "b", **overrides)
    resumed.resume()
    assert same_run(reference, resumed)


def same_run(reference, other) -> bool:
    """Whether `other` (fitted here) ends with `reference`'s weights and visit losses, bit for bit."""
    other.fit()
    ref, got = snapshot(reference.staged.model), snapshot(other.staged.model)
    return all(torch.equal(ref[k], got[k]) for k in ref) and \
        [v["eval_loss"] for v in other.position.visits] == [v["eval_loss"] for v in reference.position.visits]


def test_auto_installs_nothing_and_keeps_every_weight_as_it_was():
    def record(r):
        held.append(([id(p) for p in auto.staged.model.parameters()], quantized_layers(auto.staged.model)))

    held = []
    auto = make_trainer(on_record=record, model__frozen_dtype="auto", blocks__expand="none")
    params = [id(p) for p in auto.staged.model.parameters()]
    assert auto.lifecycle.hooks == ()  # the visit runs today's code path, nothing in between
    auto.fit()
    assert held and all(ids == params and not quantized for ids, quantized in held)


@pytest.mark.parametrize("expand", ["none", "lowrank"])
def test_bf16_codes_of_bf16_weights_train_bit_for_bit_as_auto(expand):
    exact = make_trainer(run__precision="bf16-mixed", blocks__expand=expand)
    exact.fit()
    assert same_run(exact, make_trainer(run__precision="bf16-mixed", model__frozen_dtype="bf16",
                                        blocks__expand=expand))


def test_a_quantized_run_differs_from_the_exact_one_only_within_the_codes_error():
    exact, int8 = make_trainer(blocks__expand="none"), make_trainer(model__frozen_dtype="int8", blocks__expand="none")
    exact.fit()
    int8.fit()
    losses = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(exact.position.visits, int8.position.visits)]
    assert all(a != b and abs(a - b) < 0.01 * a for a, b in losses)


@pytest.mark.parametrize("key,value,match", [
    ("run__mode", "full", r"^\[model\] frozen_dtype = 'int8': expected auto with \[run\] mode full"),
])
def test_frozen_dtype_is_refused_where_it_cannot_apply_in_one_line(key, value, match):
    config = Config()
    config.model.frozen_dtype, config.stop.steps_per_visit = "int8", 3
    section, name = key.split("__")
    setattr(getattr(config, section), name, value)
    with pytest.raises(UsageError, match=match) as caught:
        config.validate()
    assert "\n" not in str(caught.value)


def test_the_flag_is_refused_with_full_training_before_anything_is_opened(tmp_path, capsys):
    code, _, err = run_cli(["bcd", "--frozen-dtype", "nf4", "--mode", "full", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "--frozen-dtype nf4 ([model] frozen_dtype): expected auto with --mode full" in \
        failure_line(err)
    assert not (tmp_path / "run").exists()


def test_a_model_without_linear_layers_is_refused_in_one_line():
    with pytest.raises(UsageError, match=r"^frozen dtype int8 holds nn.Linear weights; .*--frozen-dtype auto$"):
        make_trainer("tiny-gpt2", model__frozen_dtype="int8")  # GPT-2's layers are Conv1D


@pytest.mark.parametrize("source", [None, 1])
def test_pre_inference_runs_the_prefix_in_its_codes_and_the_fingerprint_names_their_dtype(tmp_path, source):
    """A store made under a frozen dtype is the codes' prefix's (from the input, or rolled forward): the same
    masters held in nf4 twice give the same store and digest, held exactly or in int8 another digest and store."""
    datasets = datasets_for(write_corpus(tmp_path / "corpus.txt"))
    models = {"exact": staged_model(), "nf4": staged_model(), "nf4 again": staged_model(), "int8": staged_model()}
    for name, staged in models.items():
        if name != "exact":
            FrozenWeights(staged.layers, name.split()[0], "cpu").quantize(range(staged.num_layers))
    digests = {name: prefix_digest(staged, 3) for name, staged in models.items()}
    assert digests["nf4"] == digests["nf4 again"] and len(set(digests.values())) == 3
    assert prefix_digest(models["nf4"], 0) == prefix_digest(models["exact"], 0)  # no frozen layer below 0
    options = CacheOptions(samples_per_shard=PER_SHARD, batch_size=BATCH, progress=False, model_name="tiny-llama")
    for name, staged in models.items():
        writer = LocalWriter(staged, datasets, load_tokenizer("byte"))
        if source is not None:
            writer.write(source, None, str(tmp_path / name / "low"), options)
        writer.write(3, source and str(tmp_path / name / "low"), str(tmp_path / name / "k3"), options)
    assert_same_store(tmp_path / "nf4" / "k3" / "train", tmp_path / "nf4 again" / "k3" / "train")
    for other in ("exact", "int8"):
        assert store_tensors(tmp_path / "nf4" / "k3" / "train")[0]["hidden"].ne(
            store_tensors(tmp_path / other / "k3" / "train")[0]["hidden"]).any()


@pytest.mark.slow
@pytest.mark.parametrize("dtype,order", [("int8", "ascending"), ("nf4", "descending")])
def test_bcd_from_stores_made_under_a_frozen_dtype_ends_as_live(tmp_path, corpus, dtype, order):
    """Invariant 3 with codes: pre-inference on (stores, rolled forward where ascending) and off (live, the prefix
    run in its codes at every step), lowrank expansion on: the same weights (relative 1e-5) and eval losses."""
    runs = {}
    for mode in ("off", "on"):
        config = config_for(tmp_path, corpus, mode, mode=mode)
        config.model.frozen_dtype, config.blocks.order, config.blocks.sweeps = dtype, order, 2
        config.blocks.expand = "lowrank"
        runs[mode] = (config, training.run(config, quiet=True))
    (off_config, off), (on_config, on) = runs["off"], runs["on"]
    assert_close(weights(on_config.run.out), weights(off_config.run.out))
    assert [v["eval_loss"] for v in on["visits"]] == pytest.approx([v["eval_loss"] for v in off["visits"]], rel=1e-5)
    assert any(v["source_boundary"] > 0 for v in on["visits"])
    assert all(v["source_boundary"] == 0 for v in off["visits"])
