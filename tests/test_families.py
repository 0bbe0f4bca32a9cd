"""Invariant 15: every causal LM family of the installed transformers is staged exactly (invariant 1: embed,
run 0 -> k, run k -> L and logits equal the model's own logits within 1e-5 in float32 at every boundary k, on a
right-padded batch) or refused by `stage` with an UnsupportedModelError naming the family and the reason; a family
that cannot be built tiny is listed with the reason, and really fails to build. A family new to transformers that
is in none of the tables fails `test_every_registry_family_is_in_exactly_one_table`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import preinfer
from preinfer.adapters.hf_head import PLAIN_LOSS
from preinfer.boundary_state import BoundaryState
from preinfer.errors import UnsupportedModelError
from preinfer.staged import IGNORE_INDEX
from preinfer.families import EXACT, REFUSED
from tests.helpers.families import (
    NOT_BUILDABLE, OVERRIDES, TINY_PARAMETERS, VARIANTS, own_logits, tiny_batch, tiny_config, tiny_model,
)

REGISTRY = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

CASES = [(family, variant) for family in REGISTRY if family not in NOT_BUILDABLE
         for variant in [None, *VARIANTS.get(family, {})]]


def test_every_registry_family_is_in_exactly_one_table():
    tables = {"preinfer.families.EXACT": set(EXACT), "preinfer.families.REFUSED": set(REFUSED),
              "tests.helpers.families.NOT_BUILDABLE": set(NOT_BUILDABLE)}
    for family in REGISTRY:
        homes = [name for name, table in tables.items() if family in table]
        assert len(homes) == 1, f"{family} ({REGISTRY[family]}) is in {homes or 'no table'}: add it to one"
    for name, table in tables.items():
        assert table <= set(REGISTRY), f"{name} lists families transformers no longer has: {table - set(REGISTRY)}"
    assert set(VARIANTS) | set(OVERRIDES) <= set(REGISTRY)
    assert all(REFUSED.values()) and all(NOT_BUILDABLE.values())


def assert_composes(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    expected = own_logits(model, ids, mask)
    real = mask.bool()
    staged = preinfer.stage(model)
    with torch.no_grad():
        for k in range(staged.num_layers + 1):
            state = staged.run(staged.run(staged.embed(ids, mask), 0, k), k, staged.num_layers)
            worst = (staged.logits(state)[real] - expected[real]).abs().max().item()
            assert worst <= 1e-5, f"boundary {k}: {worst:.2e} from the model's own logits"


def assert_causal(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The model's own logits at a position do not depend on the tokens after it (a next-token loss is only
    meaningful then; a bidirectional encoder in the registry is refused)."""
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] + 1) % ids.max().item()
    before, after = own_logits(model, ids, mask)[:, :5], own_logits(model, later, mask)[:, :5]
    assert (before - after).abs().max().item() <= 1e-6, "logits depend on later tokens: not causal"


def assert_units_cover_every_parameter(model: torch.nn.Module) -> None:
    """Each parameter is in exactly one unit (a tied weight in the embedding and the head), so that partitions,
    fingerprints and suffix loading see all of them."""
    units = preinfer.stage(model).units()
    owners: dict[int, list[str]] = {}
    for unit in units:
        for p in {id(p): p for p in unit.parameters()}.values():
            owners.setdefault(id(p), []).append(unit.name)
    missing = [n for n, p in model.named_parameters() if id(p) not in owners]
    assert not missing, f"parameters in no unit: {missing[:5]}"
    shared = {tuple(names) for names in owners.values() if len(names) > 1}
    assert shared <= {("embed", "head")}, shared


def assert_chunked_loss_is_the_plain_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Where the head is a LinearHead, the chunked loss (chunks of 4 tokens; padding and a masked span out) and its
    gradients (of the final hidden states and of every head parameter, so of every parameter below too) equal
    torch's cross entropy of the logits the model's own forward makes of those states (the composition check above
    ties them to its logits from the tokens) and its gradients, float32, 1e-6; elsewhere the family is one
    PLAIN_LOSS names, or its head is no nn.Linear. Only the head runs with autograd: the walk stays cheap."""
    staged = preinfer.stage(model)
    head = staged.linear_head()
    if isinstance(head, str):
        assert staged.family in PLAIN_LOSS or "nn.Linear" in head, head
        return
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[0, 2:4] = IGNORE_INDEX
    with torch.no_grad():
        out = staged.run(staged.embed(ids, mask, labels), 0, staged.num_layers)
    state = BoundaryState(out.hidden.detach().requires_grad_(), out.attention_mask, out.position_ids, labels)
    wrt = [state.hidden, *{id(p): p for m in staged.head_modules() for p in m.parameters()}.values()]
    logits = staged.logits(state)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    own = torch.autograd.grad(expected, wrt, allow_unused=True)
    assert staged.use_loss("chunked", chunk=4) == "chunked"
    loss = staged.loss(state)
    ours = torch.autograd.grad(loss, wrt, allow_unused=True)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert [g is None for g in ours] == [g is None for g in own]
    torch.testing.assert_close([g for g in ours if g is not None], [g for g in own if g is not None], rtol=1e-6,
                               atol=1e-6)


def assert_embedding_and_head_are_apart(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The boundary-0 state does not depend on the head's own parameters, nor the logits of a state on the
    embedding's (so fingerprints, partitions and suffix loading put each module where the forward uses it)."""
    staged = preinfer.stage(model)
    embed = {id(p) for m in staged.embed_modules() for p in m.parameters()}
    head = {id(p) for m in staged.head_modules() for p in m.parameters()}
    with torch.no_grad():
        state = staged.embed(ids, mask)
        logits = staged.logits(staged.run(state, 0, staged.num_layers))
        head_only = [p for p in model.parameters() if id(p) in head and id(p) not in embed]
        kept = [p.clone() for p in head_only]
        for p in head_only:
            p.add_(0.5)
        assert torch.equal(staged.embed(ids, mask).hidden, state.hidden), "a head module runs before the layers"
        for p, value in zip(head_only, kept):
            p.copy_(value)
        for p in model.parameters():
            if id(p) in embed and id(p) not in head:
                p.add_(0.5)
        again = staged.logits(staged.run(state, 0, staged.num_layers))
        assert torch.equal(again, logits), "an embedding module runs after the embedding"


@pytest.mark.slow
@pytest.mark.parametrize("family,variant", CASES, ids=[f"{f}-{v}" if v else f for f, v in CASES])
def test_family_is_exact_or_refused(family, variant):
    model = tiny_model(family, variant)
    ids, mask = tiny_batch()
    if family in REFUSED:
        with pytest.raises(UnsupportedModelError) as refused:
            preinfer.stage(model)
        assert family in str(refused.value) and REFUSED[family] in str(refused.value)
        return
    assert_causal(model, ids, mask)
    assert_composes(model, ids, mask)
    assert_units_cover_every_parameter(model)
    assert_embedding_and_head_are_apart(model, ids, mask)
    assert_chunked_loss_is_the_plain_loss(model, ids, mask)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(NOT_BUILDABLE))
def test_not_buildable_families_really_fail_to_build_tiny(family):
    """Building the tiny config fails, gives more than TINY_PARAMETERS parameters (counted on the meta device),
    or its own forward fails on the tiny batch."""
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config(family)).parameters())
        if size > TINY_PARAMETERS:
            return
        model = tiny_model(family)
        own_logits(model, *tiny_batch())
    except Exception:  # noqa: BLE001 - any failure to build is what the table claims
        return
    pytest.fail(f"{family} builds tiny ({size} parameters) and runs: move it out of NOT_BUILDABLE")


def test_an_unknown_family_is_refused_in_one_line():
    model = tiny_model("llama")
    model.config.model_type = "llama-next"
    with pytest.raises(UnsupportedModelError, match=r"cannot stage a LlamaForCausalLM \(llama-next\): not a family verified"):
        preinfer.stage(model)


def test_the_supported_families_section_of_the_docs_is_up_to_date():
    from pipelines.families_doc import DOC, rendered

    text = DOC.read_text()
    assert rendered(text) == text, "rebuild it: PYTHONPATH=$PWD python -m pipelines.families_doc"


def test_the_readme_model_line_is_up_to_date_and_names_only_exact_families():
    from pipelines.families_doc import KNOWN, README, readme_line, rendered

    text = README.read_text()
    assert rendered(text, readme_line, README) == text, "rebuild it: PYTHONPATH=$PWD python -m pipelines.families_doc"
    line = " ".join(readme_line().split())
    assert f"checkpoints of {len(EXACT)} model families" in line
    named = line.split(": ", 1)[1].split(" and ")[0].split(", ")
    assert named and {family for family, name in KNOWN.items() if name in named} <= set(EXACT)
    assert len(named) == len({family for family in KNOWN if family in EXACT})
