"""The `preinfer` command line: a small end-to-end run, its run directory and export, and bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipelines.cli import PROCESS_ENVIRONMENT, main
from pipelines.models import resolve_model

TINY = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "2",
        "--eval-batches", "2", "--lr", "1e-3"]


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bcd_writes_the_run_directory_and_a_loadable_export(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["bcd", *TINY, "--out", str(out), "--blocks", "2", "--eval-batches", "0"], capsys)
    assert code == 0, stdout
    for name in ("config.toml", "metrics.jsonl", "loss.png", "summary.json", "checkpoint", "export"):
        assert (out / name).exists(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["block"] for r in records if r["kind"] == "visit"] == [0, 1]
    assert {"sweep", "block", "step", "loss", "lr", "tokens_per_s"} <= set(records[0])
    visit = next(r for r in records if r["kind"] == "visit")
    assert {"params", "grads", "optimizer", "activations", "rss_peak"} <= set(visit["memory"])

    current = resolve_model(str(out)).eval()
    same_kernels = AutoModelForCausalLM.from_pretrained(out / "export", attn_implementation="eager").eval()
    default = AutoModelForCausalLM.from_pretrained(out / "export").eval()
    ids = torch.randint(0, 258, (2, 16))
    with torch.no_grad():
        expected = current(ids).logits
        assert torch.equal(same_kernels(ids).logits, expected)
        assert torch.allclose(default(ids).logits, expected, atol=1e-5)
    code, stdout, _ = run_cli(["eval", "--model", str(out), "--json"], capsys)
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(stdout)["loss"] == pytest.approx(summary["final_eval_loss"], rel=1e-3)


def test_a_run_directory_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["bcd", *TINY, "--out", str(out), "--blocks", "1"], capsys)[0] == 0
    code, _, err = run_cli(["bcd", *TINY, "--out", str(out), "--blocks", "1"], capsys)
    assert code == 2 and "already holds a run" in err


def instruction_file_without_output(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "say hi", "output": "hi"}\n{"instruction": "say bye"}\n')
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-preset"], "no-such-preset"),
        (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
        (["--ufp", "1.5"], "outside (0, 1]"),
        (["--ufp", "0"], "outside (0, 1]"),
        (["--ranges", "0-2,2-3"], "in two ranges"),
        (["--ranges", "0-1,3-3"], "skips layer 2"),
        (["--lr", "fast"], "--lr"),
        (["--batch-size", "two"], "--batch-size"),
        (["--data", "INSTRUCTIONS"], "output"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, tmp_path, capsys):
    argv = [instruction_file_without_output(tmp_path) if a == "INSTRUCTIONS" else a for a in argv]
    code, _, err = run_cli(["bcd", *TINY, "--out", str(tmp_path / "run"), *argv], capsys)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_the_console_entry_point_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "bcd", "--model", "nope", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nope" in proc.stderr and "Traceback" not in proc.stderr


def test_config_file_values_are_overridden_by_flags(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[data]\nseq_len = 32\nbatch_size = 4\n[stop]\nsteps_per_visit = 1\n[blocks]\nblocks = 2\n')
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["bcd", "--config", str(config), "--model", "tiny-gpt2", "--eval-batches", "1",
                               "--blocks", "3", "--out", str(out)], capsys)
    assert code == 0, stdout
    resolved = (out / "config.toml").read_text()
    assert "blocks = 3" in resolved and "seq_len = 32" in resolved and 'name = "tiny-gpt2"' in resolved


def test_help_documents_every_flag(capsys):
    code, stdout, _ = run_cli(["bcd", "--help"], capsys)
    assert code == 0
    for flag in ("--ufp", "--blocks", "--ranges", "--order", "--optimizer", "--lr", "--steps-per-visit",
                 "--epochs-per-visit", "--patience", "--sweeps", "--seq-len", "--batch-size", "--seed", "--resume"):
        assert flag in stdout


def test_recompute_flag_reaches_the_run_and_lowers_its_activations(tmp_path, capsys):
    memory = {}
    for flags in ([], ["--recompute"]):
        out = tmp_path / ("recompute" if flags else "plain")
        code, stdout, _ = run_cli(["bcd", *TINY, "--out", str(out), "--blocks", "2", *flags], capsys)
        assert code == 0, stdout
        assert ("recompute = true" in (out / "config.toml").read_text()) == bool(flags)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        memory[bool(flags)] = [r["memory"]["activations"] for r in records if r["kind"] == "visit"]
    assert all(r < p for r, p in zip(memory[True], memory[False]))


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PROCESS_ENVIRONMENT}


def test_importing_the_packages_changes_no_process_setting():
    code = ("import os, pipelines, preinfer, storage, pipelines.cli, pipelines.flags, pipelines.training; "
            "assert not {'OMP_WAIT_POLICY'} & set(os.environ), os.environ['OMP_WAIT_POLICY']")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_environment(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_command_line_sets_omp_wait_policy_unless_the_environment_does(monkeypatch, capsys):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main(["plan", "--model", "7b"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main(["plan", "--model", "7b"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def imported_modules(*argv: str) -> set[str]:
    """The modules `python -X importtime -m pipelines.cli ARGV` imports."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipelines.cli", *argv],
                          env=clean_environment(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert len(lines) > 20  # the report is there
    return set(lines)


HEAVY = ("torch", "transformers", "zarr", "dask", "storage")


@pytest.mark.parametrize("argv", [("plan", "--model", "7b", "--gpu", "4090"), ("--help",), ("plan", "--help")])
def test_plan_for_a_size_and_the_command_list_import_neither_torch_nor_transformers(argv):
    modules = imported_modules(*argv)
    assert ("preinfer.memory_model" in modules) == (argv[0] == "plan")
    heavy = {m for m in modules if m.split(".")[0] in HEAVY}
    assert not heavy, sorted(heavy)[:10]


@pytest.mark.parametrize("argv", [("plan", "--model", "7b"), ("--help",)])
def test_only_the_chosen_command_module_is_imported(argv):
    code = ("import sys\nfrom pipelines.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=clean_environment(), capture_output=True,
                          text=True, timeout=120)
    modules = set(proc.stdout.split())
    commands = {m for m in modules if m.startswith("pipelines.commands.")}
    assert commands == ({"pipelines.commands.plan"} if argv[0] == "plan" else set())
    assert not {m for m in modules if m.split(".")[0] in HEAVY}
