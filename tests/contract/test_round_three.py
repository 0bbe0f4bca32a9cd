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
    (["--lr", "1e40"], "--lr 1e+40 ([optim] lr): expected a finite number > 0, at most 3.4e38"),
    (["--lr", "1e38"], "--lr / (1 - beta1) is 1e+39"),  # the rate fits, Adam's first step does not
    (["--block-lr", "1e308,1e308"], "--block-lr 1e308,1e308 ([optim] block_lr): expected depth:LO..HI"),
    (["--block-lr", "depth:1..1e300"], "each at most 3.4e38"),  # block 0 would train, block 1 die
    (["--lr", "1e37", "--block-lr", "depth:1..100"], "the largest factor of --block-lr"),
    (["--optimizer", "adamw", "--lr", "1e30", "--weight-decay", "1e30"], "times --weight-decay 1e+60"),
    (["--momentum", "1e39", "--optimizer", "sgd"], "--momentum 1e+39 ([optim] momentum)"),
    (["--grad-clip", "1e39"], "--grad-clip 1e+39"),
    (["--expand-lr", "1e39"], "--expand-lr 1e+39"),
]


@pytest.mark.parametrize("flags, message", OVERFLOWING, ids=[" ".join(f) for f, _ in OVERFLOWING])
def test_a_number_torch_cannot_hold_is_refused_before_any_load(tiny, corpus, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out), *flags], capsys)
    assert code == 2 and message in failure_line(err) and not out.exists()


def test_an_overflowing_rate_in_toml_or_the_hf_front_end_is_refused(tiny, corpus, tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("[optim]\nlr = 1e40\n")
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--config", str(config), "--model", "tiny-llama", "--out", str(out)], capsys)
    assert code == 2 and "[optim] lr = 1e+40: expected a finite number > 0, at most 3.4e38" in failure_line(err)
    assert not out.exists()
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
