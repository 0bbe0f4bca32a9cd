"""8-bit Adam and AdamW: quantized moments, steps close to torch's AdamW, and a state that resumes bit for bit
through the project's checkpoint."""

import sys

import pytest
import torch
from torch import nn

from preinfer import low_bit
from preinfer.checkpoint import load_checkpoint, save_checkpoint
from preinfer.config import Config, rules
from preinfer.errors import UsageError
from preinfer.low_bit import low_bit_adam
from preinfer.presets import build_preset
from tests.helpers.resume import halted_and_resumed, same_weights
from tests.helpers.trainers import snapshot


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 64), nn.LayerNorm(64))


def train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()


def test_large_tensors_get_8bit_moments_and_small_ones_float32():
    net = model()
    optimizer = low_bit_adam(net.parameters(), "adamw8bit", 1e-3, (0.9, 0.999), 0.01)
    train(net, optimizer, range(1))
    state = optimizer.state_dict()["state"]
    assert state[0]["exp_avg.codes"].dtype == torch.uint8 and state[0]["exp_avg.codes"].shape == (64, 128)
    assert state[0]["exp_avg_sq.scale"].shape == (64 * 128 // 256,) and state[0]["exp_avg.signed"] is True
    assert state[1]["exp_avg"].dtype == torch.float32  # 64 elements: below 4096


@pytest.mark.parametrize("name, reference", [("adam8bit", torch.optim.Adam), ("adamw8bit", torch.optim.AdamW)])
def test_steps_are_torchs_within_the_quantization_error(name, reference):
    ours, theirs = model(), model()
    start = [p.detach().clone() for p in ours.parameters()]
    train(ours, low_bit_adam(ours.parameters(), name, 1e-3, (0.9, 0.999), 0.01), range(5))
    train(theirs, reference(theirs.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01), range(5))
    for p, q, p0 in zip(ours.parameters(), theirs.parameters(), start):
        assert float((p - q).detach().norm() / (q - p0).detach().norm()) < 0.05


def test_a_large_tensor_steps_in_chunks_with_torchaos_one_call_result_bit_for_bit(monkeypatch):
    """Chunks of whole quantization blocks (the last one shorter) give the weights and 8-bit moments of torchao's
    `single_param_adam` over the whole tensor, step after step."""
    from torchao.optim import adam

    monkeypatch.setattr(low_bit, "CHUNK", 4096)
    calls = []
    one_call = adam.single_param_adam
    monkeypatch.setattr(adam, "single_param_adam", lambda p, *a: calls.append(p.numel()) or one_call(p, *a))
    torch.manual_seed(0)
    ours = nn.Parameter(torch.randn(64, 160))  # 10,240 elements: chunks of 4096, 4096 and 2048
    theirs = ours.detach().clone()
    optimizer = low_bit_adam([ours], "adamw8bit", 1e-3, (0.9, 0.999), 0.01)
    group = optimizer.param_groups[0]
    for step in range(3):
        ours.grad = torch.randn(64, 160, generator=torch.Generator().manual_seed(step))
        optimizer.step()
        state = optimizer.state[ours]
        if step == 0:
            moments = [optimizer._new_buffer(theirs, signed) for signed in (True, False)]
        one_call(theirs, ours.grad, state["step"], *moments, None, group["lr"], 0.9, 0.999, 0.01, group["eps"],
                 True, False)
        assert torch.equal(ours.detach(), theirs)
        for mine, reference in zip((state["exp_avg"], state["exp_avg_sq"]), moments):
            assert torch.equal(mine.codes, reference.codes) and torch.equal(mine.scale, reference.scale)
    assert calls == [4096, 4096, 2048] * 3


def test_the_rate_is_a_float_a_schedule_sets():
    net = model()
    optimizer = low_bit_adam(net.parameters(), "adam8bit", 1e-3, (0.9, 0.999), 0.0)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in net.parameters()]
    train(net, optimizer, range(2))
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.0


def test_the_state_resumes_bit_for_bit_through_a_checkpoint(tmp_path):
    straight = model()
    optimizer = low_bit_adam(straight.parameters(), "adamw8bit", 1e-3, (0.9, 0.999), 0.01)
    train(straight, optimizer, range(3))
    save_checkpoint(tmp_path / "checkpoint", straight, {0: optimizer.state_dict()}, {"global_step": 3})
    train(straight, optimizer, range(3, 6))

    resumed = model(seed=1)
    saved = load_checkpoint(tmp_path / "checkpoint", resumed)
    again = low_bit_adam(resumed.parameters(), "adamw8bit", 1e-3, (0.9, 0.999), 0.01)
    again.load_state_dict(saved.optimizers[0])
    train(resumed, again, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    ours, theirs = again.state_dict()["state"], optimizer.state_dict()["state"]
    assert all(torch.equal(ours[i][k], v) for i in theirs for k, v in theirs[i].items() if torch.is_tensor(v))


def test_unknown_names_are_refused():
    with pytest.raises(UsageError, match="'adam4bit' is not one of adam8bit, adamw8bit"):
        low_bit_adam(model().parameters(), "adam4bit", 1e-3, (0.9, 0.999), 0.0)


def test_a_missing_torchao_is_refused_by_the_config_in_one_line(monkeypatch):
    monkeypatch.setattr(rules, "torchao_installed", lambda: False)
    config = Config()
    config.optim.name = "adamw8bit"
    config.stop.steps_per_visit = 1
    with pytest.raises(UsageError, match=r"^\[optim\] name = 'adamw8bit': expected sgd, adam or adamw: its 8-bit "
                                         r"moments need torchao, which is not installed \(pip install preinfer"):
        config.validate()


def test_a_missing_torchao_is_refused_when_the_optimizer_is_built(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim.adam", None)  # import of it fails
    low_bit._eager_class.cache_clear()
    try:
        with pytest.raises(UsageError, match=r"^--optimizer adam8bit needs torchao, which is not installed"):
            low_bit_adam(model().parameters(), "adam8bit", 1e-3, (0.9, 0.999), 0.0)
    finally:
        low_bit._eager_class.cache_clear()


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_bcd_with_adamw8bit_resumes_bit_for_bit(tmp_path, precision):
    overrides = dict(optim__name="adamw8bit", blocks__sweeps=2, stop__steps_per_visit=4, run__precision=precision)
    reference, saved, resumed = halted_and_resumed(tmp_path, 6, **overrides)  # halted mid-visit: block 1, step 2
    assert any(name.endswith("exp_avg.codes") and t.dtype == torch.uint8 for name, t in saved.items())
    assert same_weights(reference, resumed)
    ref, initial = snapshot(reference.staged.model), snapshot(build_preset("tiny-llama", seed=0))
    assert any(not torch.equal(ref[k], initial[k].to(ref[k].dtype)) for k in ref)
