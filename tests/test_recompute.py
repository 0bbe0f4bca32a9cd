"""Recomputation (activation checkpointing): the same gradients as the framework's own backward, dropout
included; the meter sees the smaller footprint exactly; a training run is unchanged by it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import preinfer
from preinfer.config import load_config
from preinfer.memory.meter import MemoryMeter
from preinfer.partition import make_partition
from preinfer.presets import build_preset
from pipelines.data.in_memory import TokenDataset
from preinfer.run_dir import RunDir
from preinfer.trainer import Trainer
from pipelines.data.batches import live_sources

VOCAB, T, B = 97, 16, 3
CONFIGS = {
    # GPT-2 with every dropout on: the recomputed forward must draw the same masks as the first.
    "gpt2-dropout": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2),
}


def hf_model(name: str) -> nn.Module:
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().train()


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recomputed_block_gradients_equal_the_framework_backward(name):
    model = hf_model(name)
    staged = preinfer.stage(model)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    for block in make_partition(staged, num_blocks=3).blocks:
        model.requires_grad_(False)
        for p in block.params:
            p.requires_grad_(True)
        torch.manual_seed(7)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        expected = _grads(block.params)

        torch.manual_seed(7)
        with torch.set_grad_enabled(block.has_embed):
            state = staged.run(staged.embed(ids, mask, ids), 0, block.start)
        staged.loss(staged.run(state, block.start, staged.num_layers, recompute=True)).backward()
        got = _grads(block.params)
        for g, e in zip(got, expected):
            assert torch.allclose(g, e, rtol=1e-5, atol=1e-7), f"block {block.index}"


class Wide(nn.Module):
    """Linear(H, 4H) -> ReLU -> Linear(4H, H): saves its input (H) and the ReLU output (4H) for backward."""

    def __init__(self, h: int):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("recompute,hidden_states", [(False, 15), (True, 7)])
def test_meter_counts_recomputation_by_hand(recompute, hidden_states):
    """Three layers, the input requires grad. Without recomputation: per layer its input and its 4H ReLU
    output, 3 x 5 = 15 hidden states. With it: the three layer inputs, then in backward the top layer's 4H
    ReLU output while those inputs are still held: 3 + 4 = 7."""
    h = 8
    model = nn.Sequential(nn.Embedding(VOCAB, h), Wide(h), Wide(h), Wide(h), nn.Linear(h, VOCAB))
    staged = preinfer.stage(model)
    meter = MemoryMeter(model)
    state = staged.embed(torch.zeros(B, T, dtype=torch.long))
    state.hidden = torch.randn(B, T, h, requires_grad=True)
    with meter.track():
        staged.run(state, 0, 3, recompute=recompute).hidden.sum().backward()
    assert meter.report()["activations"] == hidden_states * B * T * h * 4


def _run(tmp_path, recompute: bool) -> tuple[dict[str, torch.Tensor], dict]:
    config = load_config(overrides=dict(
        model=dict(name="tiny-llama"), data=dict(seq_len=16, batch_size=4),
        blocks=dict(ufp="1/3", sweeps=1), optim=dict(name="adam", lr=1e-3), stop=dict(steps_per_visit=3),
        run=dict(recompute=recompute, seed=0),
    ))
    model = build_preset("tiny-llama", seed=0)
    staged = preinfer.stage(model)
    tokens = torch.randint(0, model.config.vocab_size, (24, 16), generator=torch.Generator().manual_seed(2))
    data = TokenDataset(tokens, torch.ones_like(tokens, dtype=torch.bool), tokens.clone(), "random", "train")
    sources = live_sources(data, data, 4, samples_per_shard=8, seed=0)
    meter = MemoryMeter(model)
    run_dir = RunDir(tmp_path / str(recompute))
    Trainer(staged, make_partition(staged, ufp=1 / 3), config, sources, run_dir, meter).fit()
    return {k: v.clone() for k, v in model.state_dict().items()}, meter.report()


def test_training_with_recomputation_gives_the_same_weights_with_fewer_activations(tmp_path):
    plain, plain_memory = _run(tmp_path, recompute=False)
    recomputed, recomputed_memory = _run(tmp_path, recompute=True)
    for key, value in plain.items():
        assert torch.allclose(recomputed[key], value, rtol=1e-5, atol=1e-6), key
    assert recomputed_memory["activations"] < plain_memory["activations"]
