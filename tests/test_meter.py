"""The memory meter counts exactly the tensors it claims to count."""

from __future__ import annotations

import torch
from torch import nn

from preinfer.memory.meter import MemoryMeter, tensor_bytes


def _nbytes(tensors) -> int:
    """Bytes of tensors, counted independently of the meter."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_tensor_bytes():
    assert tensor_bytes(torch.zeros(3, 5, dtype=torch.float32)) == 60
    assert tensor_bytes(torch.zeros(7, dtype=torch.bfloat16)) == 14


def _one_step(model, optimizer) -> dict[str, int]:
    """The meter's report over one tracked forward/backward and optimizer step."""
    meter = MemoryMeter(model)
    with meter.track():
        model(torch.randn(5, 8)).sum().backward()
    meter.sample(optimizer)
    optimizer.step()
    meter.sample(optimizer)
    return meter.report()


def test_params_grads_optimizer_state_exact():
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters())
    report = _one_step(model, optimizer)
    assert report["params"] == _nbytes(model.parameters()) == 4 * (8 * 16 + 16 + 16 * 4 + 4)
    assert report["grads"] == _nbytes(p.grad for p in model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert report["optimizer"] == _nbytes(state)  # exp_avg, exp_avg_sq and the step counter of each parameter
    assert report["optimizer"] == 2 * report["params"] + 4 * len(list(model.parameters()))
    assert report["tracked_peak"] == report["params"] + report["grads"] + report["optimizer"] + report["activations"]
    assert report["rss_peak"] > 0 and report["cuda_peak"] == 0


def test_saved_activations_hand_count_mlp():
    # Linear(8->16) saves its input x (5x8); GELU saves its input (5x16); Linear(16->4) saves the GELU output
    # (5x16). Weights are parameters, not activations. float32: 4 * (40 + 80 + 80) bytes.
    model = _mlp()
    meter = MemoryMeter(model)
    x = torch.randn(5, 8)
    with meter.track():
        model(x).sum().backward()
    assert meter.report()["activations"] == 4 * (5 * 8 + 5 * 16 + 5 * 16)


def test_saved_activations_linear_relu_input_without_grad_and_deduplication():
    # Linear saves x (3x4, 48 bytes); ReLU saves its output (3x6, 72 bytes); the second use of the same
    # tensor (x * 2 saves nothing, x used again by another linear) is counted once by storage.
    torch.manual_seed(0)
    lin_a, lin_b = nn.Linear(4, 6), nn.Linear(4, 6)
    model = nn.ModuleList([lin_a, lin_b])
    meter = MemoryMeter(model)
    x = torch.randn(3, 4)
    with meter.track():
        (torch.relu(lin_a(x)) + lin_b(x)).sum().backward()
    assert meter.report()["activations"] == 4 * (3 * 4 + 3 * 6)


def test_each_step_starts_from_zero_and_peak_is_kept():
    model = _mlp()
    meter = MemoryMeter(model)
    with meter.track():
        model(torch.randn(10, 8)).sum().backward()
    with meter.track():
        model(torch.randn(2, 8)).sum().backward()
    assert meter.report()["activations"] == 4 * 10 * (8 + 16 + 16)
    meter.reset()
    assert meter.report()["activations"] == 0 and meter.report()["grads"] == 0


def test_frozen_parameters_have_no_grad_bytes():
    model = _mlp()
    model[0].requires_grad_(False)
    optimizer = torch.optim.Adam(model[2].parameters())
    report = _one_step(model, optimizer)
    assert report["grads"] == _nbytes(model[2].parameters())
    assert report["optimizer"] == 2 * _nbytes(model[2].parameters()) + 4 * 2
    # Frozen first linear: its output needs no grad, so neither it nor GELU saves anything; only the second
    # linear's input (5x16, for its weight gradient) is saved.
    assert report["activations"] == 4 * 5 * 16


def test_no_grad_saves_nothing():
    model = _mlp()
    meter = MemoryMeter(model)
    with meter.track(), torch.no_grad():
        model(torch.randn(5, 8))
    meter.sample()
    report = meter.report()
    assert report["activations"] == 0 and report["grads"] == 0
    assert report["tracked_peak"] == report["params"]


def test_parameter_views_are_not_activations():
    # x @ W.t() saves x and a view of the parameter W: only x counts.
    weight = nn.Parameter(torch.randn(6, 4))
    holder = nn.Module()
    holder.weight = weight
    meter = MemoryMeter(holder)
    x = torch.randn(3, 4, requires_grad=True)
    with meter.track():
        (x @ weight.t()).sum().backward()
    assert meter.report()["activations"] == 4 * 3 * 4


def test_masters_are_the_stepped_tensors_outside_the_model():
    # bf16 weights, fp32 masters of the second linear stepped by Adam with fp32 gradients: 2 bytes per weight,
    # and 4 (master) + 4 (gradient) + 8 (moments) bytes per master element, plus Adam's step counters.
    model = _mlp().to(torch.bfloat16)
    masters = [p.detach().float().clone() for p in model[2].parameters()]
    for master in masters:
        master.grad = torch.ones_like(master)
    optimizer = torch.optim.Adam(masters)
    optimizer.step()
    meter = MemoryMeter(model)
    meter.sample(optimizer)
    report = meter.report()
    active = sum(m.numel() for m in masters)
    assert report["params"] == 2 * sum(p.numel() for p in model.parameters())
    assert report["masters"] == report["grads"] == 4 * active
    assert report["optimizer"] == 8 * active + 4 * len(masters)
    assert report["tracked_peak"] == report["params"] + 16 * active + 4 * len(masters)


def test_the_meter_is_due_for_its_first_steps_after_each_reset():
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters())
    meter = MemoryMeter(model, steps_per_visit=2)
    due = []
    for _ in range(3):
        due.append(meter.due())
        meter.sample(optimizer)
    meter.reset()
    assert due == [True, True, False] and meter.due()
    every = MemoryMeter(model, steps_per_visit=None)
    for _ in range(5):
        every.sample(optimizer)
    assert every.due()


def test_a_trainable_tensor_outside_the_model_is_not_an_activation_but_what_is_made_from_it_is():
    """A visit's own parameter (landscape expansion's factor) used in forward: its storage, and a view of it that
    autograd saves (F.linear keeps the weight's transpose), count where the optimizer steps it, not as an
    activation; its cast to another dtype is a tensor of its own and counts, and so does an input that requires
    grad. float32: x (5x8) and x A^T (5x3)."""
    model = nn.Linear(8, 8)
    a, b = nn.Parameter(torch.randn(3, 8)), nn.Parameter(torch.randn(8, 3))
    meter = MemoryMeter(model)
    x = torch.randn(5, 8, requires_grad=True)
    with meter.track():
        nn.functional.linear(nn.functional.linear(x, a), b).sum().backward()
    assert meter.report()["activations"] == 4 * (5 * 8 + 5 * 3)
    meter.reset()
    with meter.track():
        nn.functional.linear(x.double(), a.double()).sum().backward()
    assert meter.report()["activations"] == 8 * (5 * 8 + 3 * 8)  # the float64 copies of x and the factor
