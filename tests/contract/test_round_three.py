"""Issue 48's cases that ROBUST fixed, each by class (docs/reliability.md, "round three"): numbers bounded before
they reach torch, `plan` refusing what `bcd` refuses, an expansion rank above the layers' width, `verify` on a
run's own stores, and quiet imports."""

import pytest

from pipelines.cli import main
from preinfer.hf import BlockCoordinateDescent
from preinfer.errors import UsageError
from tests.helpers.cli_run import failure_line, run_cli

# Every number here passes its own type check but becomes a step torch cannot hold in float32 (case 4, 5).
OVERFLOWING = [
    (["--lr", "1e40"], "argument --lr: expected a positive number up to 3.4e38"),
    (["--lr", "1e38"], "--lr / (1 - beta1) is 1e+39"),  # the rate fits, Adam's first step does not
    (["--block-lr", "1e308,1e308"], "--block-lr 1e308,1e308 ([optim] block_lr): expected depth:LO..HI"),
    (["--block-lr", "depth:1..1e300"], "each at most 3.4e38"),  # block 0 would train, block 1 die
    (["--lr", "1e37", "--block-lr", "depth:1..100"], "the largest factor of --block-lr"),
    (["--optimizer", "adamw", "--lr", "1e30", "--weight-decay", "1e30"], "times --weight-decay 1e+60"),
    (["--momentum", "1e39", "--optimizer", "sgd"], "--momentum 1e+39 ([optim] momentum)"),
    (["--grad-clip", "1e39"], "--grad-clip 1e+39"),
    (["--expand-lr", "1e39"], "argument --expand-lr: expected a positive number up to 3.4e38"),
]


@pytest.mark.parametrize("flags, message", OVERFLOWING, ids=[" ".join(f) for f, _ in OVERFLOWING])
def test_a_number_torch_cannot_hold_is_refused_before_any_load(tiny, corpus, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out), *flags], capsys)
    assert code == 2 and message in failure_line(err) and not out.exists()


@pytest.mark.parametrize("text, message", [
    ("[optim]\nlr = 1e40\n", "[optim] lr = 1e+40: expected a finite number > 0, at most 3.4e38"),
    ("[optim]\nweight_decay = 1e39\n", "[optim] weight_decay = 1e+39: expected a finite number >= 0, at most"),
    ("[blocks]\nexpand_lr = 1e39\n", "[blocks] expand_lr = 1e+39: expected a finite number > 0, at most 3.4e38"),
    ("[optim]\nblock_lr = 'depth:1..1e300'\n", "[optim] block_lr = 'depth:1..1e300': expected depth:LO..HI"),
])
def test_an_overflowing_rate_in_toml_is_refused(tmp_path, capsys, text, message):
    config = tmp_path / "c.toml"
    config.write_text(text)
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--config", str(config), "--model", "tiny-llama", "--out", str(out)], capsys)
    assert code == 2 and message in failure_line(err) and not out.exists()


def test_an_overflowing_rate_in_the_hf_front_end_is_refused():
    with pytest.raises(UsageError, match=r"\(lr=1e\+40\): expected a finite number > 0, at most 3.4e38"):
        BlockCoordinateDescent(model=None, steps_per_visit=2, lr=1e40)
    with pytest.raises(UsageError, match="block_lr"):
        BlockCoordinateDescent(model=None, steps_per_visit=2, block_lr="depth:1..1e300")


def test_the_largest_rates_that_fit_train_to_finite_weights_or_stop_on_divergence(tiny, corpus, tmp_path, capsys):
    """The bound is not too tight: a rate just inside it reaches torch, which takes it (the run may diverge, one
    line, exit 1; never an overflow traceback)."""
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(tmp_path / "run"), "--optimizer", "sgd",
                            "--lr", "3e38", "--momentum", "0"], capsys)
    assert code in (0, 1) and "overflow" not in err and "Traceback" not in err


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> dict:
    from preinfer.presets import preset_config

    return preset_config("tiny-llama").to_dict()


def written_model_config(directory, values: dict):
    import json

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(values))
    return directory / "config.json"


# A config.json whose fields transformers or the planner cannot use (case 7), and its kin found here.
BAD_FIELDS = [
    ({"hidden_size": 0}, "hidden_size = 0: expected an integer in [1, 2^31)"),
    ({"num_hidden_layers": -1}, "num_hidden_layers = -1: expected an integer in [1, 2^31)"),
    ({"vocab_size": 10**30}, "vocab_size = 1000000000000000000000000000000: expected an integer in [1, 2^31)"),
    ({"num_hidden_layers": "4"}, "Field 'num_hidden_layers' expected int, got str"),
    ({"hidden_size": 64.5}, "Field 'hidden_size' expected int, got float"),
]


@pytest.mark.parametrize("edit, message", BAD_FIELDS, ids=[str(e) for e, _ in BAD_FIELDS])
@pytest.mark.parametrize("as_directory", [False, True], ids=["file", "directory"])
def test_plan_on_a_config_with_a_bad_field_names_the_file_and_field(llama_config, tmp_path, capsys, edit, message,
                                                                    as_directory):
    path = written_model_config(tmp_path / "m", {**llama_config, **edit})
    spec = str(path.parent if as_directory else path)
    code, _, err = run_cli(["plan", "--model", spec], capsys)
    line = failure_line(err)
    assert code == 2 and message in line and spec in line


@pytest.mark.parametrize("text", ['{"model_type": "llama", ', "[1]"], ids=["truncated", "a list"])
def test_plan_on_a_config_that_is_no_json_object_is_one_line(tmp_path, capsys, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    code, _, err = run_cli(["plan", "--model", str(path)], capsys)
    assert code == 2 and f"cannot read a model config from '{path}'" in failure_line(err)


@pytest.mark.parametrize("flag, value", [("--tokens", "1e400"), ("--seq-len", "1" + "0" * 400),
                                         ("--micro-batch", "1" + "0" * 30), ("--gpu-mem", "1e300"),
                                         ("--expand-rank", "1" + "0" * 30)])
def test_plan_refuses_a_number_too_large_for_its_arithmetic(capsys, flag, value):
    code, _, err = run_cli(["plan", "--model", "7b", flag, value], capsys)
    assert code == 2 and f"argument {flag}: expected" in failure_line(err)


def test_plan_refuses_a_family_it_does_not_price_with_another_family_s_fields(llama_config, tmp_path, capsys):
    """A Mamba config given a Llama's attention fields is no attention model: not planned as Llama (case 11)."""
    path = written_model_config(tmp_path / "mamba", {**llama_config, "model_type": "mamba"})
    code, _, err = run_cli(["plan", "--model", str(path.parent)], capsys)
    assert code == 2 and "model type 'mamba' has no hidden_size" in failure_line(err)
    code, _, err = run_cli(["plan", "--model", str(written_model_config(tmp_path / "llama", llama_config))], capsys)
    assert code == 0, err


def test_plan_refuses_nf4_where_bcd_refuses_it(llama_config, tmp_path, capsys):
    """nf4 codes 64-element blocks: a 20x40 linear cannot be held in nf4, in plan as in bcd (case 11)."""
    odd = {**llama_config, "hidden_size": 40, "intermediate_size": 100, "head_dim": 10}
    spec = str(written_model_config(tmp_path / "odd", odd).parent)
    code, _, err = run_cli(["plan", "--model", spec, "--frozen-dtype", "nf4"], capsys)
    assert code == 2 and "frozen dtype nf4 needs weights whose element count is divisible by 64" in failure_line(err)
    assert run_cli(["plan", "--model", spec, "--frozen-dtype", "int8"], capsys)[0] == 0
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec)).save_pretrained(spec)
    capsys.readouterr()  # save_pretrained's progress bar
    code, _, err = run_cli(["bcd", "--model", spec, "--tokenizer", "byte", "--frozen-dtype", "nf4", "--expand",
                            "none", "--seq-len", "16", "--batch-size", "2", "--steps-per-visit", "1",
                            "--eval-tokens", "0", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "frozen dtype nf4 needs weights whose element count is divisible by 64" in failure_line(err)


def child_stderr(args: list[str], cwd) -> str:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def message(line: str) -> str:
    """A warning line without what changes from one process to the next: glog's time and process id before `] `,
    and what follows its first colon (the reason, in words that may vary)."""
    return line.split("] ", 1)[-1].split(":")[0]


@pytest.mark.slow
def test_what_torchao_s_import_prints_is_shown_with_verbose_only(corpus, tmp_path):
    """Case 16: torchao's and torch pytree's import-time warnings (those a bare `import torchao` prints here) stay
    off a run's stderr, with an 8-bit optimizer and (the same class) with frozen weights held as codes, and
    --verbose shows them. Both features run in one quiet process: torchao is imported once per process (by
    transformers' quantizers, whatever the flags), so a second process would import it the same way."""
    printed = [message(line) for line in child_stderr(["-c", "import torchao"], tmp_path).splitlines() if line.strip()]
    run = ["-m", "pipelines.cli", "bcd", "--model", "tiny-llama", "--seq-len", "16", "--batch-size", "2",
           "--steps-per-visit", "1", "--total-steps", "1", "--eval-tokens", "0", "--data", corpus, "--pre-inference",
           "off"]
    quiet = child_stderr([*run, "--optimizer", "adam8bit", "--frozen-dtype", "int8", "--out", str(tmp_path / "q")],
                         tmp_path)
    assert not any(line in quiet for line in printed), quiet
    assert "Failed to load" not in quiet and "_pytree" not in quiet
    verbose = child_stderr([*run, "--optimizer", "adam8bit", "--out", str(tmp_path / "verbose"), "--verbose"], tmp_path)
    assert all(line in verbose for line in printed), verbose


@pytest.fixture(scope="module")
def kept_run(corpus, tmp_path_factory):
    """A tiny bcd run with --eval-tokens and --max-samples whose boundary-2 store it kept (block 1 above it trains
    last, so the store's prefix is the run's final one)."""
    out = tmp_path_factory.mktemp("kept") / "run"
    assert main(["bcd", "--model", "tiny-llama", "--seq-len", "16", "--batch-size", "2", "--steps-per-visit", "1",
                 "--eval-tokens", "128", "--max-samples", "40", "--blocks", "2", "--pre-inference", "on",
                 "--keep-stores", "--data", corpus, "--out", str(out)]) == 0
    return out


def test_verify_checks_the_stores_of_a_run_with_its_own_samples(kept_run, corpus, capsys):
    """Case 13: the run's stores hold its --max-samples and --eval-tokens samples; verify reads them from the run
    directory, or takes the flags beside an export."""
    store = str(kept_run / "stores" / "boundary-2")
    code, out, _ = run_cli(["verify", store, "--model", str(kept_run), "--sample", "2"], capsys)
    assert code == 0 and out.strip().endswith("verify: OK") and "bit-exact" in out
    export = ["verify", store, "--model", str(kept_run / "export"), "--tokenizer", "byte", "--data", corpus,
              "--sample", "2"]
    code, out, _ = run_cli([*export, "--eval-tokens", "128", "--max-samples", "40"], capsys)
    assert code == 0 and out.strip().endswith("verify: OK")
    code, out, _ = run_cli(export, capsys)  # other samples than the run's: the dataset's fingerprint differs
    assert code == 1 and "STALE" in out and "dataset" in out


@pytest.mark.parametrize("expand", ["lowrank", "none"])
def test_a_raised_budget_on_resume_continues_the_cut_visit_to_the_larger_budget_s_weights(corpus, tmp_path, capsys,
                                                                                          expand):
    """Case 3: 2 blocks, 3 steps a visit, 2 sweeps, cut by --total-steps 4 (visit 1 after 1 of its 3 steps), then
    --resume --total-steps 12: the export equals the run started with 12, tensor for tensor, bit for bit (the cut
    visit's low-rank factors continue, not merged and drawn again)."""
    import json

    from safetensors.torch import load_file

    flags = ["bcd", "--model", "tiny-llama", "--seq-len", "16", "--batch-size", "2", "--steps-per-visit", "3",
             "--blocks", "2", "--sweeps", "2", "--eval-tokens", "32", "--pre-inference", "off", "--expand", expand,
             "--data", corpus, "--lr", "1e-3"]
    cut, straight = tmp_path / "cut", tmp_path / "straight"
    assert run_cli([*flags, "--out", str(cut), "--total-steps", "4"], capsys)[0] == 0
    assert run_cli(["bcd", "--out", str(cut), "--resume", "--total-steps", "12"], capsys)[0] == 0
    assert run_cli([*flags, "--out", str(straight), "--total-steps", "12"], capsys)[0] == 0
    resumed, expected = (load_file(str(run / "export" / "model.safetensors")) for run in (cut, straight))
    assert resumed.keys() == expected.keys()
    assert all(torch_equal(resumed[name], expected[name]) for name in expected)
    steps = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in steps if r["kind"] == "step") == 12


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
