"""The planner's `--stream-frozen` and `--masters disk`: device and host columns per visit, the 70B-on-one-4090
goal, a streamed layer's copy against its compute, and the plan's device weights against the meter's."""

import dataclasses
import json

import pytest

from pipelines.cli import main
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.memory.budget import blocks_for_budget, budget_settings
from preinfer.memory.footprint import bcd_memory
from preinfer.memory.layer_spans import partition
from preinfer.memory.meter import MemoryMeter
from preinfer.memory.quantized import coded_layer_bytes, layer_tensors
from preinfer.memory.settings import GIB, GPUS, Settings
from preinfer.memory.shapes import resolve_shape, shape_for_size
from preinfer.memory.streaming import stream_timing
from tests.helpers.trainers import make_trainer

# The 70B run on one RTX 4090: one layer a block, the ends apart.
GOAL = Settings(gpu="4090", seq_len=1024, micro_batch=1, dtype="bf16-mixed", recompute=True, frozen_dtype="nf4",
                optimizer="adamw8bit", fused_step=True, separate_ends=True, blocks=80, expand="none",
                stream_frozen=True, masters="disk")
HOST_RAM = 64 * GIB


def visits(settings: Settings) -> list:
    m = shape_for_size("llama3-70b")
    blocks = partition(m, settings.blocks, settings.separate_ends)
    return [bcd_memory(m, settings, blocks, k, store=False) for k in range(len(blocks))]


def test_every_visit_of_llama3_70b_fits_one_4090_with_host_ram_within_64_gib():
    assert GOAL.capacity() / GIB == pytest.approx(20.12, abs=0.005)
    streamed = visits(GOAL)
    assert len(streamed) == 82 and all(v.fits for v in streamed)
    assert max(v.total for v in streamed) <= GOAL.capacity()
    assert max(v.host for v in streamed) <= HOST_RAM
    # without streaming the codes do not fit the card; with the masters in host memory they do not fit 64 GiB
    resident = visits(dataclasses.replace(GOAL, stream_frozen=False))
    assert not any(v.fits for v in resident)
    masters = visits(dataclasses.replace(GOAL, masters="host"))
    assert all(v.fits for v in masters) and min(v.host for v in masters) > 2 * HOST_RAM


def test_streaming_leaves_two_frozen_layers_on_the_device_and_the_rest_in_host_memory():
    m = shape_for_size("llama3-70b")
    coded = coded_layer_bytes(m, "nf4", 2)
    resident, streamed = visits(dataclasses.replace(GOAL, stream_frozen=False, masters="host"))[5], \
        visits(dataclasses.replace(GOAL, masters="host"))[5]  # layer 3 trains, 79 layers frozen
    assert resident.weights - streamed.weights == 77 * coded
    assert streamed.host - resident.host == 79 * coded
    assert (streamed.grads, streamed.optimizer, streamed.activations) == \
        (resident.grads, resident.optimizer, resident.activations)
    on_disk = visits(GOAL)[5]
    assert on_disk.host == 79 * coded and on_disk.total == streamed.total  # masters mapped: no host bytes
    auto = visits(dataclasses.replace(GOAL, frozen_dtype="auto", masters="host"))[5]
    assert auto.host == 79 * sum(layer_tensors(m)) * 2  # 16-bit layers, whole


def test_a_cpu_device_streams_nothing():
    cpu = dataclasses.replace(GOAL, host_device=True, budget_bytes=10**13)
    assert [v.total for v in visits(cpu)] == [v.total for v in visits(dataclasses.replace(cpu, stream_frozen=False))]


def test_the_copy_of_a_layer_hides_behind_its_forward_from_the_tokens_its_bytes_need():
    m = shape_for_size("llama3-70b")
    timing = stream_timing(m, GOAL)
    gpu = GPUS["4090"]
    assert timing["pcie"] == "PCIe 4.0 x16" and timing["layer_bytes"] == coded_layer_bytes(m, "nf4", 2)
    assert timing["copy_ms"] == pytest.approx(timing["layer_bytes"] / (gpu["pcie_gbs"] * 1e9) * 1e3)
    flops = 2 * m.layer_params() * 1024
    assert timing["forward_ms"] == pytest.approx(flops / (gpu["tflops_bf16"] * 1e12 * GOAL.mfu) * 1e3)
    assert timing["backward_ms"] == pytest.approx(2 * timing["forward_ms"])  # input gradient + the recomputation
    assert timing["hides"] and timing["tokens_to_hide"] <= 1024
    short = stream_timing(m, dataclasses.replace(GOAL, seq_len=256))
    assert not short["hides"] and short["tokens_to_hide"] == timing["tokens_to_hide"]
    assert stream_timing(m, dataclasses.replace(GOAL, stream_frozen=False)) is None


def test_plan_prints_the_host_column_and_the_streaming_line_and_ufp_auto_counts_the_savings(capsys):
    argv = ["plan", "--model", "llama3-70b", "--gpu", "4090", "--dtype", "bf16-mixed", "--recompute",
            "--frozen-dtype", "nf4", "--optimizer", "adamw8bit", "--fused-step", "--separate-ends", "--expand", "none"]
    assert main([*argv, "--stream-frozen", "--masters", "disk", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["stream_frozen"] and plan["settings"]["masters"] == "disk"
    assert plan["stream"]["hides"] and plan["auto"]["pipeline_degree"] == 1
    assert main([*argv, "--stream-frozen", "--masters", "disk"]) == 0
    text = capsys.readouterr().out
    assert "streaming: a frozen layer" in text and "PCIe 4.0 x16" in text and "(none: on disk" in text
    line = next(line for line in text.splitlines() if line.startswith("run it: "))
    assert line.startswith("run it: preinfer bcd ") and line.endswith("--stream-frozen --masters disk --expand none "
                                                                       "--device cuda")
    assert main(["plan", "--model", "tiny-llama", "--masters", "disk"]) == 0  # on a GPU: with streamed layers only
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run it: "))
    assert line.startswith("run it: none offered: bcd would refuse it") and "cuda unless --stream-frozen" in line
    # without streaming not even one layer a block fits (the first test); bcd --ufp auto plans with streaming
    budget = budget_settings(GOAL.capacity(), "bf16-mixed", 1024, 1, True, "sdpa", frozen_dtype="nf4",
                             optimizer="adamw8bit", fused_step=True, expand="none", separate_ends=True,
                             stream_frozen=True, masters="disk")
    assert blocks_for_budget(shape_for_size("llama3-70b"), budget, "bf16-mixed").blocks == plan["auto"]["blocks"]


def test_the_planned_device_weights_of_each_visit_are_the_meter_s_streamed_run():
    """A streamed int8 run of tiny-llama on the CPU with copies on: the meter's parameters on the device plus its
    streamed frozen bytes equal the plan's weights column of the same visit on a GPU, bit for bit."""
    trainer = make_trainer(model__stream_frozen=True, model__frozen_dtype="int8", stop__steps_per_visit=1)
    trainer.seams.stream.copies = True
    trainer.meter = MemoryMeter(trainer.staged.model)
    trainer.fit()
    shape = resolve_shape("tiny-llama")
    settings = Settings(dtype="float32", frozen_dtype="int8", stream_frozen=True, seq_len=16, micro_batch=4)
    blocks = partition(shape, 3)
    for k, visit in enumerate(trainer.position.visits[:3]):
        measured = visit["memory"]["params"] + visit["memory"]["frozen_device"]
        assert bcd_memory(shape, settings, blocks, k, store=False).weights == measured


def test_masters_on_disk_run_on_a_gpu_with_streamed_frozen_layers_and_are_refused_without_them():
    config = Config()
    config.model.masters, config.model.stream_frozen, config.run.device = "disk", True, "cuda"
    config.stop.steps_per_visit = 1
    config.validate()
    config.model.stream_frozen = False
    with pytest.raises(UsageError, match=r"\[model\] masters = 'disk': expected host with \[run\] device cuda "
                                         r"unless \[model\] stream_frozen") as refused:
        config.validate()
    assert "\n" not in str(refused.value)
