"""Built-in model presets (random initialisation from a seed) and loading a model from a local directory."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedConfig, Qwen2MoeConfig
from transformers.utils import logging as framework_logging

from preinfer.config import DEFAULT_ATTENTION, check_attention
from preinfer.errors import UsageError, first_line
from preinfer.staged import stage

# Where the framework's messages while loading a model (transformers' load report, its warnings) go: logged at
# INFO, which the command line shows with --verbose only.
FRAMEWORK_LOG = logging.getLogger("preinfer.framework")

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


def load_model(spec: str, seed: int = 0, attention: str = DEFAULT_ATTENTION) -> torch.nn.Module:
    """A model from a preset name (float32) or a local directory written by `save_pretrained`, in the dtype its
    weights were saved in (never the network), running the `attention` implementation."""
    path = Path(spec)
    if spec in PRESETS:
        return build_preset(spec, seed, attention)
    if not path.exists():
        raise UsageError(
            f"--model '{spec}' is neither a preset ({', '.join(PRESETS)}) nor an existing local directory"
        )
    if not (path / "config.json").is_file():
        raise UsageError(f"--model directory '{spec}' has no config.json (expected a save_pretrained directory)")
    check_stageable(local_config(spec), spec)
    try:
        with framework_messages():
            model, info = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, attn_implementation=check_attention(attention), dtype="auto", use_safetensors=True,
                output_loading_info=True)
    except (OSError, ValueError, SafetensorError) as err:
        raise UsageError(f"cannot load the model in '{spec}' (safetensors weights only): "
                         f"{first_line(err)}") from None
    missing = [name for name in model.state_dict() if name in info["missing_keys"]]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UsageError(f"the weights in '{spec}' lack {missing[0]}{more}, which {type(model).__name__} needs "
                         f"(a model is never trained with tensors left at random)")
    return model


def check_stageable(config: PreTrainedConfig, spec: str) -> None:
    """Refuse, before any weight is read, a config whose causal LM preinfer cannot stage (it is built on the
    meta device: no memory)."""
    try:
        with framework_messages(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        raise UsageError(f"--model '{spec}': no causal LM for model type '{config.model_type}': "
                         f"{first_line(err)}") from None
    stage(model)


@contextmanager
def framework_messages() -> Iterator[None]:
    """Send what transformers logs (its load report, warnings) to FRAMEWORK_LOG instead of stderr, and hide its
    progress bars; both as they were afterwards."""
    handler = _Forward()
    root = framework_logging.get_logger()
    bars = framework_logging.is_progress_bar_enabled()
    framework_logging.disable_default_handler()
    framework_logging.disable_progress_bar()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        framework_logging.enable_default_handler()
        if bars:
            framework_logging.enable_progress_bar()


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        FRAMEWORK_LOG.info("%s", record.getMessage())


def local_config(spec: str) -> PreTrainedConfig:
    """The config of a preset or of a local model directory, without building the model."""
    if spec in PRESETS:
        return preset_config(spec)
    try:
        with framework_messages():
            return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read a model config from '{spec}': {first_line(err)}") from None
