"""`--stream-frozen`: frozen layers in host memory, on the device only while they compute, each step layer-major.

The reference is the resident run of the same config: losses and weights bit for bit. The CPU runs with copies
on (`LayerStream.copies`, which CUDA has): every streamed tensor really leaves its storage (freed, refilled from its
host copy), so the mechanics a GPU runs are what these runs check, streams and pinning aside."""

import copy

import pytest
import torch
from safetensors.torch import load_file

from pipelines import training
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.frozen_weights import FrozenWeight
from preinfer.memory.meter import MemoryMeter
from preinfer.metrics import StepRecord
from preinfer.presets import build_preset
from preinfer.stream_frozen import LayerStream
from tests.helpers.trainers import make_trainer, snapshot
from tests.helpers.training_runs import config_for


def trained(stream: bool, preset: str = "tiny-llama", meter: bool = False, **overrides):
    """A fitted trainer (streamed with copies on, or resident), its step losses and final weights."""
    losses = []
    trainer = make_trainer(preset, on_record=lambda r: isinstance(r, StepRecord) and losses.append(r.loss),
                           model__stream_frozen=stream, stop__steps_per_visit=2, **overrides)
    if stream:
        trainer.seams.stream.copies = True
    if meter:
        trainer.meter = MemoryMeter(trainer.staged.model)
    trainer.fit()
    return trainer, losses, snapshot(trainer.staged.model)


@pytest.mark.parametrize("preset,overrides", [
    ("tiny-llama", dict(optim__grad_accum=3, run__recompute=True, model__frozen_dtype="int8")),
    ("tiny-gpt2", dict(optim__grad_accum=2, run__precision="bf16-mixed", optim__fused_step=True)),
    ("tiny-llama", dict(optim__grad_accum=2, run__precision="bf16-mixed", model__frozen_dtype="nf4",
                        optim__optimizer="adamw8bit", optim__fused_step=True, run__recompute=True)),
])
def test_a_streamed_run_equals_the_resident_run_bit_for_bit(preset, overrides):
    """fp32 and bf16-mixed; grad accumulation (layer-major), recompute, int8 and nf4 codes, the fused step, the
    8-bit optimizer, GPT-2's tied embedding (its visit's micro-batches one at a time), lowrank expansion (auto)."""
    resident, resident_losses, resident_weights = trained(False, preset, **overrides)
    streamed, losses, weights = trained(True, preset, **overrides)
    assert losses == resident_losses
    assert weights.keys() == resident_weights.keys()
    assert all(torch.equal(weights[k], resident_weights[k]) for k in weights)
    stream = streamed.seams.stream
    assert stream.bytes == 0 and not stream.resident  # nothing streamed is left on the device between visits
    steps, layers = 2 * len(streamed.partition.blocks), streamed.staged.num_layers
    assert stream.fetches < steps * 2 * layers * overrides["optim__grad_accum"]  # one copy serves every micro-batch


def test_the_meter_counts_at_most_two_streamed_layers_on_the_device_and_the_rest_in_host_memory():
    streamed, _, _ = trained(True, "tiny-llama", meter=True, model__frozen_dtype="int8")
    resident, _, _ = trained(False, "tiny-llama", meter=True, model__frozen_dtype="int8")
    stream: LayerStream = streamed.seams.stream
    layer = max(stream.layer_bytes(i) for i in range(len(stream.layers)))
    for on, off in zip(streamed.position.visits, resident.position.visits):
        got, was = on["memory"], off["memory"]
        assert 0 < got["frozen_device"] <= 2 * layer
        assert was["frozen_device"] == 0
        frozen_layers = len(stream.layers) - (3 if on["block"] == 1 else 0)  # tiny-llama: 4 layers, 3 blocks
        assert was["params"] - got["params"] >= (frozen_layers - 1) * layer  # codes of frozen layers left the device
        assert got["tracked_peak"] < was["tracked_peak"]  # (one micro-batch a step: the same activations)
    codes = [leaf for m in stream.layers[0].modules() if isinstance(getattr(m, "weight", None), FrozenWeight)
             for leaf in m.weight.codes]
    assert codes and all(c.untyped_storage().nbytes() == 0 for c in codes)  # really freed (copies on)


def test_bcd_from_stores_with_streamed_layers_exports_what_the_resident_run_exports(tmp_path, corpus):
    """Stores on (pre-inference and evaluation stream each layer as it runs; the visits train from the stores):
    the same export, bit for bit, and the same eval losses."""
    runs, mode = {}, "on"
    for stream in (False, True):
        config = config_for(tmp_path, corpus, f"{mode}-{stream}", mode=mode)
        config.model.stream_frozen, config.optim.grad_accum, config.stop.steps_per_visit = stream, 2, 2
        config.blocks.blocks = 2
        runs[stream] = training.run(config, quiet=True), load_file(str(tmp_path / f"{mode}-{stream}" / "export" /
                                                                        "model.safetensors"))
    (resident, exported), (streamed, streamed_export) = runs[False], runs[True]
    assert streamed_export.keys() == exported.keys()
    assert all(torch.equal(streamed_export[k], exported[k]) for k in exported)
    assert [v["eval_loss"] for v in streamed["visits"]] == [v["eval_loss"] for v in resident["visits"]]
    assert any(v["source_boundary"] > 0 for v in streamed["visits"])


@pytest.mark.parametrize("key,value,match", [
    ("run.pipeline", 2, "stream_frozen"), ("blocks.experts", "top:0.5", "stream_frozen"),
    ("run.mode", "full", "stream_frozen"),
])
def test_stream_frozen_is_refused_where_it_cannot_apply_in_one_line(key, value, match):
    config = Config()
    config.model.stream_frozen, config.stop.steps_per_visit = True, 1
    section, name = key.split(".")
    setattr(getattr(config, section), name, value)
    with pytest.raises(UsageError, match=match) as refused:
        config.validate()
    assert "\n" not in str(refused.value)


def test_a_streamed_run_halted_mid_visit_and_resumed_ends_as_the_resident_run(tmp_path):
    """Frozen dtype auto, copies on: the checkpoint reads each evicted weight from its host copy, and the resumed
    run's load writes there (the next copy to the device carries it)."""
    overrides = dict(optim__grad_accum=2, stop__steps_per_visit=3)
    reference = make_trainer(**overrides)
    reference.fit()
    for run, halt in ((make_trainer(run_dir=tmp_path, model__stream_frozen=True, **overrides), 4),
                      (make_trainer(run_dir=tmp_path, model__stream_frozen=True, **overrides), None)):
        run.seams.stream.copies = True
        if halt is None:
            run.resume()
        run.fit(max_total_steps=halt)
    ref, got = snapshot(reference.staged.model), snapshot(run.staged.model)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert [v["eval_loss"] for v in run.position.visits] == [v["eval_loss"] for v in reference.position.visits]


def test_under_inference_mode_each_layer_is_fetched_for_its_forward_and_freed_after_it():
    """Pre-inference's and evaluation's path (the forward hooks, copies on): the model's own logits, bit for bit,
    and nothing of a streamed layer left on the device after it ran."""
    model = build_preset("tiny-llama", seed=0).eval()
    reference = copy.deepcopy(model)
    layers = model.model.layers
    stream = LayerStream(layers, "cpu", codes=False, copies=True)
    stream.stream(range(len(layers)))
    ids = torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, expected = model(ids).logits, reference(ids).logits
    assert torch.equal(got, expected)
    assert stream.fetches == len(layers) and stream.bytes == 0 and stream.peak <= 2 * stream.layer_bytes(0)
    assert all(p.__dict__["stream_state"][0].untyped_storage().nbytes() == 0 for p in layers.parameters())


def test_a_parameter_replaced_in_host_memory_while_fetched_becomes_its_host_copy():
    """As `--masters disk` maps a trained block from its new file at the visit's end (frozen dtype auto, copies
    on): the eviction keeps the replacing tensor (not the stale host copy), and the next fetch copies it."""
    layers = build_preset("tiny-llama", seed=0).model.layers
    stream = LayerStream(layers, "cpu", codes=False, copies=True)
    stream.stream(range(len(layers)))
    stream.stream([0, 2, 3])  # layer 1 on the device, as in its visit
    param = layers[1].mlp.up_proj.weight
    mapped = param.detach().clone() + 1
    param.data = mapped
    stream.stream(range(len(layers)))
    assert param.data_ptr() == mapped.data_ptr()
    stream.use(1)
    assert param.data_ptr() != mapped.data_ptr() and torch.equal(param, mapped)
    stream.evict(1)
    assert param.data_ptr() == mapped.data_ptr() and torch.equal(param, mapped)
