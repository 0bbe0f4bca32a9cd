"""`Config.validate`: every enumerated key (its choices read from its field's Literal), every number's range and the
rules between keys are refused before anything is opened, from the flags, a TOML file and the HF arguments alike,
in one line naming the key as the user gave it, the value and what was expected (exit 2). The cases are generated
from the dataclasses, so that a new key is covered when it is added."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest

from pipelines.flags import CONFIG_FLAGS, FLAGS
from preinfer.config import BOUNDS, Config, choices, dump_toml, load_config
from preinfer.config.choices import field_hint, is_names
from preinfer.errors import UsageError
from preinfer.hf import ARGUMENTS, BlockCoordinateDescent
from tests.helpers.cli_run import failure_line, run_cli

MISSING_MODEL = "/does/not/exist"

# Every run's config.toml as the version before the typed config wrote it (the defaults, one epoch per visit).
PREVIOUS_CONFIG = """[model]
name = "small-llama"
tokenizer = "auto"
attention = "sdpa"

[data]
path = "builtin:pydoc"
seq_len = 128
batch_size = 8
eval_fraction = 0.1
eval_tokens = 262144
max_samples = 0
samples_per_shard = 0

[blocks]
ufp = "1/3"
separate_ends = false
order = "ascending"
sweeps = 1
importance_batches = 2
importance_floor = 2
importance_margin = 0.25
experts_with = "router,shared,attention,rest"
experts_sample = 8

[optim]
name = "adam"
betas = [0.9, 0.95]
momentum = 0.9
warmup_steps = 0
warmup_ratio = 0.0
decay = "none"
grad_clip = 0.0
grad_accum = 1
keep_state = false

[stop]
epochs_per_visit = 1.0
min_delta = 0.0
smoothing = 0.9
rule = "budget"
gain_window = 4

[run]
out = "runs/bcd"
mode = "bcd"
seed = 0
checkpoint_every = 0
device = "cpu"
precision = "auto"
recompute = false
pipeline = 1
microbatches = 0
pipeline_schedule = "1f1b"
report_to = "none"

[pre_inference]
mode = "auto"
store_format = "zarr"
store_dtype = "auto"
keep_stores = false

[store]
trust = false
"""


def section_class(section: str) -> type:
    return type(getattr(Config(), section))


def config_keys() -> list[tuple[str, str]]:
    return [(section.name, item.name) for section in fields(Config) for item in fields(section_class(section.name))]


ENUMERATED = [(section, key) for section, key in config_keys() if choices(section_class(section), key)]


def bad_number(section: str, key: str):
    """A value just outside the key's range."""
    bound, hint = BOUNDS[f"{section}.{key}"], field_hint(section_class(section), key)
    if bound.text:  # betas
        return [0.9, 1.0]
    if bound.rule.startswith("in "):
        return 1.0
    low = float(bound.rule.split()[1])
    value = low - 1 if bound.rule.startswith(">=") else low
    return int(value) if hint is int else value


# The numbers with a range (a seed may be any integer).
NUMBERS = [(section, key) for section, key in config_keys() if f"{section}.{key}" in BOUNDS
           and (BOUNDS[f"{section}.{key}"].rule or BOUNDS[f"{section}.{key}"].text)]
HF_KEYS = {key: argument for argument, key in ARGUMENTS.items()}


def cases(keys: list[tuple[str, str]], within=None) -> list:
    """The keys (those named in `within`, if given) as parameters "section, key", each with its id."""
    return [pytest.param(section, key, id=f"{section}.{key}") for section, key in keys
            if within is None or f"{section}.{key}" in within]


def toml_text(value) -> str:
    """A str, int, float or list of floats as TOML writes it."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def cli_failure(argv: list[str], tmp_path: Path, capsys) -> tuple[int, str]:
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--model", MISSING_MODEL, "--out", str(out), *argv], capsys)
    assert not out.exists()
    return code, failure_line(err)


def written_config(tmp_path: Path, section: str, key: str, value) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f"[{section}]\n{key} = {toml_text(value)}\n")
    return path


def test_every_number_has_a_range_and_every_range_a_number():
    numeric = {f"{section}.{key}" for section, key in config_keys()
               if field_hint(section_class(section), key) in (int, float)
               or str(field_hint(section_class(section), key)).startswith("list[float")}
    assert numeric == set(BOUNDS)


def test_pre_inference_mode_yes_in_a_config_file_is_one_line_before_the_model(tmp_path, capsys):
    path = tmp_path / "config.toml"
    path.write_text('[pre_inference]\nmode = "yes"\n')
    code, line = cli_failure(["--config", str(path)], tmp_path, capsys)
    assert code == 2
    assert line == f"preinfer bcd: error: {path}: [pre_inference] mode = 'yes': expected one of off, on, auto"


@pytest.mark.parametrize("section, key", cases(ENUMERATED))
def test_an_unknown_choice_in_a_config_file_is_refused_naming_key_value_and_choices(section, key, tmp_path, capsys):
    path = written_config(tmp_path, section, key, "bogus")
    code, line = cli_failure(["--config", str(path)], tmp_path, capsys)
    assert code == 2 and f"{path}: [{section}] {key} = 'bogus': expected " in line and MISSING_MODEL not in line
    assert all(choice in line for choice in choices(section_class(section), key))


@pytest.mark.parametrize("section, key", cases(ENUMERATED, CONFIG_FLAGS))
def test_an_unknown_choice_of_a_flag_is_refused_naming_flag_value_and_choices(section, key, tmp_path, capsys):
    flag = CONFIG_FLAGS[f"{section}.{key}"]
    code, line = cli_failure([flag, "bogus"], tmp_path, capsys)
    assert code == 2 and flag in line and "bogus" in line and MISSING_MODEL not in line
    assert all(choice in line for choice in choices(section_class(section), key))


@pytest.mark.parametrize("section, key", cases(ENUMERATED, HF_KEYS))
def test_an_unknown_choice_of_an_hf_argument_is_refused_before_the_model_is_touched(section, key):
    argument = HF_KEYS[f"{section}.{key}"]
    with pytest.raises(UsageError) as info:
        BlockCoordinateDescent(object(), steps_per_visit=2, **{argument: "bogus"})  # the model would fail at once
    message = str(info.value)
    assert message.startswith(f"BlockCoordinateDescent({argument}='bogus'): expected ") and "\n" not in message
    assert all(choice in message for choice in choices(section_class(section), key))


def test_the_flags_offer_exactly_the_literal_s_choices():
    for each in FLAGS.values():
        if each.section is not None and choices(section_class(each.section), each.key):
            hint = field_hint(section_class(each.section), each.key)
            expected = None if is_names(hint) else list(choices(section_class(each.section), each.key))
            assert each.options.get("choices") == expected, each.name


@pytest.mark.parametrize("section, key", cases(NUMBERS))
def test_a_number_out_of_range_in_a_config_file_is_refused(section, key, tmp_path, capsys):
    value = bad_number(section, key)
    path = written_config(tmp_path, section, key, value)
    code, line = cli_failure(["--config", str(path)], tmp_path, capsys)
    assert code == 2 and f"{path}: [{section}] {key} = {value!r}: expected " in line and MISSING_MODEL not in line


@pytest.mark.parametrize("section, key", cases(NUMBERS, CONFIG_FLAGS))
def test_a_number_out_of_range_of_a_flag_is_refused(section, key, tmp_path, capsys):
    value = bad_number(section, key)
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    flag = CONFIG_FLAGS[f"{section}.{key}"]
    code, line = cli_failure([flag, text], tmp_path, capsys)
    assert code == 2 and flag in line and text in line and MISSING_MODEL not in line


@pytest.mark.parametrize("section, key", cases(NUMBERS, HF_KEYS))
def test_a_number_out_of_range_of_an_hf_argument_is_refused(section, key):
    argument, value = HF_KEYS[f"{section}.{key}"], bad_number(section, key)
    with pytest.raises(UsageError, match=r"^BlockCoordinateDescent\(" + argument + "=") as info:
        BlockCoordinateDescent(object(), **{"steps_per_visit": 2, argument: value})
    assert "expected" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("written, line", [
    ("[stop]\ntotal_steps = 0", "[stop] total_steps = 0: expected an integer >= 1"),
    ("[optim]\nwarmup_steps = -3", "[optim] warmup_steps = -3: expected an integer >= 0"),
    ('[run]\nreport_to = "tensorboard,tensorboard"',
     "[run] report_to = 'tensorboard,tensorboard': expected a comma list of none, tensorboard, wandb, mlflow, each "
     "named once"),
    ('[run]\nreport_to = "tensorboard,comet"', "expected a comma list of none, tensorboard, wandb, mlflow"),
    ('[blocks]\nexperts_with = "router,mlp"', "[blocks] experts_with = 'router,mlp': expected a comma list of "
                                              "none, router, shared, attention, rest"),
    ("[data]\nseq_len = \"long\"", "[data] seq_len = 'long': expected an integer"),
    ("[optim]\nlr = nan", "[optim] lr = nan: expected a finite number > 0"),
    ('[stop]\nrule = "gain"', "[stop] rule = 'gain': expected budget unless --order is importance or "
                              "importance-cached"),
    ('[blocks]\norder = "importance"\nstart_block = 1', "[blocks] start_block = 1: expected unset with "
                                                        "[blocks] order importance"),
    ('[blocks]\norder = "fixed"', "[blocks] order = 'fixed': expected a block list in --fixed-order"),
    ("[blocks]\nmemory_budget = 4096", "[blocks] memory_budget = 4096: expected unset without --ufp auto"),
    ('[blocks]\nufp = "auto"\ngpu = "h100"', "[blocks] gpu = 'h100': expected one of 4090"),
    ('[blocks]\nufp = "auto"', "[blocks] ufp = 'auto': expected a fraction, or auto with exactly one of"),
    ('[blocks]\nexperts = "half"', "[blocks] experts = 'half': expected top:SHARE with SHARE in (0, 1]"),
    ("[run]\npipeline = 2\nmicrobatches = 3", "[run] microbatches = 3: expected a divisor of --batch-size 8"),
    ("[run]\npipeline = 4\nmicrobatches = 2", "[run] microbatches = 2: expected at least [run] pipeline under"),
])
def test_a_file_s_bad_value_or_rule_between_keys_is_one_line_naming_it(written, line, tmp_path, capsys):
    path = tmp_path / "config.toml"
    path.write_text(written + "\n")
    code, got = cli_failure(["--config", str(path)], tmp_path, capsys)
    assert code == 2 and line in got and str(path) in got and MISSING_MODEL not in got


@pytest.mark.parametrize("argv, line", [
    (["--warmup-ratio", "0.1", "--warmup-steps", "2"], "--warmup-ratio 0.1 ([optim] warmup_ratio): expected 0 when "
                                                       "--warmup-steps is given"),
    (["--patience", "3", "--warmup-ratio", "0.1"], "--warmup-ratio 0.1 ([optim] warmup_ratio): expected 0 when a "
                                                   "visit ends on a plateau"),
    (["--stop", "gain"], "[stop] rule): expected budget unless --order is importance or importance-cached"),
    (["--order", "importance", "--start-block", "1"], "--start-block 1 ([blocks] start_block): expected unset"),
    (["--report-to", "mlflow,mlflow"], "--report-to mlflow,mlflow ([run] report_to): expected a comma list"),
    (["--ufp", "auto"], "--ufp auto ([blocks] ufp): expected a fraction, or auto with exactly one of "
                        "--memory-budget and --gpu"),
    (["--ufp", "1/2", "--blocks", "2"], "give only one of --ranges, --blocks, --ufp (got --blocks, --ufp)"),
    (["--pipeline", "2", "--pre-inference", "on", "--dask", "local:2"], "--dask local:2 ([pre_inference] dask): "
                                                                        "expected unset on a pipeline"),
])
def test_a_rule_between_flags_is_one_line_naming_the_flags(argv, line, tmp_path, capsys):
    code, got = cli_failure(argv, tmp_path, capsys)
    assert code == 2 and line in got and MISSING_MODEL not in got


def test_a_flag_overriding_a_file_is_named_as_the_flag_and_the_file_s_keys_by_the_file(tmp_path, capsys):
    path = tmp_path / "config.toml"
    path.write_text("[optim]\nwarmup_steps = 2\n")
    code, line = cli_failure(["--config", str(path), "--warmup-ratio", "0.5"], tmp_path, capsys)
    assert code == 2 and "--warmup-ratio 0.5 ([optim] warmup_ratio): expected 0 when [optim] warmup_steps is given" \
        in line


@pytest.mark.parametrize("arguments, message", [
    (dict(warmup_steps=-1), "BlockCoordinateDescent(warmup_steps=-1): expected an integer >= 0"),
    (dict(steps_per_visit=True), "BlockCoordinateDescent(steps_per_visit=True): expected an integer"),
    (dict(order="importance", start_block=0), "BlockCoordinateDescent(start_block=0): expected unset with order "
                                              "importance"),
    (dict(ufp="1.5"), "BlockCoordinateDescent(ufp='1.5'): expected auto or a fraction in (0, 1]"),
    (dict(betas=(0.9,)), "BlockCoordinateDescent(betas=[0.9]): expected two numbers in [0, 1)"),
    (dict(order="fixed"), "BlockCoordinateDescent(order='fixed'): expected a block list in fixed_order"),
])
def test_hf_arguments_are_checked_by_the_same_rules(arguments, message):
    with pytest.raises(UsageError) as info:
        BlockCoordinateDescent(object(), **{"steps_per_visit": 2, **arguments})
    assert str(info.value).startswith(message)


def test_a_config_without_a_stopping_rule_is_refused_and_a_loaded_one_gets_an_epoch():
    with pytest.raises(UsageError, match=r"\[stop\] steps_per_visit = None: expected a stopping rule"):
        Config().validate()
    assert load_config().stop.epochs_per_visit == 1.0 and load_config().validate() == load_config()


def test_the_previous_version_s_config_toml_loads_unchanged(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(PREVIOUS_CONFIG)
    config = load_config(path)
    assert config == load_config()
    dumped = dump_toml(config).splitlines()  # every line of the old file, and the keys added since at their defaults
    assert [line for line in dumped if line in PREVIOUS_CONFIG.splitlines()] == PREVIOUS_CONFIG.splitlines()


def test_resume_of_a_run_whose_config_holds_a_value_no_longer_accepted_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text(PREVIOUS_CONFIG.replace('decay = "none"', 'decay = "step"'))
    code, _, err = run_cli(["bcd", "--resume", "--out", str(out)], capsys)
    line = failure_line(err)
    assert code == 2 and f"{out / 'config.toml'}: [optim] decay = 'step': expected one of none, linear" in line
    assert sorted(path.name for path in out.iterdir()) == ["config.toml"]


def test_the_defaults_are_in_range_and_infinity_or_nan_is_not():
    config = load_config()
    for name, bound in BOUNDS.items():
        section, key = name.split(".")
        value = getattr(getattr(config, section), key)
        assert value is None or bound.ok(value), name
    assert not BOUNDS["optim.lr"].ok(math.inf) and not BOUNDS["data.eval_fraction"].ok(math.nan)
