"""The planner's rows of the chunked loss and of checkpoints offloaded to host memory against the meter, on real CPU
steps of the presets (and of a preset with a vocabulary large enough for the logits to dominate): within 2%; on a
suffix trained from a store and on a pipeline's last stage, the chunked loss counted as on one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

import preinfer
from pipelines.store_training import StoreSuffix
from preinfer.memory.footprint import bcd_memory, full_memory, stage_memory
from preinfer.memory.layer_spans import LayerSpan, partition
from preinfer.memory.meter import MemoryMeter
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import shape_from_config
from preinfer.presets import preset_config

SEQ, BATCH, BLOCKS, CHUNK = 128, 4, 3, 96
SETTINGS = Settings(seq_len=SEQ, micro_batch=BATCH, dtype="float32", blocks=BLOCKS, attention="sdpa", expand="none",
                    loss="chunked", loss_chunk=CHUNK)


def _model(name: str, vocab: int | None) -> torch.nn.Module:
    config = preset_config(name, "sdpa")
    if vocab is not None:
        config.vocab_size = vocab
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def measured(model: torch.nn.Module, k: int | None, recompute: bool, offload: bool) -> int:
    """tracked_peak of one Adam step through the staged model with the chunked loss: full Adam (k None) or live
    BCD on block k."""
    staged = preinfer.stage(model)
    assert staged.use_loss("chunked", CHUNK) == "chunked"
    staged.offload = offload
    if k is None:
        params, start, embed = list(model.parameters()), 0, True
    else:
        block = partition(shape_from_config(model.config), BLOCKS)[k]
        modules = [*staged.layers[block.start:block.stop], *(staged.embed_modules() if block.embed else ()),
                   *(staged.head_modules() if block.head else ())]
        model.requires_grad_(False)
        for module in modules:
            module.requires_grad_(True)
        params, start, embed = [p for m in modules for p in m.parameters()], block.start, block.embed
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    meter = MemoryMeter(model)
    optimizer = torch.optim.Adam(params, lr=1e-3)
    with meter.track():
        with torch.set_grad_enabled(embed):
            state = staged.run(staged.embed(ids, labels=ids), 0, start)
        staged.loss(staged.run(state, start, staged.num_layers, recompute=recompute)).backward()
    meter.sample(optimizer)
    optimizer.step()
    meter.sample(optimizer)
    return meter.report()["tracked_peak"]


# (preset, vocabulary (None: its own), block (None: full Adam), recompute, offload)
CASES = [("tiny-llama", None, None, False, False), ("tiny-llama", 4096, 2, False, False),
         ("tiny-llama", 4096, 1, False, False), ("tiny-gpt2", 4096, 0, False, False),
         ("tiny-gpt2", None, None, False, False), ("tiny-llama", 4096, 2, True, True),
         ("tiny-llama", None, None, True, True)]


@pytest.mark.parametrize("name,vocab,k,recompute,offload", CASES)
def test_plan_matches_meter_with_the_chunked_loss(name, vocab, k, recompute, offload):
    model = _model(name, vocab)
    shape = shape_from_config(model.config)
    settings = replace(SETTINGS, recompute=recompute, offload=offload)
    if k is None:
        memory = full_memory(shape, settings, recompute=recompute)
    else:
        memory = bcd_memory(shape, settings, partition(shape, BLOCKS), k, store=False)
    assert memory.held == pytest.approx(measured(model, k, recompute, offload), rel=0.02)
    assert (memory.host > 0) == offload  # the offloaded checkpoints, in host memory, not on the device


def test_the_chunked_loss_keeps_far_less_than_the_plain_one_where_the_vocabulary_dominates():
    shape = shape_from_config(_model("tiny-llama", 4096).config)
    chunked = bcd_memory(shape, SETTINGS, partition(shape, BLOCKS), 2, store=False)
    plain = bcd_memory(shape, replace(SETTINGS, loss="plain"), partition(shape, BLOCKS), 2, store=False)
    logits = BATCH * SEQ * 4096 * 4
    assert plain.activations - chunked.activations > 0.7 * logits and plain.step > 3 * chunked.step


def _store_step_peak(name: str, loss: str) -> int:
    """tracked_peak of one Adam step of `StoreSuffix` (layers 2.. and the head, vocabulary 4096) on random stored
    states at boundary 2, with `loss`."""
    model = _model(name, 4096)
    suffix = StoreSuffix(model, 2, loss, CHUNK)
    draws = torch.Generator().manual_seed(0)
    batch = dict(hidden=torch.randn(BATCH, SEQ, model.config.get_text_config().hidden_size, generator=draws),
                 attention_mask=torch.ones(BATCH, SEQ, dtype=torch.bool),
                 position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
                 labels=torch.randint(0, 4096, (BATCH, SEQ), generator=draws))
    meter = MemoryMeter(model)
    optimizer = torch.optim.Adam(suffix.trainable_parameters(), lr=1e-3)
    with meter.track():
        suffix(batch).backward()
    meter.sample(optimizer)
    optimizer.step()
    meter.sample(optimizer)
    return meter.report()["tracked_peak"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_store_suffix_and_a_pipelines_last_stage_count_the_chunked_loss_as_one_process_does(name):
    """What the chunked loss saves against the plain one: on a suffix trained from a store, the planner's (a visit
    from the store, `store=True`) within 2% of the meter's on a real step; on a pipeline's last stage holding the
    same layers, the same saving per micro-batch in flight."""
    shape = shape_from_config(_model(name, 4096).config)
    above = LayerSpan(2, shape.layers, False, True)
    blocks = [LayerSpan(0, 2, True, False), above]
    planned = {loss: bcd_memory(shape, replace(SETTINGS, loss=loss), blocks, 1, store=True)
               for loss in ("chunked", "plain")}
    saving = planned["plain"].held - planned["chunked"].held
    assert saving == pytest.approx(_store_step_peak(name, "plain") - _store_step_peak(name, "chunked"), rel=0.02)
    for in_flight in (1, 3):
        stages = {loss: stage_memory(shape, replace(SETTINGS, loss=loss), above, above, in_flight)
                  for loss in ("chunked", "plain")}
        assert stages["plain"].activations - stages["chunked"].activations == in_flight * (
            planned["plain"].activations - planned["chunked"].activations) > 0
