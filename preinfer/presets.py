"""Built-in model presets: their configs and a model built from a seed, no file read. Reading a model directory's
config is `preinfer.model_config`; loading weights is `pipelines.models`."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedConfig, Qwen2MoeConfig

from preinfer.config import DEFAULT_ATTENTION, check_attention
from preinfer.errors import UsageError

# Vocabulary of the built-in byte-level tokenizer: 256 byte values, then <pad> and <eos>.
BYTE_VOCAB_SIZE = 258
BYTE_PAD_ID, BYTE_EOS_ID = 256, 257

PRESETS: dict[str, tuple[type[PreTrainedConfig], dict]] = {
    "tiny-gpt2": (
        GPT2Config,
        dict(
            vocab_size=BYTE_VOCAB_SIZE, n_positions=512, n_embd=64, n_layer=4, n_head=4,
            # No dropout: a frozen prefix must give the same boundary state live and from a store.
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ),
    ),
    "tiny-llama": (
        LlamaConfig,
        dict(
            vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        ),
    ),
    "small-llama": (
        LlamaConfig,
        dict(
            vocab_size=BYTE_VOCAB_SIZE, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        ),
    ),
    "medium-llama": (
        LlamaConfig,
        dict(
            vocab_size=BYTE_VOCAB_SIZE, hidden_size=384, intermediate_size=1024, num_hidden_layers=12,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        ),
    ),
    # Qwen2-MoE: 8 routed experts (top-2) and a gated shared expert in layers 1 and 3; layers 0 and 2 dense.
    "tiny-moe": (
        Qwen2MoeConfig,
        dict(
            vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            decoder_sparse_step=2,
        ),
    ),
}


def preset_config(name: str, attention: str = DEFAULT_ATTENTION) -> PreTrainedConfig:
    """The Hugging Face config of a preset, in float32 with the `attention` implementation."""
    if name not in PRESETS:
        raise UsageError(f"unknown model preset '{name}'; presets are {', '.join(PRESETS)} (or give a local directory)")
    cls, kwargs = PRESETS[name]
    config = cls(
        **kwargs, tie_word_embeddings=cls is GPT2Config,
        bos_token_id=BYTE_EOS_ID, eos_token_id=BYTE_EOS_ID, pad_token_id=BYTE_PAD_ID,
    )
    config._attn_implementation = check_attention(attention)
    return config


def build_preset(name: str, seed: int = 0, attention: str = DEFAULT_ATTENTION) -> torch.nn.Module:
    """A preset model, randomly initialised from `seed` (the same seed gives the same weights; the attention
    implementation does not change them)."""
    config = preset_config(name, attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float()
