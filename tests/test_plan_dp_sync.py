"""`preinfer plan --nodes N --bandwidth-gbps G`: each `--dp-sync` mode's bytes and seconds of traffic per step
against the step's compute, and the scaling efficiency they leave."""

import json

import pytest

from pipelines.cli import main
from preinfer.memory.cost import flops_per_token
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import GPUS
from preinfer.memory.shapes import resolve_shape

LLAMA3_8B = ["plan", "--model", "llama3-8b", "--blocks", "32", "--dtype", "bf16-mixed", "--gpu", "4090"]


def test_llama3_8b_at_one_layer_a_block_on_4_nodes_at_10_gbps(capsys):
    """A ring all-reduce over 4 nodes sends 2 (n - 1) / n = 1.5 times the block's fp32 tensors from each node:
    every step under step sync, once in 100 steps under visit sync; the compute is the visit's FLOPs per token
    (the cost model's) over the step's 1024 tokens at the 4090's bf16 peak x MFU 0.4."""
    assert main([*LLAMA3_8B, "--nodes", "4", "--bandwidth-gbps", "10", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    sync, link = plan["dp_sync"], 10e9 / 8
    per_step = 1.5 * 4 * plan["model"]["params"] / 32  # the 32 blocks hold every parameter once
    modes = sync["modes"]
    assert modes["step"]["bytes_per_step"] == pytest.approx(per_step)
    assert modes["visit"]["bytes_per_step"] == pytest.approx(per_step / 100)
    shape = resolve_shape("llama3-8b")
    flops = flops_per_token(shape, partition(shape, 32), 1.0)["bcd_live"]
    compute = 1024 * flops / (GPUS["4090"]["tflops_bf16"] * 1e12 * 0.4)
    assert sync["compute_seconds_per_step"] == pytest.approx(compute)
    for row in modes.values():
        assert row["seconds_per_step"] == pytest.approx(row["bytes_per_step"] / link)
        assert row["efficiency"] == pytest.approx(compute / (compute + row["seconds_per_step"]))
    assert modes["visit"]["efficiency"] >= 0.9 > 0.5 > modes["step"]["efficiency"]


def test_the_table_prints_the_modes_and_one_node_prices_none(capsys):
    assert main([*LLAMA3_8B, "--nodes", "4", "--bandwidth-gbps", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("data parallel on 4 nodes at 10 Gbps"))
    assert [line.split()[0] for line in lines[head + 1:head + 5]] == ["step", "step+bf16", "every:10", "visit"]
    assert main([*LLAMA3_8B, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dp_sync"] is None
