"""A whole model from a preset (built from its seed) or a local `save_pretrained` directory (its safetensors
weights, never the network), refused when the weights lack a tensor the model needs."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from torch import nn
from transformers import AutoModelForCausalLM

from preinfer.config import DEFAULT_ATTENTION, check_attention
from preinfer.errors import UsageError, first_line
from preinfer.model_config import check_stageable, framework_messages, local_config
from preinfer.presets import PRESETS, build_preset


def load_model(spec: str, seed: int = 0, attention: str = DEFAULT_ATTENTION) -> nn.Module:
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
