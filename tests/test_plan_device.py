"""bench/device_check.sh: one line and exit 0 without a CUDA GPU; and the invariant tests it runs on one (marked
`cuda`, skipped elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import preinfer
from preinfer.frozen_weights import FrozenWeights, encode
from preinfer.presets import build_preset

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_device_check_without_cuda_says_so_in_one_line_and_exits_0():
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.splitlines() == [
        "device check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to run"]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_staged_model_on_cuda_gives_the_model_s_own_loss(attention):
    model = build_preset("small-llama", attention=attention).cuda().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 128), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    staged = preinfer.stage(model)
    with torch.no_grad():
        split = staged.loss(staged.run(staged.embed(ids, labels=ids), 0, staged.num_layers))
        own = model(input_ids=ids, labels=ids).loss
    assert split.item() == pytest.approx(own.item(), rel=1e-5)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_codes_built_on_cuda_equal_the_cpu_s_and_a_restored_layer_is_its_master_bit_for_bit(dtype):
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    on_cpu, on_cuda = encode(weight, dtype), encode(weight.cuda(), dtype)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu, on_cuda))
    model = build_preset("tiny-llama").cuda()
    layers = preinfer.stage(model).layers
    before = {name: p.detach().cpu().clone() for name, p in layers[1].named_parameters()}
    frozen = FrozenWeights(layers, dtype, "cuda")
    frozen.quantize([1])
    frozen.restore([1])
    assert all(torch.equal(p.detach().cpu(), before[name]) for name, p in layers[1].named_parameters())
