"""The one table of tiny configs for every causal LM family of transformers' registry (tests/test_families.py):
the generic tiny sizes, the overrides a family needs to build tiny, the variant configs that switch its optional
model-level terms on, and the families that cannot be built tiny, with the reason."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, CONFIG_MAPPING, PreTrainedConfig

VOCAB = 128

# Applied where the family's config has the field.
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, moe_intermediate_size=16, num_experts=4,
    num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, shared_expert_intermediate_size=16,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
)

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]

# family -> fields that replace (or, as None, drop) the generic ones.
OVERRIDES: dict[str, dict] = {
    "falcon": dict(head_dim=None),
    "gptj": dict(rotary_dim=4),
    "codegen": dict(rotary_dim=4),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=16),
    "kolibri1_1": dict(head_dim=16, layer_types=["sliding_attention", "indexed_attention", "sliding_attention"],
                       index_layers=[1], kv_source_layers=[0, 1, 2], index_num_heads=2, sliding_window=4, index_topk=4,
                       index_pool_size=32, index_compression=4, index_num_local_tokens=2, index_num_sink_tokens=1),
    "kimi_linear": dict(linear_head_dim=8, linear_num_heads=4, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4),
}

# family -> {variant name: fields on top of the family's tiny config}: the optional model-level terms switched on.
VARIANTS: dict[str, dict[str, dict]] = {
    "llama": {"llama3-rope": dict(rope_parameters=LLAMA3_ROPE),
              "linear-rope": dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))},
    "mistral": {"sliding": dict(sliding_window=4)},
    "mixtral": {"sliding": dict(sliding_window=4)},
    "qwen2": {"sliding": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)},
    "granite": {"multipliers": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.5,
                                    attention_multiplier=0.1)},
    "granitemoe": {"multipliers": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.5,
                                       attention_multiplier=0.1)},
    "gemma2": {"soft-capping": dict(final_logit_softcapping=3.0, attn_logit_softcapping=5.0, sliding_window=4)},
    "gemma3_text": {"sliding": dict(sliding_window=4, layer_types=ALTERNATING, final_logit_softcapping=3.0,
                                    attn_logit_softcapping=5.0)},
    "vaultgemma": {"soft-capping": dict(final_logit_softcapping=3.0, attn_logit_softcapping=5.0, sliding_window=4,
                                        layer_types=ALTERNATING)},
    "cohere": {"logit-scale": dict(logit_scale=4.0)},
    "cohere2": {"logit-scale": dict(logit_scale=4.0, sliding_window=4, layer_types=ALTERNATING)},
    "olmo3": {"sliding": dict(sliding_window=4, layer_types=ALTERNATING)},
    "gpt_oss": {"sliding": dict(sliding_window=4, layer_types=ALTERNATING)},
    "phi3": {"longrope": dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                   short_factor=[1.0] * 4, long_factor=[2.0] * 4),
                              original_max_position_embeddings=16)},
    "falcon": {"new-architecture": dict(new_decoder_architecture=True, num_kv_heads=2),
               "alibi": dict(alibi=True)},
    "stablelm": {"qk-norm": dict(qk_layernorm=True, use_parallel_residual=True)},
    "smollm3": {"no-rope-layers": dict(no_rope_layers=[1, 0, 1])},
}

TINY_PARAMETERS = 20_000_000  # more from the tiny config (counted on the meta device): not buildable tiny
BIG = f"the generic tiny sizes leave a full-size part (vision, audio or expert towers): over {TINY_PARAMETERS} parameters"
ARCH = "its config validates a per-layer architecture that the generic tiny sizes do not meet"
OUT_OF_VOCAB = "its config keeps a token id outside the tiny vocabulary"
HEADS = "its attention needs head sizes of its own (latent attention, partial rotary) that the generic head_dim breaks"
PER_LAYER = "its config holds per-layer sizes that the generic tiny sizes cannot set"
OWN_HEADS = "its config sets a head count of its own that the tiny hidden size does not divide"

# family -> why a tiny random config of it cannot be built (checked: building it fails, or is not tiny).
NOT_BUILDABLE: dict[str, str] = {
    "axk1": HEADS,
    "axk2": HEADS,
    "bailing_hybrid": HEADS,
    "bamba": ARCH,
    "blt": BIG,
    "cohere_compass_text": "its tiny config fails: KeyError: 'full_attention'",
    "dbrx": "its tiny config fails: AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "deepseek_v2": HEADS,
    "deepseek_v3": HEADS,
    "deepseek_v32": HEADS,
    "dots1": "its tiny config fails: TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'",
    "dots3_note": BIG,
    "dots3_note_text": PER_LAYER,
    "emu3": BIG,
    "fuyu": BIG,
    "gemma3": BIG,
    "gemma3n": "its tiny config fails: ImportError: ",
    "gemma3n_text": "its tiny config fails: ValueError: The set of layer types producing a cache is different than the set o",
    "gemma4": BIG,
    "gemma4_assistant": ARCH,
    "gemma4_text": PER_LAYER,
    "gemma4_unified": BIG,
    "gemma4_unified_assistant": BIG,
    "gemma4_unified_text": PER_LAYER,
    "git": BIG,
    "glm4_moe_lite": HEADS,
    "glm_moe_dsa": HEADS,
    "got_ocr2": BIG,
    "gpt_neo": ARCH,
    "granitemoehybrid": ARCH,
    "lfm2_moe": "its tiny config fails: TypeError: 'NoneType' object is not subscriptable",
    "llama4": BIG,
    "longcat_flash": HEADS,
    "mamba2": ARCH,
    "minicpm3": HEADS,
    "mllama": BIG,
    "moss_transcribe_diarize": BIG,
    "musicgen": "its tiny config fails: AttributeError: 'MusicgenConfig' object has no attribute 'dropout'",
    "musicgen_melody": "its tiny config fails: AttributeError: 'MusicgenMelodyConfig' object has no attribute 'dropout'",
    "phi4_multimodal": BIG,
    "plbart": OWN_HEADS,
    "prophetnet": "its tiny config fails: NotImplementedError: This model does not support the setting of num_hidden_layer",
    "qwen3_5": BIG,
    "qwen3_5_moe": BIG,
    "qwen4_exp": BIG,
    "reformer": "its tiny config fails: AssertionError: If you want to use ReformerModelWithLMHead make sure that is_dec",
    "sarvam_mla": HEADS,
    "whisper": OWN_HEADS,
    "xlnet": "its tiny config fails: NotImplementedError: The model xlnet is one of the few models that has no sequen",
    "xmod": "its tiny config fails: ValueError: Input language unknown. Please call XmodPreTrainedModel.set_default_",
    "youtu": HEADS,
    "zamba": "its tiny config fails: ValueError: There is an issue with your definition of tie_weights_keys for ^laye",
    "zamba2": ARCH,
    "zaya": ARCH,
}


def tiny_config(family: str, variant: str | None = None) -> PreTrainedConfig:
    """The family's tiny config (eager attention), with `variant`'s fields on top."""
    cls = CONFIG_MAPPING[family]
    default = cls()
    fields = {k: v for k, v in TINY.items() if hasattr(default, k)}
    fields.update(OVERRIDES.get(family, {}))
    fields.update(VARIANTS.get(family, {}).get(variant, {}) if variant else {})
    config = cls(**{k: v for k, v in fields.items() if v is not None})
    config._attn_implementation = "eager"
    return config


def tiny_model(family: str, variant: str | None = None) -> torch.nn.Module:
    """The family's tiny causal LM with seeded random weights, in float32 eval mode."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, variant)).float().eval()


def tiny_batch(seq: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of token ids, the second and third right-padded, and their attention mask."""
    ids = torch.randint(3, VOCAB, (3, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, seq, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids, mask


def own_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's own forward, with no cache (as training runs it)."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
