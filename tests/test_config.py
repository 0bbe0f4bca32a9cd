"""The run config's sections: [run], [pre_inference] and [store]; files written before the split are refused
with the key's new place."""

from __future__ import annotations

import pytest

from pipelines.cli import build_parser, main
from pipelines.flags import config_for_command
from preinfer.config import MOVED_RUN_KEYS, Config, dump_toml, load_config
from preinfer.errors import UsageError

# The [run] section as the version before the split wrote it in every run's config.toml.
OLD_RUN_SECTION = """[run]
out = "runs/bcd"
mode = "bcd"
seed = 0
checkpoint_every = 0
device = "cpu"
recompute = false
pre_inference = "auto"
store_format = "zarr"
store_dtype = "auto"
keep_stores = false
trust_store = false
"""


def test_each_section_holds_its_own_keys():
    config = Config()
    assert set(vars(config.run)) == {"out", "mode", "seed", "checkpoint_every", "device", "precision", "recompute",
                                     "pipeline", "microbatches", "pipeline_schedule", "dp_sync", "outer_lr",
                                     "outer_momentum", "grad_compression", "loss", "loss_chunk", "offload",
                                     "skip_memory_check", "report_to"}
    assert set(vars(config.pre_inference)) == {"mode", "store_dir", "store_format", "store_dtype", "keep_stores",
                                               "dask"}
    assert set(vars(config.store)) == {"path", "trust"}


def test_a_written_config_loads_back_equal(tmp_path):
    config = Config()
    config.pre_inference.mode, config.pre_inference.store_dir, config.pre_inference.dask = "on", "/s", "local:2"
    config.store.path, config.store.trust, config.run.seed = "caches/k4", True, 7
    config.stop.steps_per_visit = 5
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(config))
    text = path.read_text()
    assert "[pre_inference]" in text and "[store]" in text and 'mode = "on"' in text and 'path = "caches/k4"' in text
    assert load_config(path) == config


@pytest.mark.parametrize("old_key", sorted(MOVED_RUN_KEYS))
def test_an_old_run_key_is_refused_naming_its_new_place(old_key, tmp_path):
    value = "false" if old_key in ("keep_stores", "trust_store") else '"x"'
    path = tmp_path / "old.toml"
    path.write_text(f"[run]\n{old_key} = {value}\n")
    section, key = MOVED_RUN_KEYS[old_key]
    with pytest.raises(UsageError) as info:
        load_config(path)
    message = str(info.value)
    assert f"[run] {old_key}" in message and f"{key} in [{section}]" in message and str(path) in message
    assert "\n" not in message


def test_the_moved_keys_name_real_fields():
    config = Config()
    for section, key in MOVED_RUN_KEYS.values():
        assert hasattr(getattr(config, section), key)
    assert not set(MOVED_RUN_KEYS) & set(vars(config.run))


def test_a_config_file_of_the_previous_version_is_refused_by_the_cli(tmp_path, capsys):
    path = tmp_path / "config.toml"
    path.write_text(OLD_RUN_SECTION)
    code = main(["bcd", "--config", str(path), "--model", "tiny-llama", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "[run] pre_inference" in err and "mode in [pre_inference]" in err
    assert not (tmp_path / "run").exists()


def test_flags_of_the_new_sections_reach_the_config(tmp_path):
    bcd = build_parser().parse_args(["bcd", "--pre-inference", "on", "--store-dir", "s", "--keep-stores",
                                     "--store-dtype", "bfloat16", "--out", str(tmp_path / "a")])
    config = config_for_command(bcd)
    assert (config.pre_inference.mode, config.pre_inference.store_dir) == ("on", "s")
    assert config.pre_inference.keep_stores and config.pre_inference.store_dtype == "bfloat16"
    train = build_parser().parse_args(["train", "--store", "caches/k4", "--trust-store", "--out", str(tmp_path / "b")])
    config = config_for_command(train)
    assert (config.store.path, config.store.trust) == ("caches/k4", True)


@pytest.mark.parametrize("written, expected", [('"22GiB"', 22 * 2**30), ("1.5e9", 1_500_000_000), ("4096", 4096),
                                               ('"24GB"', 24 * 10**9)])
def test_a_memory_budget_is_held_in_bytes_from_the_file_on(written, expected, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"[blocks]\nufp = \"auto\"\nmemory_budget = {written}\n")
    config = load_config(path)
    assert config.blocks.memory_budget == expected and type(config.blocks.memory_budget) is int
    path.write_text(dump_toml(config))
    assert f"memory_budget = {expected}" in path.read_text() and load_config(path) == config


@pytest.mark.parametrize("written", ['"a lot"', '"22GiBs"', "0", "true", '"-1GiB"'])
def test_a_bad_memory_budget_in_the_file_is_one_line_naming_its_key(written, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"[blocks]\nmemory_budget = {written}\n")
    with pytest.raises(UsageError) as info:
        load_config(path)
    message = str(info.value)
    assert "[blocks] memory_budget" in message and str(path) in message and "expected" in message
    assert "\n" not in message
