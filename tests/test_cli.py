"""The `preinfer` command line: a small end-to-end run, its run directory and export, and bad input."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipelines.cli import PROCESS_ENVIRONMENT, main
from pipelines.cache import STORE_DTYPES, STORE_FORMATS
from pipelines.cli import COMMANDS
from pipelines.flags import COMMAND_FLAGS, FLAGS, PRE_INFERENCE_FLAGS, SHARED_FLAGS, STORE_FLAGS, TRAINING_FLAGS, shown
from pipelines.models import resolve_model
from preinfer.config import BlockConfig
from preinfer.memory.settings import Settings
from tests.helpers.cli_run import run_cli

# Seconds a child command may take: one that imports torch takes ~40 s on a loaded 2-core machine.
CHILD_TIMEOUT_S = 240
TINY = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "2",
        "--eval-tokens", "256", "--lr", "1e-3"]


@pytest.mark.slow
def test_bcd_writes_the_run_directory_and_a_loadable_export(tmp_path, capsys):
    out = tmp_path / "run"
    began = time.time()
    code, stdout, _ = run_cli(["bcd", *TINY, "--out", str(out), "--blocks", "2", "--eval-tokens", "0"], capsys)
    assert code == 0, stdout
    ended = time.time()
    for name in ("config.toml", "metrics.jsonl", "loss.png", "summary.json", "checkpoint", "export"):
        assert (out / name).exists(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["block"] for r in records if r["kind"] == "visit"] == [0, 1]
    step = next(r for r in records if r["kind"] == "step")
    assert {"sweep", "block", "step", "loss", "lr", "tokens_per_s"} <= set(step)
    clock = [r["time"] for r in records if r["kind"] == "step"]
    assert began < clock[0] and clock == sorted(clock) and clock[-1] < ended  # Unix time at each step's end
    visit = next(r for r in records if r["kind"] == "visit")
    assert {"params", "grads", "optimizer", "activations", "rss_peak"} <= set(visit["memory"])

    current = resolve_model(str(out)).eval()
    same_kernels = AutoModelForCausalLM.from_pretrained(out / "export", attn_implementation="sdpa").eval()
    eager = AutoModelForCausalLM.from_pretrained(out / "export", attn_implementation="eager").eval()
    ids = torch.randint(0, 258, (2, 16))
    with torch.no_grad():
        expected = current(ids).logits  # the run's attention: the default, sdpa
        assert torch.equal(same_kernels(ids).logits, expected)
        assert torch.allclose(eager(ids).logits, expected, atol=1e-5)
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
        (["--ufp", "1.5"], "--ufp 1.5 ([blocks] ufp): expected auto or a fraction in (0, 1]"),
        (["--ufp", "0"], "--ufp 0 ([blocks] ufp): expected auto or a fraction in (0, 1]"),
        (["--ranges", "0-2,2-3"], "in two ranges"),
        (["--ranges", "0-1,3-3"], "skips layer 2"),
        (["--lr", "fast"], "--lr"),
        (["--batch-size", "two"], "--batch-size"),
        (["--lr-decay", "step"], "--lr-decay"),
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


def test_a_decaying_rate_without_a_visit_length_is_refused_before_anything_is_written(tmp_path, capsys):
    steps = TINY.index("--steps-per-visit")
    argv = [*TINY[:steps], *TINY[steps + 2:], "--patience", "3", "--lr-decay", "cosine"]
    code, _, err = run_cli(["bcd", *argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "--lr-decay cosine ([optim] decay): expected one of none, constant_with_warmup" in err
    assert "or a visit length: --steps-per-visit or --epochs-per-visit" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_console_entry_point_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "bcd", "--model", "nope", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nope" in proc.stderr and "Traceback" not in proc.stderr


def test_config_file_values_are_overridden_by_flags(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[data]\nseq_len = 32\nbatch_size = 4\n[stop]\nsteps_per_visit = 1\n[blocks]\nblocks = 2\n')
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["bcd", "--config", str(config), "--model", "tiny-gpt2", "--eval-tokens", "128",
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


def option_help(text: str) -> dict[str, str]:
    """Each option's entry in a --help text, whitespace folded: {"--seq-len": "SEQ_LEN tokens per sample [128]"}."""
    entries: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.split("options:", 1)[1].splitlines():
        start = re.match(r"  (?:-\w, )?(--[a-z][a-z0-9-]*)(.*)", line)
        if start:
            current = entries.setdefault(start.group(1), [])
            line = start.group(2)
        current.append(line)
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


@pytest.mark.parametrize("command, flags", [("bcd", TRAINING_FLAGS + PRE_INFERENCE_FLAGS),
                                            ("train", TRAINING_FLAGS + STORE_FLAGS)])
def test_help_shows_each_training_default_as_the_config_dataclass_has_it(command, flags, capsys):
    code, stdout, _ = run_cli([command, "--help"], capsys)
    assert code == 0
    helps = option_help(stdout)
    data_flags = {"--data", "--seq-len", "--eval-fraction", "--max-samples", "--samples-per-shard"}
    assert {flag.name for flag in flags} - set(helps) == (data_flags if command == "train" else set())
    for flag in (flag for flag in flags if flag.name in helps):
        value = flag.config_default()
        if value is None:
            expected = f"[{flag.unset}]" if flag.unset else "["
            assert (expected in helps[flag.name]) == bool(flag.unset), (flag.name, helps[flag.name])
        elif value is not False:
            assert helps[flag.name].endswith(f"[{shown(value)}]"), (flag.name, helps[flag.name])
    assert helps["--batch-size"].endswith("[8]") and helps["--betas"].endswith("[0.9,0.95]")
    assert helps["--lr"].endswith("[sgd 0.1, adam 5e-05, adamw 5e-05, adam8bit 5e-05, adamw8bit 5e-05]")


def test_each_flag_is_defined_once():
    shared = [flag.name for flag in [*TRAINING_FLAGS, *PRE_INFERENCE_FLAGS, *STORE_FLAGS, *SHARED_FLAGS]]
    assert len(shared) == len(set(shared)) == len(FLAGS)
    assert set(COMMAND_FLAGS) <= set(COMMANDS)
    for command, flags in COMMAND_FLAGS.items():
        names = [flag.name for flag in flags]
        assert len(names) == len(set(names)), command


def without_default(text: str) -> str:
    """A flag's help without the default at its end."""
    return re.sub(r" \[[^][]*\]$", "", text)


# Flags that several commands take, and those commands.
SHARED = {
    "--data": ("bcd", "cache", "eval", "verify"),
    "--tokenizer": ("bcd", "train", "cache", "eval", "verify", "tokenize"),
    "--eval-fraction": ("bcd", "cache", "eval", "verify", "tokenize"),
    "--seq-len": ("bcd", "cache", "eval", "tokenize", "plan"),
    "--token-store": ("bcd", "train", "cache", "eval", "verify"),
    "--model": ("bcd", "train", "cache", "eval", "verify"),
    "--device": ("bcd", "train", "cache", "eval", "verify"),
    "--dask": ("bcd", "cache"),
    "--batch-size": ("bcd", "train", "cache", "eval"),
    "--seed": ("bcd", "train", "cache"),
    "--s3-endpoint": ("bcd", "train", "cache", "verify", "inspect"),
    "--memory-budget": ("bcd", "train", "plan"),
    "--json": ("cache", "eval", "inspect", "tokenize", "plan"),
}


@pytest.mark.parametrize("flag", SHARED)
def test_a_flag_of_several_commands_has_one_help(flag, capsys):
    helps = set()
    for command in SHARED[flag]:
        code, stdout, _ = run_cli([command, "--help"], capsys)
        assert code == 0
        helps.add(without_default(option_help(stdout)[flag]))
    assert len(helps) == 1, helps


def test_the_store_flags_offer_what_the_caching_job_takes():
    assert FLAGS["--store-format"].options["choices"] == list(STORE_FORMATS)
    assert FLAGS["--store-dtype"].options["choices"] == ["auto", *STORE_DTYPES]


def test_plan_help_shows_the_planner_settings_defaults(capsys):
    code, stdout, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0
    helps = option_help(stdout)
    for flag, value in [("--seq-len", Settings.seq_len), ("--micro-batch", Settings.micro_batch),
                        ("--gpu", Settings.gpu), ("--dtype", Settings.dtype), ("--mfu", Settings.mfu),
                        ("--bandwidth-gbps", Settings.bandwidth_gbps), ("--ufp", BlockConfig.ufp),
                        ("--epochs-per-visit", Settings.epochs_per_visit)]:
        assert helps[flag].endswith(f"[{shown(value)}]"), (flag, helps[flag])
    assert "[25]" in helps["--bandwidth-gbps"] and "$0.29" in helps["--price-per-hour"]


def test_a_default_appears_once_in_help(capsys):
    for command in ("bcd", "cache", "eval", "verify", "plan"):
        code, stdout, _ = run_cli([command, "--help"], capsys)
        assert code == 0
        for flag, text in option_help(stdout).items():
            assert not re.search(r"\[[^][]*\] \[[^][]*\]$", text), (command, flag, text)


CPU_ONLY = dict(cuda=None, hip=None)
DEVICE_COMMANDS = [
    ["bcd", "--out", "OUT"],
    ["train", "--store", "OUT", "--out", "OUT"],
    ["eval", "--model", "tiny-llama"],
    ["cache", "--model", "tiny-llama", "--boundary", "1", "--out", "OUT"],
    ["verify", "OUT"],
]


@pytest.mark.parametrize("argv", DEVICE_COMMANDS, ids=lambda argv: argv[0])
def test_cuda_on_a_cpu_only_pytorch_is_one_line_naming_the_build(argv, tmp_path, capsys, monkeypatch):
    for key, value in CPU_ONLY.items():
        monkeypatch.setattr(torch.version, key, value)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    code, _, err = run_cli([*argv, "--device", "cuda"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--device" in err and f"PyTorch {torch.__version__} is a CPU-only build" in err
    assert "pip install" in err and "--index-url" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_cuda_device_and_a_bad_name_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = run_cli(["eval", "--model", "tiny-llama", "--device", "cuda:3"], capsys)
    assert code == 2 and "cuda:3 does not exist" in err and "1 CUDA device" in err
    code, _, err = run_cli(["eval", "--model", "tiny-llama", "--device", "gpu"], capsys)
    assert code == 2 and "'gpu' is not a device" in err and len(err.strip().splitlines()) == 1


def test_cuda_from_a_config_file_on_a_cpu_only_pytorch_is_refused(tmp_path, capsys, monkeypatch):
    for key, value in CPU_ONLY.items():
        monkeypatch.setattr(torch.version, key, value)
    config = tmp_path / "run.toml"
    config.write_text('[run]\ndevice = "cuda"\n')
    code, _, err = run_cli(["bcd", "--config", str(config), "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "[run] device" in err and "CPU-only build" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cuda_through_the_console_entry_point_on_this_pytorch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "eval", "--model", "tiny-llama", "--device",
                           "cuda:99"], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"PyTorch {torch.__version__}" in proc.stderr


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PROCESS_ENVIRONMENT}


@pytest.mark.slow
def test_importing_the_packages_changes_no_process_setting():
    code = ("import os, pipelines, preinfer, storage, pipelines.cli, pipelines.flags, pipelines.training; "
            "assert not set(os.environ) & {'OMP_WAIT_POLICY', 'MALLOC_MMAP_THRESHOLD_'}, os.environ")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_environment(), capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr


def test_the_command_line_sets_omp_wait_policy_unless_the_environment_does(monkeypatch, capsys):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert main(["plan", "--model", "7b"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(4 << 20)  # for the processes it starts
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main(["plan", "--model", "7b"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


# A child that leaves 16 MiB holes in glibc's heap: a 30 MiB block freed first raises glibc's dynamic mmap threshold
# past 16 MiB, then twenty 16 MiB tensors, each followed by a 1 MiB tensor that stays (so the heap cannot shrink from
# its top), are freed. It prints how many MiB of anonymous memory freeing them did not give back.
HEAP_HOLES = """
import sys, torch
if sys.argv[1] == "cli":
    from pipelines.cli import set_process_environment
    set_process_environment()
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) // 1024
first = torch.ones(30 << 18)
del first
before = anon()
big, small = [], []
for _ in range(20):
    big.append(torch.ones(4 << 20))
    small.append(torch.ones(1 << 18))
del big
print(anon() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc: Linux only")
def test_the_command_line_returns_freed_tensors_of_4_mib_and_more_to_the_system():
    def kept(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", HEAP_HOLES, mode], env=clean_environment(), capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    assert kept("plain") >= 200  # glibc's own setting keeps the 320 MiB freed in its heap
    assert kept("cli") < 32


def imported_modules(*argv: str) -> set[str]:
    """The modules `python -X importtime -m pipelines.cli ARGV` imports."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipelines.cli", *argv],
                          env=clean_environment(), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert len(lines) > 20  # the report is there
    return set(lines)


HEAVY = ("torch", "transformers", "zarr", "dask", "storage")


@pytest.mark.parametrize("argv", [("plan", "--model", "7b", "--gpu", "4090"), ("--help",), ("plan", "--help")])
def test_plan_for_a_size_and_the_command_list_import_neither_torch_nor_transformers(argv):
    modules = imported_modules(*argv)
    assert ("preinfer.memory.plan" in modules) == (argv[0] == "plan")
    heavy = {m for m in modules if m.split(".")[0] in HEAVY}
    assert not heavy, sorted(heavy)[:10]


@pytest.mark.parametrize("argv", [("plan", "--model", "7b"), ("--help",)])
def test_only_the_chosen_command_module_is_imported(argv):
    code = ("import sys\nfrom pipelines.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=clean_environment(), capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S)
    modules = set(proc.stdout.split())
    commands = {m for m in modules if m.startswith("pipelines.commands.")}
    assert commands == ({"pipelines.commands.plan"} if argv[0] == "plan" else set())
    assert not {m for m in modules if m.split(".")[0] in HEAVY}
