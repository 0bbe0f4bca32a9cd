"""The prefix digest changes exactly when something the boundary state depends on changes."""

import torch

import preinfer
from preinfer.fingerprint import boundary_fingerprint, prefix_digest
from preinfer.presets import build_preset


def test_prefix_digest_follows_prefix_weights_only():
    staged = preinfer.stage(build_preset("tiny-llama"))
    before = {k: prefix_digest(staged, k) for k in range(staged.num_layers + 1)}
    with torch.no_grad():
        staged.layers[2].mlp.down_proj.weight[0, 0] += 1e-3
    after = {k: prefix_digest(staged, k) for k in range(staged.num_layers + 1)}
    assert [before[k] == after[k] for k in before] == [True, True, True, False, False]


def test_tied_weight_enters_every_prefix():
    staged = preinfer.stage(build_preset("tiny-gpt2"))
    before = prefix_digest(staged, 1)
    with torch.no_grad():
        staged.model.lm_head.weight[3, 1] += 1.0  # the same tensor as transformer.wte.weight
    assert prefix_digest(staged, 1) != before


def test_prefix_digest_is_reproducible_and_equal_for_equal_weights():
    a = preinfer.stage(build_preset("tiny-llama", seed=0))
    b = preinfer.stage(build_preset("tiny-llama", seed=0))
    c = preinfer.stage(build_preset("tiny-llama", seed=1))
    assert prefix_digest(a, 2) == prefix_digest(b, 2) != prefix_digest(c, 2)


def test_boundary_fingerprint_covers_every_part():
    base = dict(prefix="p", boundary=2, dataset="d", tokenizer="t", seq_len=128, dtype="float32", attention="sdpa")
    digest, parts = boundary_fingerprint(**base, model="tiny-llama")
    assert parts["model"] == "tiny-llama" and parts["boundary"] == 2
    assert boundary_fingerprint(**base, model="renamed")[0] == digest
    for key, other in [("prefix", "q"), ("boundary", 3), ("dataset", "e"), ("tokenizer", "u"),
                       ("seq_len", 64), ("dtype", "bfloat16"), ("attention", "eager")]:
        assert boundary_fingerprint(**{**base, key: other})[0] != digest, key


def test_adapter_identity_enters_the_prefix_digest():
    """The same weights staged by another adapter (or another version of it) give another digest."""
    staged = preinfer.stage(build_preset("tiny-llama"))
    before = prefix_digest(staged, 2)
    assert staged.identity.startswith("hf/llama/")
    staged.family = "llama-renamed"
    assert prefix_digest(staged, 2) != before
