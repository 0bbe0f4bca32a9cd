"""The chunked loss (`preinfer.chunked_loss`) beside torch's own cross entropy: in 16 bits, with a bias, with a hook on
the head's gradient, on a pipeline's last stage and on a suffix trained from a store; which loss `use_loss` chooses;
and the refusals of `--loss` and `--offload`, one line each, before a model loads. Its equality with the plain loss
on every family: tests/test_families.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

import preinfer
from pipelines.pipeline_parallel.stage_module import StageModule
from pipelines.store_training import StoreSuffix
from preinfer import chunked_loss
from preinfer.chunked_loss import LinearHead, chunked_loss_sum, shifted_rows
from preinfer.errors import UnsupportedModelError, UsageError
from preinfer.memory.layer_spans import LayerSpan
from preinfer.partition import make_partition
from preinfer.presets import preset_config
from preinfer.staged import IGNORE_INDEX, causal_lm_loss
from tests.helpers.cli_run import failure_line, run_cli, tree
from tests.helpers.trainers import make_trainer, snapshot


def _head(dtype: torch.dtype, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(16, 50, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype,bias,tolerance", [(torch.float32, True, 1e-6), (torch.bfloat16, False, 2e-2)])
def test_chunked_equals_torchs_cross_entropy_and_its_gradients(dtype, bias, tolerance):
    """Ragged chunks of 7 over 3 rows of 9 positions, padding masked: the summed loss, the input's, weight's and
    bias's gradients equal those of torch's cross entropy of the whole logits (bf16: to its rounding)."""
    head = _head(dtype, bias)
    hidden = torch.randn(3, 9, 16, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (3, 9))
    labels[1, 5:] = IGNORE_INDEX
    expected = causal_lm_loss(head(hidden), labels, reduction="sum")
    wanted = torch.autograd.grad(expected, [hidden, *head.parameters()])
    features, targets = shifted_rows(hidden, labels)
    loss = chunked_loss_sum(features, LinearHead(head.weight, head.bias), targets, chunk=7)
    got = torch.autograd.grad(loss, [hidden, *head.parameters()])
    torch.testing.assert_close(loss, expected, rtol=tolerance, atol=tolerance)
    for ours, theirs in zip(got, wanted):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


def test_the_terms_are_the_models_own_ops_in_order():
    logits = torch.randn(4, 6) * 10
    head = LinearHead(torch.eye(6), terms=(("mul", 2.0), ("div", 8.0), ("softcap", 3.0)))
    expected = torch.tanh(logits * 2.0 / 8.0 / 3.0) * 3.0
    assert torch.equal(head.logits(logits), expected)


def test_the_heads_gradient_arrives_once_per_backward_whatever_the_chunks():
    """A hook on the head weight's gradient (the fused step, mixed precision's masters, the data-parallel
    reducer) fires once per backward, with the whole gradient."""
    head = _head(torch.float32, bias=False)
    calls = []
    head.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    hidden = torch.randn(2, 8, 16)
    labels = torch.randint(0, 50, (2, 8))
    chunked_loss_sum(*_rows(hidden, labels, head), chunk=3).backward()
    assert len(calls) == 1
    expected = torch.autograd.grad(causal_lm_loss(head(hidden), labels, reduction="sum"), head.weight)[0]
    torch.testing.assert_close(calls[0], expected, rtol=1e-6, atol=1e-6)


def _rows(hidden, labels, head):
    features, targets = shifted_rows(hidden, labels)
    return features, LinearHead(head.weight), targets


def _suffix_case(name: str):
    """A float32 preset (tiny-gpt2's head tied to its embedding), boundary states at layer 2 of 3 rows x 10
    positions (padding, a masked span) and their labels, and a second copy of the model for the reference."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(preset_config(name, "sdpa")).train())
    draws = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 10, models[0].config.get_text_config().hidden_size, generator=draws)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[2, 7:] = False
    labels = torch.randint(0, 258, (3, 10), generator=draws)
    labels[~mask] = IGNORE_INDEX
    labels[0, 2:5] = IGNORE_INDEX
    return models, hidden, mask, labels


def _trained_above(staged, boundary: int):
    """The one block from `boundary` on and the head, the only parameters requiring grad (as `StoreSuffix`)."""
    block = make_partition(staged, num_blocks=1, first_layer=boundary).blocks[0]
    staged.model.requires_grad_(False)
    for param in block.params:
        param.requires_grad_(True)
    return block


def _torchs_loss_and_gradients(model, hidden, mask, labels, boundary: int):
    """Torch's own cross entropy of the model's whole logits over layers [boundary, L) and the head (the plain
    path: `StagedModel.logits`), summed, and its gradients of the input and of every parameter requiring one."""
    staged = preinfer.stage(model)
    staged.use_loss("plain")
    block = _trained_above(staged, boundary)
    x = hidden.clone().requires_grad_()
    module = StageModule(staged, LayerSpan(boundary, staged.num_layers, False, True), block, source=boundary)
    logits = module(x, mask)
    assert logits.shape[-1] == model.config.vocab_size
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, torch.autograd.grad(loss, [x, *params])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_pipelines_last_stage_computes_the_chunked_loss_as_torch_does(name):
    """The last stage's module sends the head's features (not the logits) to the stage's loss, which equals torch's
    cross entropy of the whole logits, as do the gradients of the stage's input and of its layers and head
    (float32, 1e-6, chunks of 7 tokens)."""
    (model, reference), hidden, mask, labels = _suffix_case(name)
    staged = preinfer.stage(model)
    assert staged.use_loss("auto", 7) == "chunked"
    block = _trained_above(staged, 2)
    x = hidden.clone().requires_grad_()
    module = StageModule(staged, LayerSpan(2, staged.num_layers, False, True), block, source=2)
    output = module(x, mask)
    assert output.shape == hidden.shape  # features, not [rows, tokens, vocab] logits
    loss = staged.output_loss_sum(output, labels)
    got = torch.autograd.grad(loss, [x, *[p for p in model.parameters() if p.requires_grad]])
    expected, wanted = _torchs_loss_and_gradients(reference, hidden, mask, labels, 2)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert len(got) == len(wanted) > 2
    for ours, theirs in zip(got, wanted):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_suffix_trained_from_a_store_computes_the_chunked_loss_as_torch_does(name):
    """`load_store_suffix`'s module (`StoreSuffix`, loss auto: chunked) on a store's batch: its mean loss and the
    gradients of what it trains equal those of torch's cross entropy of the whole logits (float32, 1e-6)."""
    (model, reference), hidden, mask, labels = _suffix_case(name)
    suffix = StoreSuffix(model, 2, loss_chunk=7)
    assert suffix.staged.loss_kind == "chunked"
    batch = dict(hidden=hidden, attention_mask=mask, position_ids=torch.arange(10).expand(3, 10), labels=labels)
    loss = suffix(batch)
    got = torch.autograd.grad(loss, suffix.trainable_parameters())
    expected, wanted = _torchs_loss_and_gradients(reference, hidden, mask, labels, 2)
    tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss, expected / tokens, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(got, wanted[1:]):
        torch.testing.assert_close(ours, theirs / tokens, rtol=1e-6, atol=1e-6)


def test_use_loss_chooses_chunked_where_the_head_is_linear_and_refuses_it_elsewhere():
    linear = preinfer.stage(nn.Sequential(nn.Embedding(10, 4), nn.Identity(), nn.Linear(4, 10)))
    assert linear.use_loss("auto") == "chunked" and linear.use_loss("plain") == "plain"
    other = preinfer.stage(nn.Sequential(nn.Embedding(10, 4), nn.Identity(), nn.Sequential(nn.Linear(4, 10))))
    assert other.use_loss("auto") == "plain"
    with pytest.raises(UnsupportedModelError, match=r"^--loss chunked: .* computes its loss from the whole logits "
                                                    r"only: its head is not one nn.Linear; use --loss plain or auto$"):
        other.use_loss("chunked")


def test_a_chunked_run_ends_where_a_plain_one_does():
    """Two visits of 3 steps with the head in the last block, the chunked loss (chunks of 8 tokens) and the
    plain one: the same weights to float32 rounding."""
    runs = {}
    for loss in ("chunked", "plain"):
        trainer = make_trainer(run__loss=loss, run__loss_chunk=8)
        trainer.fit()
        assert trainer.staged.loss_kind == loss
        runs[loss] = snapshot(trainer.staged.model)
    for name, weight in runs["plain"].items():
        torch.testing.assert_close(runs["chunked"][name], weight, rtol=1e-5, atol=1e-6)


def test_the_liger_seam_refuses_in_one_line_without_the_extra(monkeypatch):
    monkeypatch.setattr(chunked_loss, "liger_installed", lambda: False)
    head = LinearHead(torch.randn(50, 16))
    with pytest.raises(UsageError, match=r"^--loss liger needs liger-kernel, which is not installed: pip install "
                                         r"preinfer\[liger\]$"):
        chunked_loss.liger_loss_sum(torch.randn(3, 16), head, torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("flags,expected", [
    (["--loss", "liger"], "[run] loss"),
    (["--offload"], "--offload True ([run] offload): expected false unless --recompute is true"),
    (["--pipeline", "2", "--loss", "liger"], "[run] loss"),
    (["--loss-chunk", "0"], "--loss-chunk"),
])
def test_bad_loss_flags_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, flags, expected):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--model", "tiny-llama", "--out", str(out), *flags], capsys)
    line = failure_line(err)
    assert code == 2 and tree(out) == {}
    if flags[:2] == ["--loss", "liger"]:
        assert "liger needs liger-kernel, which is not installed (pip install preinfer[liger])" in line
    else:
        assert expected in line


def test_plan_refuses_offload_without_recompute(capsys):
    code, _, err = run_cli(["plan", "--model", "llama3-8b", "--offload"], capsys)
    assert code == 2 and failure_line(err).endswith("--offload needs --recompute (it offloads recomputation's "
                                                    "checkpoints)")
