"""The LM head of a Hugging Face causal LM as a `LinearHead`: its output embeddings (one `nn.Linear`) and the terms
its forward applies to their output, which the chunked loss (`preinfer.chunked_loss`) computes chunk by chunk.

`HEAD_TERMS` names, per family, the config fields its forward applies after the LM head and how, in the order the
forward applies them (a field set to None applies nothing); a family not listed applies none. `PLAIN_LOSS` lists the
families whose head is not that (the plain loss computes theirs from the model's own logits), with the reason.
tests/test_families.py checks, for every family of the walk, that the chunked loss equals the cross entropy of the
model's own logits and its gradients (float32, 1e-6), so a family with a term missing here fails there.
"""

from __future__ import annotations

from torch import nn

from preinfer.chunked_loss import LinearHead, Term
from preinfer.errors import UnsupportedModelError

SOFTCAP = (("softcap", "final_logit_softcapping"),)
LOGIT_SCALE = (("mul", "logit_scale"),)
GRANITE = (("div", "logits_scaling"),)

HEAD_TERMS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "beam": (("float", None), *SOFTCAP),
    "cohere": LOGIT_SCALE, "cohere2": LOGIT_SCALE, "cohere2_moe": LOGIT_SCALE,
    "falcon_h1": (("mul", "lm_head_multiplier"),),
    "gemma2": SOFTCAP, "gemma3_text": SOFTCAP, "nanochat": SOFTCAP, "vaultgemma": SOFTCAP,
    "granite": GRANITE, "granite_swa": GRANITE, "granitemoe": GRANITE, "granitemoe_swa": GRANITE,
    "granitemoeshared": GRANITE,
    "hyperclovax": (("mul", "logits_scaling"),),
    "recurrent_gemma": (("softcap", "logits_soft_cap"),),
}

PLAIN_LOSS: dict[str, str] = {}


def linear_head(model: nn.Module, family: str) -> LinearHead | str:
    """The family's head as a `LinearHead`, or why it is not one (the plain loss then computes it)."""
    if family in PLAIN_LOSS:
        return PLAIN_LOSS[family]
    output = model.get_output_embeddings()
    if type(output) is not nn.Linear:
        return f"its output embeddings are a {type(output).__name__}, not one nn.Linear"
    config = model.config.get_text_config()
    terms: list[Term] = []
    for op, name in HEAD_TERMS.get(family, ()):
        value = 0.0 if name is None else getattr(config, name, None)
        if value is not None:
            terms.append((op, float(value)))
    return LinearHead(output.weight, output.bias, tuple(terms))


def output_slot(model: nn.Module) -> tuple[nn.Module, str]:
    """(parent, attribute name) of the model's output embeddings."""
    output = model.get_output_embeddings()
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child is output:
                return module, child_name
    raise UnsupportedModelError(f"{type(model).__name__}: its output embeddings are no child module of the model, "
                                "so its head cannot run chunk by chunk; use --loss plain")
