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
