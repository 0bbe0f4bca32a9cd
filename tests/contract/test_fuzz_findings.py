"""What the config fuzzer found (tests/test_config_fuzz.py, issue 48 part 3), each a named regression test: a
seed numpy cannot take (a traceback, then a hung reader); the rules of the model's structure (the partition's size,
its sparse layers) judged only once the model was built, and naming a flag for a key the TOML file gave."""

import pytest

from tests.helpers.cli_run import failure_line, run_cli
from tests.helpers.composition import ModelBuilds

TOML_HEAD = "[stop]\nsteps_per_visit = 1\n[data]\nseq_len = 16\neval_tokens = 64\n"


def refused(argv: list[str], out, capsys) -> str:
    """The one line of a run refused with exit code 2 before any model was built, leaving no --out."""
    with ModelBuilds() as builds:
        code, _, err = run_cli([*argv, "--out", str(out)], capsys)
    assert code == 2 and not out.exists() and builds.count == 0, err
    return failure_line(err)


@pytest.mark.parametrize("seed", [-3, 2**63])
def test_a_seed_numpy_or_torch_cannot_take_is_refused_naming_the_toml_key(tmp_path, corpus, capsys, seed):
    path = tmp_path / "c.toml"
    path.write_text(f"{TOML_HEAD}[run]\nseed = {seed}\n")
    line = refused(["bcd", "--config", str(path), "--model", "tiny-llama", "--data", corpus], tmp_path / "run",
                   capsys)
    assert line.endswith(f"{path}: [run] seed = {seed}: expected an integer in [0, 2**63 - 1]")


def test_a_negative_seed_flag_is_refused_naming_the_flag(tmp_path, tiny, corpus, capsys):
    line = refused(["bcd", *tiny, "--data", corpus, "--seed", "-1"], tmp_path / "run", capsys)
    assert "--seed -1 ([run] seed): expected an integer in [0, 2**63 - 1]" in line


@pytest.mark.parametrize("keys, toml_line, flag_line", [
    ('[optim]\nblock_lr = "1,0.5"\n', "[optim] block_lr = '1,0.5': expected 3 factors, one per block",
     "--block-lr 1,0.5 ([optim] block_lr): expected 3 factors"),
    ('[blocks]\nexperts = "top:0.5"\n', "[blocks] experts = 'top:0.5': expected unset on a model without "
     "mixture-of-experts layers", "--experts top:0.5 ([blocks] experts): expected unset on a model without"),
    ('[blocks]\nfixed_order = "1,0"\n', "[blocks] fixed_order = '1,0': expected each of the partition's blocks 0-2 "
     "named once", "--fixed-order 1,0 ([blocks] fixed_order): expected each of the partition's blocks 0-2"),
    ('[blocks]\nstart_block = 5\n', "[blocks] start_block = 5: expected one of the partition's blocks 0-2",
     "--start-block 5 ([blocks] start_block): expected one of the partition's blocks 0-2"),
], ids=["block_lr", "experts", "fixed_order", "start_block"])
def test_a_rule_of_the_resolved_run_names_the_key_as_its_source_gave_it(tmp_path, corpus, capsys, keys, toml_line,
                                                                        flag_line):
    """The partition's size and the model's layers come from the model built on the meta device, before any
    weight is read or a preset initialised: the rules judged then name a TOML key by its file, a flag by the flag."""
    path = tmp_path / "c.toml"
    path.write_text(TOML_HEAD + keys)
    line = refused(["bcd", "--config", str(path), "--model", "tiny-llama", "--data", corpus], tmp_path / "a", capsys)
    assert f"{path}: {toml_line}" in line and "--" not in line.split(": ", 1)[1]
    key = keys.split("\n")[1].split(" = ")
    flag = "--" + key[0].replace("_", "-")
    line = refused(["bcd", "--model", "tiny-llama", "--data", corpus, "--steps-per-visit", "1", "--seq-len", "16",
                    flag, key[1].strip('"')], tmp_path / "b", capsys)
    assert flag_line in line


@pytest.mark.parametrize("keys, message", [
    ('[optim]\nblock_lr = "1,0.5"\n', "[optim] block_lr = '1,0.5': expected 1 factors, one per block"),  # seed 4823
    ('order = "fixed"\nfixed_order = "1,0"\n', "[blocks] fixed_order = '1,0': expected each of the "
     "partition's blocks 0-0 named once"),
], ids=["block_lr", "fixed_order"])
def test_a_partition_the_memory_budget_chooses_is_judged_before_the_model_loads(tmp_path, corpus, capsys, keys,
                                                                                message):
    """Fuzz seed 4823: `ufp = "auto"` plans the fewest blocks that fit the budget in the precision the weights
    resolve; that precision is the one their stored dtype gives, so the plan is made on the meta skeleton, before
    any model is built."""
    path = tmp_path / "c.toml"
    path.write_text(f'{TOML_HEAD}[blocks]\nufp = "auto"\ngpu = "4090"\n{keys}' if "optim" not in keys else
                    f'{TOML_HEAD}{keys}[blocks]\nufp = "auto"\ngpu = "4090"\n')
    line = refused(["bcd", "--config", str(path), "--model", "tiny-llama", "--data", corpus], tmp_path / "run", capsys)
    assert f"{path}: {message}" in line


def test_the_budget_s_partition_before_the_load_is_planned_in_the_precision_the_stored_weights_resolve(
        tmp_path, corpus, capsys, monkeypatch):
    """A 6 MiB budget holds tiny-llama in 2 blocks in fp32, in 1 in fp16-mixed: saved in float16, precision auto
    resolves to fp16-mixed, and the plan made before the load (no weight read) has the loaded run's 1 block; a
    rule of fp16-mixed (issue 48 case 1) is judged then as well."""
    import torch

    import pipelines.models.source
    from pipelines.training.runner import check_structure
    from preinfer.config import load_config
    from preinfer.presets import build_preset

    model = tmp_path / "fp16"
    build_preset("tiny-llama", seed=0).to(torch.float16).save_pretrained(model)
    capsys.readouterr()  # save_pretrained's progress bar
    monkeypatch.setattr(pipelines.models.source, "load_model", None)  # any load fails the test
    path = tmp_path / "c.toml"
    budget = f'[blocks]\nufp = "auto"\nmemory_budget = {6 << 20}\n[model]\nname = "{model}"\n'
    path.write_text(f'{TOML_HEAD}[optim]\nblock_lr = "1,0.5"\n{budget}')
    code, _, err = run_cli(["bcd", "--config", str(path), "--data", corpus, "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and not (tmp_path / "run").exists(), err
    assert f"{path}: [optim] block_lr = '1,0.5': expected 1 factors, one per block" in failure_line(err)
    code, _, err = run_cli(["bcd", "--model", str(model), "--data", corpus, "--blocks", "2", "--expand", "sgd",
                            "--out", str(tmp_path / "run")], capsys)  # case 1's rule: judged before the load too
    assert code == 2 and "--precision auto, resolved from the model's weights to fp16-mixed" in failure_line(err)
    path.write_text(f'{TOML_HEAD}[optim]\nblock_lr = "0.5"\n{budget}')
    check_structure(load_config(path))  # the loaded run's partition: one block
    path.write_text(f'{TOML_HEAD}[optim]\nblock_lr = "1,0.5"\n{budget}[run]\nprecision = "fp32"\n')
    check_structure(load_config(path))  # in fp32 the same budget makes two
