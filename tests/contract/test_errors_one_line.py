"""The contract on failures (issue 28): each is one line on stderr with exit code 1 or 2, never a traceback, the
framework's chatter only with --verbose, and hints that point the right way."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli_run import failure_line, run_cli, tree
from preinfer.presets import build_preset

@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama"
    build_preset("tiny-llama").save_pretrained(path)
    return path


def damaged_copy(source: Path, target: Path, damage) -> Path:
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    return target


@pytest.mark.parametrize("how, damage, message", [
    ("truncated", lambda data: data[: len(data) // 2], "file not fully covered"),
    ("header", lambda data: b"\xff" * 8 + data[8:], "header too large"),
])
def test_a_damaged_model_file_is_one_line(tiny, llama, corpus, tmp_path, capsys, how, damage, message):
    model = damaged_copy(llama, tmp_path / how, damage)
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--model", str(model), "--data", corpus, "--out", str(out)], capsys)
    line = failure_line(err)
    assert code == 2 and str(model) in line and message in line and not out.exists()


def test_a_pickled_model_is_refused_in_one_line_without_unpickling(tiny, llama, corpus, tmp_path, capsys,
                                                                   monkeypatch):
    model = tmp_path / "pickled"
    shutil.copytree(llama, model)
    torch.save(load_file(str(model / "model.safetensors")), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("a read path unpickled a file"))
    code, _, err = run_cli(["bcd", *tiny, "--model", str(model), "--data", corpus, "--out", str(tmp_path / "run")],
                           capsys)
    assert code == 2 and "safetensors weights only" in failure_line(err) and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name, damage, message", [
    ("model.safetensors", lambda data: data[: len(data) // 2], "model.safetensors is damaged"),
    ("state.safetensors", lambda data: data[:100], "state.safetensors is damaged"),
    ("state.json", lambda data: b"{garbage", "state.json is not readable JSON"),
    ("state.json", lambda data: json.dumps({**json.loads(data), "rng": [1]}).encode(), "state.json: rng = [1]"),
    ("state.json", lambda data: json.dumps({**json.loads(data), "masters": "two"}).encode(),
     "state.json: masters = 'two'"),
    ("state.json", lambda data: json.dumps({**json.loads(data), "edited": True}).encode(),
     "state.json does not match the sha256 recorded"),
])
def test_a_damaged_checkpoint_is_one_line(finished, tmp_path, capsys, name, damage, message):
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    file = out / "checkpoint" / name
    file.write_bytes(damage(file.read_bytes()))
    before = tree(out)
    code, _, err = run_cli([*finished[1][:-1], str(out), "--resume"], capsys)
    assert code == 1 and message in failure_line(err)
    assert tree(out) == before


def test_an_unreadable_data_file_is_one_line(tiny, corpus, tmp_path, capsys, monkeypatch):
    data = tmp_path / "locked.txt"
    shutil.copy(corpus, data)
    real_open = Path.open

    def open_(path, *args, **kwargs):
        if path == data:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)  # chmod 000 does not stop root
    code, _, err = run_cli(["bcd", *tiny, "--data", str(data), "--out", str(tmp_path / "run")], capsys)
    line = failure_line(err)
    assert code == 2 and f"{data}: cannot read it (PermissionError" in line and not (tmp_path / "run").exists()


def test_the_framework_load_report_shows_only_with_verbose(tiny, bert, corpus, tmp_path, capsys):
    argv = ["bcd", *tiny, "--model", str(bert), "--data", corpus, "--out", str(tmp_path / "run")]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "cannot stage a BertLMHeadModel" in failure_line(err)
    logger = logging.getLogger("preinfer")
    try:
        code, _, err = run_cli([*argv, "--verbose"], capsys)
    finally:
        for handler in logger.handlers[:]:
            logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert code == 2 and "is_decoder=True" in err and err.splitlines()[-1].startswith("preinfer bcd: error: cannot")
    assert not (tmp_path / "run").exists()


def test_a_garbled_token_store_points_to_tokenize(tiny, corpus, tmp_path, capsys):
    store = tmp_path / "tokens"
    assert run_cli(["tokenize", "--data", corpus, "--out", str(store), "--seq-len", "32"], capsys)[0] == 0
    (store / "token-store.json").write_text('{"format": 1')
    code, _, err = run_cli(["bcd", *tiny, "--data", str(store), "--out", str(tmp_path / "run")], capsys)
    line = failure_line(err)
    assert code == 2 and "`preinfer tokenize --overwrite`" in line and "pass --overwrite" not in line


@pytest.mark.parametrize("make", ["file", "foreign"])
def test_a_store_dir_problem_names_store_dir(tiny, corpus, tmp_path, capsys, make):
    store_dir = tmp_path / "stores"
    if make == "file":
        store_dir.write_text("mine")
    else:
        (store_dir / "boundary-2").mkdir(parents=True)
        (store_dir / "boundary-2" / "mine.txt").write_text("mine")
    before = tree(store_dir) if store_dir.is_dir() else store_dir.read_text()
    code, _, err = run_cli(["bcd", *tiny[:-1], "on", "--data", corpus, "--store-dir", str(store_dir),
                            "--out", str(tmp_path / "run")], capsys)
    line = failure_line(err)
    assert code == 2 and line.startswith(f"preinfer bcd: error: --store-dir {store_dir}") and "--out" not in line
    assert (tree(store_dir) if store_dir.is_dir() else store_dir.read_text()) == before


@pytest.mark.slow
def test_inspect_of_an_incomplete_store_does_not_count_unwritten_shards_as_padding(cache, tmp_path, capsys):
    store = tmp_path / "train"
    shutil.copytree(cache / "train", store)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "done").mkdir()  # what a killed job leaves: completion records, shard 1's missing
    for index, record in manifest["shards"].items():
        if index != "1":
            (store / "done" / f"shard-{int(index):06d}.json").write_text(json.dumps(record))
    manifest["complete"], manifest["shards"] = False, {}
    (store / "manifest.json").write_text(json.dumps(manifest))
    code, stdout, _ = run_cli(["inspect", str(store)], capsys)
    info = json.loads(run_cli(["inspect", str(store), "--json"], capsys)[1])
    written = info["written_tokens"]
    assert code == 0 and written == info["tokens"] - 8 * 32
    tokens_line = next(line for line in stdout.splitlines() if line.lstrip().startswith("tokens"))
    assert "the rest padding" not in tokens_line
    assert f"{written - info['real_tokens']:,} padding in the" in tokens_line and "256 not written yet" in tokens_line


@pytest.mark.slow
def test_train_from_a_preset_says_that_it_writes_no_export(cache, tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train", "--model", "tiny-llama", "--store", str(cache), "--steps-per-visit", "1",
                                 "--blocks", "1", "--out", str(out)], capsys)
    assert code == 0, err
    assert "no export written: tiny-llama has no weights below boundary 2" in stdout
    assert not (out / "export").exists() and (out / "checkpoint" / "model.safetensors").is_file()
