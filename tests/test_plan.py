"""The planner (`preinfer.memory`, `preinfer plan`) against the meter on real CPU steps, and its 7B figures."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import preinfer
from pipelines.cli import main
from preinfer.memory.activations import step_activations
from preinfer.memory.cost import flops_per_token
from preinfer.memory.footprint import bcd_memory, fewest_blocks, full_memory
from preinfer.memory.layer_spans import block_params, partition
from preinfer.memory.plan import plan_memory
from preinfer.memory.settings import GIB, Settings
from preinfer.memory.shapes import resolve_shape, shape_for_size
from preinfer.memory.meter import MemoryMeter
from preinfer.partition import make_partition
from preinfer.presets import build_preset

SEQ, BATCH, BLOCKS = 128, 4, 3
# The hand-built steps below pass an additive float mask, which is what eager attention takes.
# The measured steps train the block alone: no landscape expansion (priced in test_plan_expansion), with the plain
# loss (the chunked one: test_plan_loss).
SETTINGS = Settings(seq_len=SEQ, micro_batch=BATCH, dtype="float32", gpu="4090", blocks=BLOCKS, attention="eager",
                    expand="none", loss="plain")


def _batch(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, shared position ids and an additive causal mask for one micro-batch."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    return ids, positions, mask


def _run_layers(model, hidden: torch.Tensor, start: int, stop: int, positions, mask) -> torch.Tensor:
    """Layers [start, stop) of a HF Llama model, boundary to boundary."""
    rotary = model.model.rotary_emb(hidden, positions)
    for layer in model.model.layers[start:stop]:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
    return hidden


def _loss(model, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Final norm, LM head and the model's own causal-LM loss."""
    logits = model.lm_head(model.model.norm(hidden))
    return model.loss_function(logits=logits, labels=ids, vocab_size=model.config.vocab_size)


def _step(meter: MemoryMeter, params: list[torch.nn.Parameter], forward) -> dict[str, int]:
    """One metered training step (forward, backward, Adam step) of `params`; the meter's report."""
    optimizer = torch.optim.Adam(params, lr=1e-3)
    with meter.track():
        forward().backward()
    meter.sample(optimizer)
    optimizer.step()
    meter.sample(optimizer)
    return meter.report()


def measure_full(name: str) -> int:
    """tracked_peak of one full-parameter Adam step on a preset."""
    model = build_preset(name, attention="eager").train()
    ids, positions, mask = _batch(model)

    def forward():
        hidden = _run_layers(model, model.model.embed_tokens(ids), 0, len(model.model.layers), positions, mask)
        return _loss(model, hidden, ids)

    return _step(MemoryMeter(model), list(model.parameters()), forward)["tracked_peak"]


def _freeze_all_but(model, block) -> list[torch.nn.Parameter]:
    """Freeze the model except `block`'s parameters; those parameters."""
    model.requires_grad_(False)
    staged = preinfer.stage(model)
    modules = list(staged.layers[block.start:block.stop])
    modules += list(staged.embed_modules()) if block.embed else []
    modules += list(staged.head_modules()) if block.head else []
    for module in modules:
        module.requires_grad_(True)
    return [p for module in modules for p in module.parameters()]


def measure_live(name: str, k: int) -> int:
    """tracked_peak of one BCD-Adam step on block k, the layers below it run under no_grad."""
    model = build_preset(name, attention="eager").train()
    block = partition(resolve_shape(name), BLOCKS)[k]
    params = _freeze_all_but(model, block)
    ids, positions, mask = _batch(model)

    def forward():
        with torch.set_grad_enabled(block.embed):
            hidden = _run_layers(model, model.model.embed_tokens(ids), 0, block.start, positions, mask)
        hidden = _run_layers(model, hidden, block.start, len(model.model.layers), positions, mask)
        return _loss(model, hidden, ids)

    return _step(MemoryMeter(model), params, forward)["tracked_peak"]


def measure_store(name: str, k: int) -> int:
    """tracked_peak of one BCD-Adam step on block k fed stored (here random) boundary states; suffix resident."""
    model = build_preset(name, attention="eager").train()
    block = partition(resolve_shape(name), BLOCKS)[k]
    params = _freeze_all_but(model, block)
    ids, positions, mask = _batch(model)
    suffix = torch.nn.ModuleList([*model.model.layers[block.start:], model.model.norm, model.lm_head])
    boundary = torch.randn(BATCH, SEQ, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def forward():
        hidden = _run_layers(model, boundary, block.start, len(model.model.layers), positions, mask)
        return _loss(model, hidden, ids)

    return _step(MemoryMeter(suffix), params, forward)["tracked_peak"]


def measure_staged(name: str, k: int | None, recompute: bool = True, attention: str = "eager") -> int:
    """tracked_peak of one step through the staged model (the masks its attention implementation takes), with
    or without recomputation: full Adam (k None) or live BCD on block k."""
    model = build_preset(name, attention=attention).train()
    staged = preinfer.stage(model)
    ids, _, _ = _batch(model)
    if k is None:
        params, start, embed = list(model.parameters()), 0, True
    else:
        block = partition(resolve_shape(name), BLOCKS)[k]
        params, start, embed = _freeze_all_but(model, block), block.start, block.embed

    def forward():
        with torch.set_grad_enabled(embed):
            state = staged.run(staged.embed(ids, labels=ids), 0, start)
        return staged.loss(staged.run(state, start, staged.num_layers, recompute=recompute))

    return _step(MemoryMeter(model), params, forward)["tracked_peak"]


@pytest.mark.parametrize("name,k", [("tiny-llama", None), ("small-llama", None), ("tiny-llama", 1),
                                    ("small-llama", 0), ("small-llama", 2)])
def test_plan_matches_meter_with_recomputation(name, k):
    shape, settings = resolve_shape(name), replace(SETTINGS, recompute=True)
    if k is None:
        predicted = full_memory(shape, settings, recompute=True).held
    else:
        predicted = bcd_memory(shape, settings, partition(shape, BLOCKS), k, store=False).held
    assert predicted == pytest.approx(measure_staged(name, k), rel=0.15)


# (preset, block (None: full Adam), recompute, tolerance): dense layers are counted tensor by tensor (2%); the
# recomputation peak and the MoE router are estimates, as with eager attention (see test_plan_matches_meter_*).
SDPA_CASES = [("tiny-llama", None, False, 0.02), ("tiny-llama", 1, False, 0.02), ("tiny-gpt2", 1, False, 0.02),
              ("tiny-gpt2", None, False, 0.02), ("tiny-llama", 1, True, 0.05), ("tiny-gpt2", None, True, 0.05),
              ("tiny-moe", None, False, 0.15)]


@pytest.mark.parametrize("name,k,recompute,tolerance", SDPA_CASES)
def test_plan_matches_meter_with_sdpa(name, k, recompute, tolerance):
    """With sdpa (the default) the planner prices no [T, T] probabilities and matches what autograd saves."""
    shape, settings = resolve_shape(name), replace(SETTINGS, recompute=recompute, attention="sdpa")
    if k is None:
        predicted = full_memory(shape, settings, recompute=recompute).held
    else:
        predicted = bcd_memory(shape, settings, partition(shape, BLOCKS), k, store=False).held
    assert predicted == pytest.approx(measure_staged(name, k, recompute, "sdpa"), rel=tolerance)


def test_sdpa_saves_less_than_eager_by_the_attention_probabilities():
    shape = resolve_shape("small-llama")
    eager, sdpa = (step_activations(shape, 1, 1024, 4, None, False, attention).layers[0] for attention in ("eager", "sdpa"))
    probabilities = shape.heads * 1024 * 1024 * 4
    assert probabilities < eager - sdpa < probabilities + 2 * 1024 * shape.hidden * 4
    assert measure_staged("tiny-llama", None, False, "sdpa") < measure_staged("tiny-llama", None, False, "eager")


@pytest.mark.parametrize("name", ["tiny-llama", "small-llama", "tiny-moe"])
def test_plan_matches_meter_full_adam(name):
    predicted = full_memory(resolve_shape(name), SETTINGS, recompute=False).held
    assert predicted == pytest.approx(measure_full(name), rel=0.15)


@pytest.mark.parametrize("name,k", [("tiny-llama", 0), ("tiny-llama", 2), ("small-llama", 1), ("small-llama", 2),
                                    ("tiny-moe", 1)])
def test_plan_matches_meter_bcd_live(name, k):
    shape = resolve_shape(name)
    predicted = bcd_memory(shape, SETTINGS, partition(shape, BLOCKS), k, store=False).held
    assert predicted == pytest.approx(measure_live(name, k), rel=0.15)


@pytest.mark.parametrize("name,k", [("tiny-llama", 1), ("small-llama", 1), ("small-llama", 2)])
def test_plan_matches_meter_bcd_store(name, k):
    shape = resolve_shape(name)
    predicted = bcd_memory(shape, SETTINGS, partition(shape, BLOCKS), k, store=True).held
    assert predicted == pytest.approx(measure_store(name, k), rel=0.15)


def test_preset_shapes_count_the_real_parameters():
    for name in ("tiny-llama", "small-llama", "tiny-gpt2", "tiny-moe"):
        model = build_preset(name)
        assert resolve_shape(name).total_params() == sum(p.numel() for p in model.parameters())


def test_7b_llama_float32_is_4w_plus_stated_activations():
    shape = shape_for_size("7b")
    # The paper's accounting keeps the attention probabilities: eager attention.
    settings = Settings(seq_len=1024, micro_batch=1, dtype="float32", gpu="4090", blocks=3, attention="eager")
    result = plan_memory(shape, settings)
    full, weights = result.memory["full_adam"], result.weight_bytes
    assert weights == 4 * shape.total_params()
    assert full.weights + full.grads + full.optimizer == 4 * weights  # weight + gradient + Adam m and v
    assert 0.5 * weights < full.activations < 0.75 * weights  # the paper's total is 4.7 W
    sdpa = plan_memory(shape, replace(settings, attention="sdpa")).memory["full_adam"]
    # 7B has as many key/value heads as heads: sdpa keeps [a, T] float32 log-sum-exps instead of [a, T, T]
    # probabilities per layer, and the rest (q, k, v, output) alike.
    assert full.activations - sdpa.activations == shape.layers * shape.heads * (1024 * 1024 - 1024) * 4
    assert result.memory["full_adam_recompute"].activations < 0.05 * weights  # about 4 W with recomputation
    assert not full.fits and not result.memory["full_adam_recompute"].fits
    auto = result.auto  # float32 7B weights alone (27 GB) exceed a 4090: a pipeline is needed
    assert auto["pipeline_degree"] > 1 and auto["per_gpu_bytes"] <= result.capacity_bytes
    assert result.full_adam_pipeline_degree > auto["pipeline_degree"]


def test_7b_llama_bf16_mixed_is_2_bytes_per_parameter_and_16_more_per_trainable_one():
    shape = shape_for_size("7b")
    result = plan_memory(shape, Settings(dtype="bf16-mixed", gpu="a800", blocks=3))
    full = result.memory["full_adam"]
    assert full.weights == 2 * shape.total_params()  # bf16 weights
    assert full.grads + full.optimizer == 16 * shape.total_params()  # fp32 gradients, masters and moments
    assert not full.fits and result.memory["bcd_live"].fits
    assert (result.auto["blocks"], result.auto["pipeline_degree"]) == (3, 1)  # largest UFP fitting one A800: 1/3


def test_cli_json_for_7b_on_4090(capsys):
    assert main(["plan", "--model", "7b", "--gpu", "4090", "--ufp", "1/3", "--tokens", "1000000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["full_adam"]["fits"] is False
    assert out["settings"]["blocks"] == 3 and out["cost"]["full"]["dollars"] > 0
    assert main(["plan", "--model", "small-llama", "--ufp", "0.25", "--gpu", "a100-80"]) == 0
    assert "automatic UFP" in capsys.readouterr().out


def test_memory_budget_replaces_the_gpu_memory_in_the_automatic_ufp(capsys):
    assert main(["plan", "--model", "7b", "--dtype", "bf16-mixed", "--memory-budget", "40GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    budget = replace(Settings(dtype="bf16-mixed"), budget_bytes=40 * GIB)
    assert out["capacity_bytes"] == 40 * GIB
    assert (out["auto"]["blocks"], out["auto"]["per_gpu_bytes"]) == fewest_blocks(shape_for_size("7b"), budget)
    assert out["auto"]["pipeline_degree"] == 1
    assert main(["plan", "--model", "7b", "--dtype", "bf16-mixed", "--memory-budget", "24GB"]) == 0
    assert "22.35 GiB usable (--memory-budget)" in capsys.readouterr().out


@pytest.mark.parametrize("tokens", ["1e9", "1_000_000_000", "1.0e9"])
def test_tokens_take_exponent_and_underscore_spellings(tokens, capsys):
    assert main(["plan", "--model", "7b", "--tokens", tokens, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["tokens"] == 1_000_000_000


@pytest.mark.parametrize("argv", [
    ["--model", "7b", "--gpu", "h100"],
    ["--model", "7b", "--seq-len", "-5"],
    ["--model", "7b", "--micro-batch", "0"],
    ["--model", "7b", "--gpu-mem", "-24"],
    ["--model", "7b", "--ufp", "1.5"],
    ["--model", "7b", "--ufp", "0"],
    ["--model", "7b", "--ufp", "-1/3"],
    ["--model", "7b", "--ufp", "abc"],
    ["--model", "7b", "--blocks", "64"],
    ["--model", "nonexistent-model"],
    ["--model", "7b", "--mfu", "2"],
    ["--model", "7b", "--tokens", "1.5"],
    ["--model", "7b", "--tokens", "-1e9"],
    ["--model", "7b", "--tokens", "0"],
    ["--model", "7b", "--tokens", "many"],
    ["--model", "7b", "--memory-budget", "lots"],
    ["--model", "7b", "--memory-budget", "0GiB"],
])
def test_bad_input_is_one_line_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = main(["plan", *argv])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err and "Traceback" not in err


def test_a_moe_shape_counts_every_expert_and_computes_with_the_active_ones():
    shape = resolve_shape("tiny-moe")
    assert shape.sparse == (False, True, False, True) and (shape.experts, shape.experts_per_token) == (8, 2)
    staged = preinfer.stage(build_preset("tiny-moe"))
    blocks = make_partition(staged, num_blocks=2)
    assert [block_params(shape, b) for b in partition(shape, 2)] == [b.num_params for b in blocks.blocks]
    head = shape.vocab * shape.hidden
    assert shape.span_params(0, 4, active=True) + 2 * head + shape.hidden == blocks.active_params
    flops = flops_per_token(shape, partition(shape, 1), 1.0)
    assert flops["full"] == 6 * (shape.span_params(0, 4, active=True) + head)
    sparse, dense = (step_activations(shape, 1, 16, 4, None, False, "eager").layers[i] for i in (1, 2))
    assert sparse != dense  # a sparse layer's saved tensors follow its experts, not the dense MLP width


FINE_TUNED_FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2",
                       "gemma3_text", "vaultgemma", "granite", "cohere", "cohere2", "gpt_oss", "olmo3", "qwen3_next",
                       "phi3", "phi", "gpt2", "gpt_neox", "falcon", "olmo", "olmo2", "stablelm", "starcoder2",
                       "smollm3"]


@pytest.mark.parametrize("family", FINE_TUNED_FAMILIES)
def test_plan_gives_the_real_parameter_counts_of_each_family(family, tmp_path, capsys):
    """`preinfer plan --model config.json` sizes every family `stage` accepts: its parameters, layer by layer,
    equal the framework's own model's (a tied weight once)."""
    from tests.helpers.families import tiny_config

    config = tiny_config(family)
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    shape = resolve_shape(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(path.read_text())))
    staged = preinfer.stage(model)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    assert [shape.layer_params(i) for i in range(shape.layers)] == [
        sum(p.numel() for p in layer.parameters()) for layer in staged.layers]
    assert main(["plan", "--model", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
