"""Issue 48's config cases: one resume-compatibility check for the CLI and the HF front-end (cases 2, 6, 10),
messages that name the changed key as its source names it, a TOML partition given twice (case 12), and TOML's list
form of every comma-list key (case 15); each with a variant of its class."""

import pytest
import torch

from pipelines.flags import CONFIG_FLAGS
from preinfer.config import load_config
from preinfer.errors import UsageError
from preinfer.hf import BlockCoordinateDescent
from preinfer.presets import build_preset
from tests.helpers.cli_run import failure_line, run_cli, tree
from tests.helpers.trainers import live_batches

OPTIONS = dict(blocks=3, steps_per_visit=3, lr=1e-3)
QUICK = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "1", "--max-samples",
         "16", "--eval-tokens", "64", "--lr", "1e-3", "--blocks", "2"]


def hf_state(**options) -> dict:
    """The HF optimizer's state after 2 steps of a BCD with OPTIONS and `options`."""
    model = build_preset("tiny-llama", seed=0)
    bcd = BlockCoordinateDescent(model, **{**OPTIONS, **options})
    for batch in live_batches(2):
        model(**batch).loss.backward()
        bcd.optimizer.step()
        bcd.scheduler.step()
    return bcd.optimizer.state_dict()


def hf_resume_refusal(saved: dict, resumed: dict) -> str:
    state = hf_state(**saved)
    bcd = BlockCoordinateDescent(build_preset("tiny-llama", seed=0), **{**OPTIONS, **resumed})
    with pytest.raises(UsageError) as refused:
        bcd.optimizer.load_state_dict(state)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "--" not in message  # the arguments, never a CLI flag
    return message


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [
    ("adam", "adam8bit"), ("adamw", "adamw8bit"),  # case 2: resumed silently, weights matching neither run
    ("adam8bit", "adam"),  # case 6: KeyError 'exp_avg'
    ("adam", "sgd"),  # the same class: any other optimizer
])
def test_an_hf_resume_under_another_optimizer_is_refused_naming_it(saved, resumed):
    message = hf_resume_refusal(dict(optimizer=saved), dict(optimizer=resumed))
    assert message.startswith(f"optimizer={resumed!r}: the checkpoint was trained with optimizer={saved!r}")


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed, named", [
    (dict(block_lr="1,0.5,0.5"), dict(block_lr="1,1,1"), "block_lr"),  # case 10: blamed lr
    (dict(block_lr="depth:0.5..1"), dict(), "block_lr"),  # dropped
    (dict(), dict(fused_step=True), "fused_step"),  # the same class: a key the optimizer state does not hold
    (dict(keep_state=True, expand="none"), dict(expand="none"), "keep_state"),
])
def test_an_hf_resume_with_a_changed_argument_names_that_argument(saved, resumed, named):
    assert hf_resume_refusal(saved, resumed).startswith(f"{named}=")


@pytest.mark.slow
def test_an_hf_checkpoint_resumes_with_the_arguments_it_was_trained_with():
    state = hf_state(optimizer="adamw", block_lr=[1, 0.5, 0.5])  # the list form is the comma form
    bcd = BlockCoordinateDescent(build_preset("tiny-llama", seed=0), **OPTIONS, optimizer="adamw",
                                 block_lr="1,0.5,0.5")
    bcd.optimizer.load_state_dict(state)
    assert (bcd.optimizer.visit, bcd.optimizer.visit_step) == (0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("flags, named", [
    (["--keep-optimizer-state"], "[optim] keep_state False -> True"),  # case 10: blamed the run's own config.toml
    (["--pipeline", "2"], "[run] pipeline 1 -> 2"),  # the same class: another rule of the saved lowrank
])
def test_a_cli_resume_names_the_flag_it_changes_not_the_saved_config(flags, named, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["bcd", *QUICK, "--out", str(out), "--total-steps", "1", "--expand", "lowrank"], capsys)[0] == 0
    before = tree(out)
    code, _, err = run_cli(["bcd", *QUICK, "--out", str(out), "--resume", *flags], capsys)
    line = failure_line(err)
    assert code == 2 and f"error: --resume continues the run in {out} as configured, but the flags change" in line
    assert named in line
    assert "config.toml" not in line and tree(out) == before


@pytest.mark.parametrize("partition", ['blocks = 2\nufp = "1/2"', 'ranges = "0-0,1-1"\nufp = "1/2"',
                                       'ranges = "0-0,1-1"\nblocks = 2'])
def test_a_toml_partition_given_twice_is_refused_as_the_flags_are(partition, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"[blocks]\n{partition}\n")
    with pytest.raises(UsageError, match=f"^{path}: give only one of \\[blocks\\] ranges, \\[blocks\\] blocks, "
                                         f"\\[blocks\\] ufp") as refused:  # case 12: the ufp was silently ignored
        load_config(path, flags=CONFIG_FLAGS)
    assert len(str(refused.value).splitlines()) == 1


def test_a_toml_partition_key_unsets_the_default_ufp(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[blocks]\nblocks = 2\n")
    config = load_config(path, flags=CONFIG_FLAGS)
    assert (config.blocks.blocks, config.blocks.ufp) == (2, None)  # recorded without the default ufp beside it


def test_every_comma_list_key_takes_toml_list_form(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[blocks]\nblocks = 3\norder = "fixed"\nfixed_order = [2, 0, 1]\n'
                    'experts_with = ["router", "attention"]\n[optim]\nblock_lr = [1, 0.5, 0.25]\n'
                    '[run]\nreport_to = ["tensorboard"]\n')  # case 15: "expected a string"
    config = load_config(path, flags=CONFIG_FLAGS)
    assert (config.blocks.fixed_order, config.blocks.experts_with, config.optim.block_lr, config.run.report_to) == \
        ("2,0,1", "router,attention", "1,0.5,0.25", "tensorboard")
    ranges = tmp_path / "ranges.toml"
    ranges.write_text('[blocks]\nranges = ["0-0", "1-1"]\n')
    assert load_config(ranges, flags=CONFIG_FLAGS).blocks.ranges == "0-0,1-1"


def test_a_toml_list_of_bad_items_is_refused_as_the_comma_form_is(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[optim]\nblock_lr = [1, "x"]\n')
    with pytest.raises(UsageError, match=r"\[optim\] block_lr = '1,x': expected depth:LO..HI or a comma list"):
        load_config(path, flags=CONFIG_FLAGS)


def test_the_hf_front_end_takes_a_list_for_a_comma_list_argument():
    bcd = BlockCoordinateDescent(build_preset("tiny-llama", seed=0), blocks=3, steps_per_visit=1, order="fixed",
                                 fixed_order=[2, 0, 1], block_lr=(1, 0.5, 0.25))
    assert bcd.optimizer.order(0) == [2, 0, 1]
    assert bcd.optimizer.current.lr == pytest.approx(0.25 * 5e-5)  # block 2's factor of adam's default rate


def test_the_hf_front_end_refuses_an_unknown_argument_and_two_partitions_in_one_line():
    model = build_preset("tiny-llama", seed=0)
    with pytest.raises(UsageError, match=r"^BlockCoordinateDescent\(\) got an unknown argument 'block'"):
        BlockCoordinateDescent(model, steps_per_visit=1, block=3)
    with pytest.raises(UsageError, match=r"^give only one of ranges, blocks, ufp \(got blocks, ufp\)"):
        BlockCoordinateDescent(model, steps_per_visit=1, blocks=3, ufp=0.5)
    assert all(p.dtype == torch.float32 for p in model.parameters())
