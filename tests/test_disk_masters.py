"""--masters disk (issue 45, part 2): every master memory-mapped from safetensors files, each trained block written
crash-safe into the run's own files at its visit's end. Its exports are the --masters host run's bit for bit; a
SIGKILL in the middle of a visit's write, then --resume, ends where the uninterrupted run ends; the model directory
(read-only) is never written, and an untouched block's masters stay the model's own files."""

import json
import re
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipelines.data.tokenizers import ByteTokenizer
from pipelines.models import resolve_model
from pipelines.models.export import export_streamed
from preinfer.mapped_masters import MappedMasters, map_file, write_safetensors
from preinfer.presets import build_preset
from preinfer.run_dir import RunDir
from tests.helpers.cli_run import failure_line, run_cli

REPO = Path(__file__).resolve().parents[1]
INJECT = REPO / "tests" / "helpers" / "inject.py"
# block 0 (embed + layer 0) has 10 tensors, block 1 (layers 1-2) 18: the 19th tensor written is mid block 1's file
MID_BLOCK_1 = "preinfer.mapped_masters:_write_tensor@after#19=exit"


def read_only_tree(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under `root` with its bytes, mtime and mode."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A bfloat16 tiny-llama save_pretrained directory with its tokenizer, made read-only (files 0444, directory
    0555; as root that blocks no write, so the tests compare its files and entries too)."""
    directory = tmp_path_factory.mktemp("model") / "tiny-llama-bf16"
    build_preset("tiny-llama", seed=3).to(torch.bfloat16).save_pretrained(directory)
    ByteTokenizer().save(directory)
    for file in directory.iterdir():
        file.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    yield directory
    directory.chmod(stat.S_IRWXU)


def bcd_args(model: Path, corpus: str, out: Path, masters: str) -> list[str]:
    return ["bcd", "--model", str(model), "--data", corpus, "--seq-len", "16", "--batch-size", "2", "--blocks", "3",
            "--steps-per-visit", "2", "--lr", "1e-3", "--eval-tokens", "32", "--max-samples", "8", "--pre-inference", "off",
            "--expand", "none", "--frozen-dtype", "nf4", "--optimizer", "adamw8bit", "--fused-step",
            "--checkpoint-every", "1", "--masters", masters, "--out", str(out)]


@pytest.fixture(scope="module")
def runs(model_dir, corpus, tmp_path_factory) -> dict:
    """The same bf16-mixed run (nf4 frozen weights, 8-bit AdamW, fused step) with masters in host memory and on
    disk, and the model directory's files before and after."""
    from pipelines.cli import main

    root = tmp_path_factory.mktemp("runs")
    before = read_only_tree(model_dir)
    for masters in ("host", "disk"):
        assert main(bcd_args(model_dir, corpus, root / masters, masters)) == 0
    return {"root": root, "before": before, "after": read_only_tree(model_dir)}


def export_tensors(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "export" / "model.safetensors"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_a_disk_run_exports_the_host_runs_model_bit_for_bit_and_checkpoints_only_what_its_files_do_not(runs):
    host, disk = runs["root"] / "host", runs["root"] / "disk"
    assert_same(export_tensors(host), export_tensors(disk))
    assert json.loads((host / "export" / "config.json").read_text()) == \
        json.loads((disk / "export" / "config.json").read_text())
    assert load_file(str(RunDir(disk).checkpoint_weights)) == {}  # every block is in its file after its visit
    recorded = json.loads((disk / "checkpoint" / "state.json").read_text())["mapped"]
    assert sorted(recorded) == ["0", "1", "2"]
    assert sorted(p.name for p in RunDir(disk).masters.iterdir()) == sorted(e["file"] for e in recorded.values())
    exported = export_tensors(disk)
    for entry in recorded.values():
        assert_same(map_file(RunDir(disk).masters / entry["file"]),
                    {name: exported[name] for name in load_file(str(RunDir(disk).masters / entry["file"]))})


def test_the_read_only_model_directory_is_never_written(runs):
    assert runs["after"] == runs["before"]  # its files' bytes, mtimes and modes, and no new entry


def test_a_sigkill_in_the_middle_of_a_visits_write_then_resume_ends_where_the_uninterrupted_run_ends(
        runs, model_dir, corpus, tmp_path):
    out = tmp_path / "killed"
    argv = bcd_args(model_dir, corpus, out, "disk")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(INJECT), MID_BLOCK_1, "--", *argv], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 137, done.stderr[-2000:]
    masters = RunDir(out).masters
    left = sorted(p.name for p in masters.iterdir())
    assert len(left) == 2 and left[0].startswith(".block-0001-") and left[1].startswith("block-0000-")
    untouched = read_only_tree(model_dir)
    held = dict(resolve_model(str(out)).state_dict())  # --model of the run: the model's, block 0's file, checkpoint's
    original, block_0 = load_file(str(model_dir / "model.safetensors")), load_file(str(masters / left[1]))
    active = load_file(str(RunDir(out).checkpoint_weights))  # block 1 mid-visit (--checkpoint-every 1)
    assert sorted(active) == sorted(n for n in original if n.startswith(("model.layers.1.", "model.layers.2.")))
    assert_same(held, {**original, **block_0, **active})
    from pipelines.cli import main

    assert main([*argv, "--resume"]) == 0
    assert_same(export_tensors(runs["root"] / "disk"), export_tensors(out))
    recorded = json.loads((out / "checkpoint" / "state.json").read_text())["mapped"]
    assert sorted(p.name for p in masters.iterdir()) == sorted(e["file"] for e in recorded.values())  # left: gone
    assert read_only_tree(model_dir) == untouched


def test_the_masters_of_untouched_blocks_stay_the_model_files_own(model_dir, corpus, tmp_path):
    from pipelines.cli import main

    out = tmp_path / "one-visit"
    assert main([*bcd_args(model_dir, corpus, out, "disk"), "--total-steps", "2"]) == 0
    assert [p.name[:10] for p in RunDir(out).masters.iterdir()] == ["block-0000"]
    original, exported = load_file(str(model_dir / "model.safetensors")), export_tensors(out)
    untouched = [name for name in original if not name.startswith(("model.embed_tokens.", "model.layers.0."))]
    assert_same({n: original[n] for n in untouched}, {n: exported[n] for n in untouched})
    assert not any(torch.equal(original[n], exported[n]) for n in original if n.startswith("model.layers.0.mlp"))


def test_a_mapped_tensor_written_in_memory_leaves_its_file_as_it_was(tmp_path):
    file = tmp_path / "weights.safetensors"
    tensors = {"w": torch.arange(12, dtype=torch.bfloat16).view(3, 4), "b": torch.ones(3)}
    write_safetensors(file, tensors.items())
    written = file.read_bytes()
    mapped = map_file(file)
    assert_same(mapped, tensors)
    mapped["w"].add_(1)
    assert file.read_bytes() == written
    assert_same(load_file(str(file)), tensors)


def test_a_streamed_export_past_its_shard_size_is_sharded_with_an_index_that_transformers_loads(tmp_path):
    model = build_preset("tiny-llama", seed=1)
    export_streamed(model, tmp_path, shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert_same(dict(loaded.state_dict()), dict(model.state_dict()))


@pytest.mark.parametrize("extra, expected", [
    (["--model", "tiny-llama"], r"--masters disk maps the weights of a model directory's safetensors files; "
                                r"preset 'tiny-llama' has none: point --model at a save_pretrained directory"),
    (["--precision", "fp32"], r"--masters disk maps the weights in the dtype of their files \(bfloat16 in .*\); "
                              r"--precision fp32 holds them in float32"),
    (["--expand", "lowrank"], r"--expand lowrank \(\[blocks\] expand\): expected none with --masters disk"),
])
def test_where_disk_masters_cannot_apply_the_run_is_refused_in_one_line_and_writes_nothing(
        model_dir, corpus, tmp_path, capsys, extra, expected):
    out = tmp_path / "refused"
    code, _, err = run_cli([*bcd_args(model_dir, corpus, out, "disk"), *extra], capsys)
    assert code == 2
    assert re.search(expected, failure_line(err))
    assert not out.exists()


def test_prune_deletes_only_the_block_files_no_checkpoint_names_and_a_killed_writes_temporary(tmp_path):
    masters = MappedMasters(tmp_path, {}, ())
    kept = masters.end(0, {"w": torch.ones(2)})
    assert torch.equal(kept["w"], torch.ones(2)) and masters.clean == {"w"}
    named = masters.files["0"]["file"]
    masters.end(1, {"v": torch.zeros(3)})
    masters.files.pop("1")  # as after a kill: written, not yet in a checkpoint
    leftover = tmp_path / f".{named}.tmp-123-0123abcd"
    foreign = [tmp_path / "notes.txt", tmp_path / "block-0001.safetensors"]
    for path in (leftover, *foreign):
        path.write_text("x")
    masters.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([named, *(p.name for p in foreign)])
