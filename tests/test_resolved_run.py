"""One resolved run (issue 44 part 2): `preinfer plan --json` and a run's record show the same settled values for
the same flags, and the rules judge the run as it resolved (issue 48 case 1: precision auto resolved to
fp16-mixed)."""

import json
import subprocess
import sys

import pytest
import torch

from pipelines.cli import build_parser
from pipelines.flags import config_for_command
from pipelines.training.placement import WholeModel
from preinfer.parallel_dims import ParallelDims
from pipelines.training.runner import resolve
from preinfer.config.resolved import ResolvedRun
from preinfer.errors import UsageError
from preinfer.hf import BlockCoordinateDescent
from preinfer.presets import build_preset
from tests.helpers.cli_run import failure_line, run_cli, tree

pytestmark = pytest.mark.slow

# Flags `preinfer bcd` and `preinfer plan` share (a run's precision is the plan's --dtype: fp32 float32, bf16-mixed
# bf16-mixed), each set on tiny-llama.
FLAG_SETS = [
    [], ["--blocks", "2"], ["--blocks", "4"], ["--ufp", "1/2"], ["--blocks", "2", "--separate-ends"],
    ["--expand", "none"], ["--expand", "sgd"], ["--expand", "lowrank", "--expand-rank", "4"],
    ["--frozen-dtype", "bf16"], ["--frozen-dtype", "int8"], ["--optimizer", "sgd"], ["--optimizer", "adamw8bit"],
    ["--optimizer", "adam8bit", "--expand", "sgd"], ["--fused-step"], ["--fused-step", "--optimizer", "adamw"],
    ["--precision", "bf16-mixed"], ["--precision", "bf16-mixed", "--expand", "sgd"],
    ["--precision", "bf16-mixed", "--frozen-dtype", "int8", "--blocks", "2"], ["--store-dtype", "bfloat16"],
    ["--store-dtype", "int8", "--precision", "bf16-mixed"], ["--recompute", "--attention", "eager"],
    ["--precision", "fp32", "--frozen-dtype", "bf16", "--optimizer", "adamw8bit", "--fused-step"],
]
PLAN_DTYPES = {"fp32": "float32", "bf16-mixed": "bf16-mixed"}
QUICK = ["--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "1", "--total-steps", "1", "--max-samples",
         "16", "--eval-tokens", "64", "--lr", "1e-3"]


def plan_flags(flags: list[str]) -> list[str]:
    """The plan's spelling of the same flags: --precision X is --dtype of X."""
    if "--precision" not in flags:
        return flags
    at = flags.index("--precision")
    return [*flags[:at], "--dtype", PLAN_DTYPES[flags[at + 1]], *flags[at + 2:]]


def planned(flags: list[str], capsys) -> dict:
    code, out, err = run_cli(["plan", "--model", "tiny-llama", "--seq-len", "32", "--json", *plan_flags(flags)],
                             capsys)
    assert code == 0, err
    return json.loads(out)["resolved"]


def run_would_record(flags: list[str], out) -> dict:
    """What the run path resolves before it trains (`runner.resolve`, which the run records)."""
    args = build_parser().parse_args(["bcd", "--model", "tiny-llama", *QUICK, "--out", str(out), *flags])
    config = config_for_command(args)
    return resolve(config, WholeModel(config, ParallelDims()), 0).resolved.to_dict()


@pytest.mark.parametrize("flags", FLAG_SETS, ids=" ".join)
def test_the_plan_shows_what_the_run_resolves(flags, tmp_path, capsys):
    resolved = run_would_record(flags, tmp_path / "run")
    assert set(resolved) == {field for field in ResolvedRun.__dataclass_fields__}
    assert planned(flags, capsys) == resolved


@pytest.mark.parametrize("flags", [FLAG_SETS[0], FLAG_SETS[4], FLAG_SETS[12], FLAG_SETS[17], FLAG_SETS[19]],
                         ids=" ".join)
def test_the_plan_shows_what_a_run_records(flags, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--model", "tiny-llama", *QUICK, "--out", str(out), *flags], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recorded = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "resolved"]
    assert recorded == [planned(flags, capsys)]


@pytest.fixture(scope="module")
def fp16_checkpoint(tmp_path_factory):
    """tiny-llama saved in float16: precision auto resolves to fp16-mixed."""
    path = tmp_path_factory.mktemp("fp16") / "model"
    build_preset("tiny-llama", seed=0).to(torch.float16).save_pretrained(path)
    return path


@pytest.mark.parametrize("flags, named", [
    (["--expand", "sgd"], "--expand sgd"),  # issue 48 case 1: the loss scale was left in the suffix's gradients
    (["--fused-step"], "--fused-step"),  # the same class: a rule of fp16-mixed, read before auto was resolved
])
def test_a_rule_of_fp16_mixed_judges_precision_auto_resolved_to_it(flags, named, fp16_checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--model", str(fp16_checkpoint), *QUICK, "--out", str(out), *flags], capsys)
    line = failure_line(err)
    assert code == 2 and named in line and "--precision auto, resolved from the model's weights to fp16-mixed" in line
    assert tree(out) == {}
    explicit = run_cli(["bcd", "--model", str(fp16_checkpoint), *QUICK, "--out", str(out), *flags, "--precision",
                        "fp16-mixed"], capsys)
    assert explicit[0] == 2 and named in failure_line(explicit[2])


@pytest.mark.parametrize("options", [dict(expand="sgd"), dict(fused_step=True)])
def test_the_hf_front_end_judges_precision_auto_resolved_to_fp16_mixed(options):
    model = build_preset("tiny-llama", seed=0).to(torch.float16)
    with pytest.raises(UsageError, match="precision auto, resolved from the model's weights to fp16-mixed") as refused:
        BlockCoordinateDescent(model, steps_per_visit=2, blocks=2, **options)
    argument = next(iter(options))
    assert str(refused.value).startswith(f"BlockCoordinateDescent({argument}=") and "--" not in str(refused.value)


def test_planning_a_size_with_its_resolved_run_loads_neither_torch_nor_transformers():
    """The resolution the plan shares with the run is the config's (its vocabularies, its rules), not torch's."""
    code = ("import sys, io, contextlib\nfrom pipelines.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['plan', '--model', '7b', '--json'])\n"
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True)
    assert done.stdout.strip() == "[]"
