"""The chunked loss (`preinfer.chunked_loss`) beside torch's own cross entropy: in 16 bits, with a bias, with a hook on
the head's gradient; which loss `use_loss` chooses; and the refusals of `--loss` and `--offload`, one line each,
before a model loads. Its equality with the plain loss on every family: tests/test_families.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import preinfer
from preinfer import chunked_loss
from preinfer.chunked_loss import LinearHead, chunked_loss_sum, shifted_rows
from preinfer.errors import UnsupportedModelError, UsageError
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
    (["--pipeline", "2", "--loss", "chunked"], "--loss chunked ([run] loss): expected auto or plain on a pipeline"),
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
