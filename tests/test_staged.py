"""Invariant 1: split forward through every boundary equals the framework's own forward."""

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

import preinfer
from preinfer.config import ATTENTIONS
from preinfer.errors import BoundaryStateError, UnsupportedModelError
from preinfer.presets import build_preset

VOCAB, T, B = 97, 12, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4)
CONFIGS = {
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64),
    "llama": lambda: LlamaConfig(**SMALL, num_key_value_heads=4),
    "mistral": lambda: MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None),
    "mistral-sliding": lambda: MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=5),
    "qwen2-gqa": lambda: Qwen2Config(**SMALL, num_key_value_heads=2),
    "qwen3-gqa": lambda: Qwen3Config(**SMALL, num_key_value_heads=1, head_dim=8),
    # Mixture of experts: 4 experts, top-2; every layer sparse unless said otherwise.
    "mixtral-sliding": lambda: MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, sliding_window=5),
    # Shared expert with its gate; decoder_sparse_step 2 makes layers 1 and 3 sparse, mlp_only_layers keeps 3 dense.
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **{**SMALL, "num_hidden_layers": 4}, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[3],
    ),
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    ),
    "olmoe": lambda: OlmoeConfig(**SMALL, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2),
}


def hf_model(name: str, attention: str = "eager") -> nn.Module:
    config = CONFIGS[name]()
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


def batch(padded: bool):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, 7:] = 0
        mask[2, 3:] = 0
    return ids, mask


def assert_composes(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Split forward through every boundary k (embed, run(0, k), run(k, L), logits) equals the framework's own
    forward of the same model within 1e-5 at the real (unpadded) positions."""
    real = mask.bool()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits  # before staging: the framework's own experts
        staged = preinfer.stage(model)
        for k in range(staged.num_layers + 1):
            state = staged.embed(ids, mask)
            state = staged.run(staged.run(state, 0, k), k, staged.num_layers)
            got = staged.logits(state)
            assert (got[real] - expected[real]).abs().max().item() <= 1e-5, f"boundary {k}"


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "right-padded"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_composition_through_every_boundary(name, padded, attention):
    model = hf_model(name, attention)
    assert model.config._attn_implementation == attention
    assert_composes(model, *batch(padded))


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-moe"])
def test_presets_compose_with_each_attention(name, attention):
    """Invariant 1 on the presets a run builds, with the attention implementation it asks for: the staged masks
    take the form that implementation needs (sdpa: boolean with padding, none without)."""
    model = build_preset(name, attention=attention).eval()
    assert preinfer.stage(model).attention == attention
    ids, mask = batch(padded=True)
    assert_composes(model, ids % model.config.vocab_size, mask)


def test_padding_never_changes_real_positions():
    model = hf_model("llama")
    staged = preinfer.stage(model)
    ids, mask = batch(padded=True)
    noisy = ids.clone()
    noisy[~mask.bool()] = (noisy[~mask.bool()] + 1) % VOCAB
    with torch.no_grad():
        a = staged.logits(staged.run(staged.embed(ids, mask), 0, staged.num_layers))
        b = staged.logits(staged.run(staged.embed(noisy, mask), 0, staged.num_layers))
    assert torch.equal(a[mask.bool()], b[mask.bool()])


def saved_bytes(model: nn.Module, step) -> int:
    """Bytes of the storages `step()` saves for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params:
            held[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(held.values())


def test_a_step_saves_no_more_than_the_frameworks_own():
    """The embedding's positions are shared by every row, so the rotary tables are built (and saved) from one
    row, as the framework's forward builds them; positions read from a store (one row each) stay as they are."""
    model = hf_model("llama").train()
    staged = preinfer.stage(model)
    ids, mask = batch(padded=False)
    state = staged.embed(ids, mask, ids)
    assert state.shared_positions().shape == (1, T)
    stored = preinfer.BoundaryState.from_dict({**state.to_dict(), "position_ids": state.position_ids.clone()})
    assert stored.shared_positions().shape == (B, T)
    ours = saved_bytes(model, lambda: staged.loss(staged.run(staged.embed(ids, mask, ids), 0, staged.num_layers)))
    theirs = saved_bytes(model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids).loss)
    assert ours <= theirs


def test_loss_matches_hf_loss():
    model = hf_model("gpt2")
    staged = preinfer.stage(model)
    ids, mask = batch(padded=True)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        got = staged.loss(staged.run(staged.embed(ids, mask, labels), 0, staged.num_layers))
    assert abs(got.item() - expected.item()) <= 1e-5


def sequential_lm() -> nn.Sequential:
    torch.manual_seed(0)
    layer = lambda: nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())  # noqa: E731
    return nn.Sequential(nn.Embedding(VOCAB, 16), layer(), layer(), layer(), nn.Linear(16, VOCAB))


def test_sequential_composition():
    model = sequential_lm()
    staged = preinfer.stage(model)
    ids, _ = batch(padded=False)
    assert staged.num_layers == 3
    with torch.no_grad():
        expected = model(ids)
        for k in range(4):
            state = staged.run(staged.run(staged.embed(ids), 0, k), k, 3)
            assert (staged.logits(state) - expected).abs().max().item() <= 1e-5


def test_units_cover_every_parameter_once_except_ties():
    model = hf_model("gpt2")
    units = preinfer.stage(model).units()
    assert [u.name for u in units] == ["embed", "layer.0", "layer.1", "layer.2", "head"]
    seen = {id(p) for u in units for p in u.parameters()}
    assert seen == {id(p) for p in model.parameters()}
    # GPT-2 ties lm_head to wte: the same tensor appears in the embed and head units.
    assert model.lm_head.weight is model.transformer.wte.weight


def test_state_slices_and_round_trips_through_a_dict():
    staged = preinfer.stage(hf_model("llama"))
    ids, mask = batch(padded=True)
    state = staged.embed(ids, mask, labels=ids)
    one = state[1]
    assert len(one) == 1 and torch.equal(one.hidden[0], state.hidden[1])
    again = preinfer.BoundaryState.from_dict(state.to_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.to_dict().values(), state.to_dict().values()))
    with pytest.raises(BoundaryStateError, match="unknown"):
        preinfer.BoundaryState.from_dict({**state.to_dict(), "extra": ids})


def test_unsupported_model_names_the_expected_structure():
    with pytest.raises(UnsupportedModelError, match="cannot stage a Linear: expected a transformers causal LM"):
        preinfer.stage(nn.Linear(2, 2))


def test_a_stage_runs_the_layers_with_the_models_own_arguments():
    """The staged run on a stored state (per-row positions, no embedding run before it) equals the live one:
    the arguments each layer gets are rebuilt by the model's own forward from the state alone."""
    model = hf_model("mistral-sliding")
    staged = preinfer.stage(model)
    ids, mask = batch(padded=True)
    with torch.no_grad():
        live = staged.embed(ids, mask)
        stored = preinfer.BoundaryState.from_dict({k: v.clone() for k, v in live.to_dict().items()})
        a = staged.logits(staged.run(live, 0, staged.num_layers))
        b = staged.logits(staged.run(stored, 0, staged.num_layers))
    assert torch.equal(a, b)
