"""The planner's frozen dtypes, 8-bit moments, fused step, SGD, separate ends and host masters: on a hand-computable
shape, against the bytes torchao and the optimizers actually allocate, against the meter on real steps, and
through `preinfer plan` (its flags, the automatic UFP, a CPU device)."""

import dataclasses
import json
import os

import pytest
import torch

import preinfer
from pipelines.cli import main
from preinfer.errors import UsageError
from preinfer.frozen_weights import FrozenWeights, encode
from preinfer.low_bit import low_bit_adam
from preinfer.memory.budget import blocks_for_budget, budget_settings
from preinfer.memory.footprint import bcd_memory, fewest_blocks, pipeline_peak, stage_bytes, stage_memory
from preinfer.memory.layer_spans import LayerSpan, block_params, partition
from preinfer.memory.quantized import frozen_linear_bytes, moment_bytes
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import ModelShape, resolve_shape, shape_for_size
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from tests.helpers.metered_visits import metered_peak, visit_optimizer

# Linear weights per layer: q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128: 36,864 elements.
TINY = ModelShape("tiny", "llama", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128)
BLOCKS = [LayerSpan(0, 1, True, False), LayerSpan(1, 2, False, False), LayerSpan(2, 4, False, True)]
BASE = Settings(dtype="bf16-mixed", seq_len=8, expand="none")  # the block alone (expansion: test_plan_expansion)


def visit(**fields):
    return bcd_memory(TINY, dataclasses.replace(BASE, **fields), BLOCKS, 1, store=False)


def test_defaults_keep_todays_bytes_and_no_host_memory():
    today = visit()
    assert today.host == 0 and today.weights == TINY.total_params() * 2
    assert today.grads == 36992 * 4 and today.optimizer == 36992 * 12  # the block: 36,864 + two 64-element norms = 36,992


def test_int8_frozen_layers_hold_a_byte_and_a_row_scale_and_their_masters_go_to_the_host():
    today, int8 = visit(), visit(frozen_dtype="int8")
    # three frozen layers, each 36,864 bytes of codes + 4 x 512 rows of scales instead of 2 x 36,864
    assert today.weights - int8.weights == 3 * (2 * 36864 - (36864 + 4 * 512))
    assert int8.host == 4 * 36864 * 2  # every layer's linear masters, bf16
    assert int8.total == int8.weights + int8.grads + int8.optimizer + int8.activations + int8.step


def test_8bit_moments_and_the_fused_step():
    memory = visit(optimizer="adamw8bit", fused_step=True)
    moments = 2 * (2 * (4096 + 4 * 16 + 1024)) + 2 * (2 * 2048 * 4) + 3 * (2 * (8192 + 4 * 32 + 1024)) + 2 * 512
    assert memory.optimizer == 36992 * 4 + moments  # fp32 masters + 8-bit moments (small tensors in fp32)
    assert memory.grads == 8192 * 4  # the largest tensor's fp32 gradient only


@pytest.mark.parametrize("dtype, rows, cols", [("nf4", 64, 128), ("nf4", 192, 576), ("int8", 32, 64),
                                               ("bf16", 32, 64)])
def test_frozen_bytes_are_what_the_codes_allocate(dtype, rows, cols):
    codes = encode(torch.randn(rows, cols, dtype=torch.bfloat16), dtype)
    inner = [getattr(c, name) for c in codes for name in c.__tensor_flatten__()[0]] if dtype == "nf4" else codes
    assert frozen_linear_bytes(rows, cols, dtype, 2) == sum(t.numel() * t.element_size() for t in inner)


@pytest.mark.parametrize("shape", [(64, 128), (10, 10)])
def test_moment_bytes_are_what_the_8bit_optimizer_allocates(shape):
    param = torch.nn.Parameter(torch.randn(shape))
    optimizer = low_bit_adam([param], "adam8bit", 1e-3, (0.9, 0.999), 0.0)
    param.sum().backward()
    optimizer.step()
    state = optimizer.state_dict()["state"][0]
    allocated = sum(v.numel() * v.element_size() for k, v in state.items() if torch.is_tensor(v) and k != "step")
    assert moment_bytes(param.numel(), 4) == allocated


def test_llama3_8b_size_and_refusals():
    m = shape_for_size("llama3-8b")
    assert (m.vocab, m.kv_heads, m.tied) == (128256, 8, False)
    assert m.total_params() == 8_030_261_248  # Meta-Llama-3-8B's parameter count
    with pytest.raises(UsageError, match="frozen dtype 'fp8' is not one of auto, bf16, int8, nf4"):
        visit(frozen_dtype="fp8")
    with pytest.raises(UsageError, match="has no --arch gpt2 shape"):
        shape_for_size("llama3-8b", "gpt2")


def _metered_visit(name: str, k: int, frozen_dtype: str, optimizer: str, seq: int = 64, batch: int = 4) -> int:
    """The meter's tracked_peak of one live BCD step of block k (of 3) of a float32 preset with sdpa: the layers
    outside the block held in `frozen_dtype` (auto: as they are), the block stepped by `optimizer`."""
    model = build_preset(name).train()
    staged = preinfer.stage(model)
    block = partition(resolve_shape(name), 3)[k]
    params = list(make_partition(staged, num_blocks=3).blocks[k].params)  # the planner's blocks (tested above)
    model.requires_grad_(False)
    for param in params:
        param.requires_grad_(True)
    if frozen_dtype != "auto":
        frozen = [i for i in range(staged.num_layers) if not block.start <= i < block.stop]
        FrozenWeights(staged.layers, frozen_dtype, "cpu").quantize(frozen)
    return metered_peak(staged, block, visit_optimizer(params, optimizer), seq, batch)


@pytest.mark.parametrize("name, k, frozen_dtype, optimizer", [
    ("small-llama", 1, "int8", "adam"), ("small-llama", 1, "nf4", "adamw8bit"), ("small-llama", 0, "bf16", "sgd"),
    ("medium-llama", 2, "nf4", "adam8bit"), ("medium-llama", 1, "auto", "adamw8bit"), ("medium-llama", 1, "int8", "sgd"),
])
def test_the_meter_agrees_with_the_planner_within_2_percent_on_the_new_rows(name, k, frozen_dtype, optimizer):
    """Frozen layers as codes, 8-bit moments and SGD's one buffer, measured on real CPU steps (the fused step is
    the trainer's, not run here)."""
    shape = resolve_shape(name)
    settings = Settings(seq_len=64, micro_batch=4, dtype="float32", frozen_dtype=frozen_dtype, optimizer=optimizer,
                        expand="none")  # the metered visit steps the block alone
    planned = bcd_memory(shape, settings, partition(shape, 3), k, store=False).held
    assert planned == pytest.approx(_metered_visit(name, k, frozen_dtype, optimizer), rel=0.02)


SMOLLM2_1_7B = dict(model_type="llama", vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=True,
                    max_position_embeddings=8192)


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_takes_the_bcd_flags_and_prices_them(capsys):
    today = plan_json(capsys, "--model", "7b", "--dtype", "bf16-mixed", "--recompute")
    savers = plan_json(capsys, "--model", "7b", "--dtype", "bf16-mixed", "--recompute", "--frozen-dtype", "int8",
                       "--optimizer", "adamw8bit", "--fused-step")
    assert (savers["settings"]["frozen_dtype"], savers["settings"]["optimizer"]) == ("int8", "adamw8bit")
    expected = Settings(dtype="bf16-mixed", recompute=True, frozen_dtype="int8", optimizer="adamw8bit",
                        fused_step=True)
    shape = shape_for_size("7b")
    worst = max((bcd_memory(shape, expected, partition(shape, 3), k, store=False) for k in range(3)),
                key=lambda mem: mem.total)
    assert savers["memory"]["bcd_live"]["total"] == worst.total < today["memory"]["bcd_live"]["total"]
    assert savers["memory"]["bcd_live"]["host"] > 0 == today["memory"]["bcd_live"]["host"]
    # full Adam has no frozen layer: the 8-bit moments and the fused step only
    full = savers["memory"]["full_adam"]
    assert full["weights"] == today["memory"]["full_adam"]["weights"] and full["host"] == 0
    assert full["optimizer"] < today["memory"]["full_adam"]["optimizer"]


def test_the_automatic_ufp_counts_the_savings(capsys):
    shape = shape_for_size("7b")
    base = Settings(dtype="bf16-mixed", recompute=True)
    savers = dataclasses.replace(base, frozen_dtype="nf4", optimizer="adamw8bit", fused_step=True)
    (today, _), (fewer, peak) = fewest_blocks(shape, base), fewest_blocks(shape, savers)
    assert fewer < today and peak <= base.capacity()
    assert plan_json(capsys, "--model", "7b", "--dtype", "bf16-mixed", "--recompute", "--frozen-dtype", "nf4",
                     "--optimizer", "adamw8bit", "--fused-step")["auto"]["blocks"] == fewer
    # bcd --ufp auto plans with the run's savers (pipelines.models.partition_choice passes them)
    budget = budget_settings(base.capacity(), "bf16-mixed", 1024, 1, True, "sdpa", frozen_dtype="nf4",
                             optimizer="adamw8bit", fused_step=True)
    assert blocks_for_budget(shape, budget, "bf16-mixed").blocks == fewer


def test_sgd_keeps_one_momentum_buffer_as_torch_does():
    memory = visit(optimizer="sgd")
    assert memory.optimizer == 36992 * (4 + 4)  # fp32 master and one bf16-mixed momentum buffer in fp32
    param = torch.nn.Parameter(torch.randn(64, 64))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.sum().backward()
    optimizer.step()
    buffer = optimizer.state[param]["momentum_buffer"]
    assert buffer.numel() * buffer.element_size() == param.numel() * 4


def test_separate_ends_are_the_trainer_s_blocks():
    staged = preinfer.stage(build_preset("small-llama"))
    shape = resolve_shape("small-llama")
    spans = partition(shape, 3, separate_ends=True)
    blocks = make_partition(staged, num_blocks=3, separate_ends=True).blocks
    assert [block_params(shape, span) for span in spans] == [block.num_params for block in blocks]
    assert [(span.start, span.stop) for span in spans] == [(block.start, block.stop) for block in blocks]


def test_a_cpu_plan_budgets_this_machine_s_memory_and_counts_the_host_masters(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMOLLM2_1_7B))
    flags = ["--model", str(path), "--device", "cpu", "--dtype", "float32", "--seq-len", "64", "--micro-batch", "1"]
    plan = plan_json(capsys, *flags, "--memory-budget", "23GiB")
    assert plan["capacity_bytes"] == 23 * 2**30 and not plan["memory"]["full_adam"]["fits"]
    assert plan["memory"]["full_adam"]["total"] > 16 * 1.7e9 and plan["memory"]["bcd_live"]["fits"]
    nf4 = plan_json(capsys, *flags, "--blocks", "24", "--frozen-dtype", "nf4")["memory"]["bcd_live"]
    assert nf4["host"] > 0 and nf4["total"] == sum(nf4[part] for part in
                                                   ("weights", "grads", "optimizer", "activations", "step", "host"))
    # block 0's Adam step on the CPU: two temporaries the size of the tied embedding, once its activations are freed
    assert nf4["step"] == 2 * 49152 * 2048 * 4 - nf4["activations"] > 0
    machine = plan_json(capsys, *flags)["capacity_bytes"]
    assert machine == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert main(["plan", *flags]) == 0
    assert "CPU (host memory)" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_scale_quick_runs_every_process_and_sets_its_peak_rss_beside_the_planner(tmp_path, capsys,
                                                                                        monkeypatch):
    """Its processes at the test's own priority (a benchmark's `nice -n 10` would leave them waiting on the other
    test worker), one step a visit over 32 tokens, one visit of each one-layer run."""
    from bench import scale
    from bench.lib import processes
    from bench.lib.common import ROOT

    monkeypatch.setattr(processes, "NICENESS", 0)
    assert scale.main(["--quick", "--work", str(tmp_path), "--seq-len", "32", "--steps", "1",
                       "--saver-visits", "1"]) == 0
    result = json.loads((ROOT / "bench" / "out" / "scale-quick.json").read_text())
    assert result["plan"]["exit"] == 0 and result["plan"]["full_adam"] > result["plan"]["bcd_live_ufp_1_3"] > 0
    row = result["bcd_ufp_1_3"]
    assert row["exit"] == 0 and row["peak_rss"] > row["planned"] and row["rss_over_planned"] > 1
    nf4 = result["bcd_nf4_one_layer"]  # frozen weights are wired: the probe trains
    assert nf4["ran"] and nf4["exit"] == 0 and nf4["peak_rss"] > nf4["planned"] > 0
    savers = result["bcd_savers_one_layer"]  # nf4, adamw8bit and the fused step are all wired: it trains
    assert savers["ran"] and savers["exit"] == 0 and savers["peak_rss"] > savers["planned"] > 0


def test_a_pipeline_stage_prices_the_8bit_moments_the_fused_step_and_the_codes_of_its_frozen_layers():
    shape = shape_for_size("13b")
    base = Settings(dtype="bf16-mixed", recompute=True)
    savers = dataclasses.replace(base, optimizer="adamw8bit", fused_step=True)
    blocks = partition(shape, 8)
    assert pipeline_peak(shape, savers, blocks, 2) < pipeline_peak(shape, base, blocks, 2)
    stage, active = partition(shape, 2)[1], blocks[0]  # the upper stage holds none of block 0: all 20 layers coded
    nf4 = dataclasses.replace(base, frozen_dtype="nf4")
    coded, resident = stage_memory(shape, nf4, stage, active, 1), stage_memory(shape, base, stage, active, 1)
    one_card = [bcd_memory(shape, settings, blocks, 0, store=False) for settings in (base, nf4)]
    frozen_on_one_card = shape.layers - (active.stop - active.start)
    per_layer = (one_card[0].weights - one_card[1].weights) // frozen_on_one_card
    assert resident.weights - coded.weights == (stage.stop - stage.start) * per_layer > 0
    assert coded.host == one_card[1].host * (stage.stop - stage.start) // shape.layers > 0
    assert (coded.grads, coded.optimizer, coded.activations) == \
        (resident.grads, resident.optimizer, resident.activations)
    assert stage_bytes(shape, nf4, stage, active, 1) == coded.total
