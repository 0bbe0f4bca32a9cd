"""Which transformers causal LM families `stage` accepts (staged exactly by `preinfer.adapters.hf`) and which it
refuses, with the reason; tests/test_families.py walks transformers' registry and checks every entry against the
model's own logits."""

from __future__ import annotations

from torch import nn

from preinfer.errors import UnsupportedModelError
from preinfer.staged import SequentialLM, StagedModel

EXACT: frozenset[str] = frozenset({
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "bart", "beam", "biogpt", "bitnet", "blenderbot",
    "blenderbot-small", "bloom", "codegen", "cohere", "cohere2", "cohere2_moe", "ctrl", "cwm", "diffllama", "doge",
    "ergo", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon", "falcon_h1", "falcon_mamba",
    "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe", "gpt-sw3", "gpt2",
    "gpt_bigcode", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe",
    "granitemoe_swa", "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax",
    "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba", "jetmoe", "kimi_linear", "kolibri1", "laguna",
    "lara_mini", "lfm2", "lfm3", "llama", "llama4_text", "mamba", "marian", "mbart", "mellum", "mimo_v2_flash",
    "minicpm5_moe", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral",
    "modernbert-decoder", "moshi", "mpt", "mvp", "nanochat", "nemotron", "nemotron_h", "olmo", "olmo2", "olmo3",
    "olmo_hybrid", "olmoe", "opt", "param2moe", "pegasus", "persimmon", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text",
    "recurrent_gemma", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "trocr",
    "vaultgemma", "xglm",
})

ENCODER = "its attention is bidirectional (an encoder): a next-token loss would see the tokens it predicts"

REFUSED: dict[str, str] = {
    "bert": ENCODER,
    "bert-generation": ENCODER,
    "big_bird": ENCODER,
    "camembert": ENCODER,
    "data2vec-text": ENCODER,
    "ernie": ENCODER,
    "megatron-bert": ENCODER,
    "roberta": ENCODER,
    "roberta-prelayernorm": ENCODER,
    "roc_bert": ENCODER,
    "xlm-roberta": ENCODER,
    "xlm-roberta-xl": ENCODER,
    "bigbird_pegasus": "its layernorm_embedding is not where its name says, so embedding and head are not told apart",
    "cpmant": "its forward needs the token ids at every layer, so it cannot resume from hidden states",
    "deepseek_v4": "its layers pass several residual streams (hyper-connections) to each other, not hidden states",
    "dory": "its forward runs its recurrent layers more than once (looped layers)",
    "electra": "an embedding projection (embeddings_project) runs between its embeddings and its layers",
    "hrm_text": "it has no single list of decoder layers (hierarchical recurrent modules)",
    "hy_v4": "its layers hand a second state to the next layer besides the hidden states",
    "inkling2_loop_text": "its forward carries state across its decoder layers besides the hidden states",
    "inkling2_text": "its forward carries state across its decoder layers besides the hidden states",
    "kolibri1_1": "its layers hand an index pool to the next layer besides the hidden states",
    "openai-gpt": "its forward reads its layers' parameters while building their arguments",
    "rembert": "an embedding projection (embeddings_project) runs between its embeddings and its layers",
    "roformer": "its layers take position embeddings computed by an embedding module (embed_positions)",
    "rwkv": "its blocks return their recurrent state with the hidden states",
    "xlm": "its forward applies norms and padding masks of its own between its layers",
    "xlstm": "its blocks return their recurrent state with the hidden states",
}


def stage(model: nn.Module) -> StagedModel:
    """The staged view of `model`: a transformers causal LM of an EXACT family, or an
    `nn.Sequential(nn.Embedding, layers..., head)`; UnsupportedModelError naming the family and why otherwise."""
    if isinstance(model, nn.Sequential) and len(model) >= 3 and isinstance(model[0], nn.Embedding):
        return SequentialLM(model)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from preinfer.adapters.hf import HFCausalLM

    family = getattr(getattr(model, "config", None), "model_type", None)
    kind = type(model).__name__
    if family is None:
        raise UnsupportedModelError(f"cannot stage a {kind}: expected a transformers causal LM or "
                                    "nn.Sequential(nn.Embedding, layers..., head)")
    if family in REFUSED:
        raise UnsupportedModelError(f"cannot stage a {kind} ({family}): {REFUSED[family]}")
    if family not in EXACT or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family) != kind:
        raise UnsupportedModelError(f"cannot stage a {kind} ({family}): not a family verified to stage exactly "
                                    f"(supported: docs/concepts.md#supported-families)")
    return HFCausalLM(model, family)
