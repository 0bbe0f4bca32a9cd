"""Per-block learning rates (`--block-lr`): the depth rule and the explicit list give each block its factor of the
rate, which the visit trains at and the records show; a malformed value or a list of the wrong length is refused in
one line."""

import pytest
import torch

from preinfer.block_lr import parse_block_lr
from preinfer.errors import UsageError
from preinfer.metrics import StepRecord
from tests.helpers.cli_run import failure_line, run_cli
from tests.helpers.trainers import make_trainer, snapshot


@pytest.mark.parametrize("text, blocks, factors", [
    ("depth:0.5..1.5", 3, [0.5, 1.0, 1.5]), ("depth:2..1", 5, [2.0, 1.75, 1.5, 1.25, 1.0]),
    ("depth:0.5..1.5", 1, [0.5]), ("1,0.5,0.25", 3, [1.0, 0.5, 0.25]), ("3", 1, [3.0]),
])
def test_the_rule_and_the_list_give_each_block_its_factor(text, blocks, factors):
    assert parse_block_lr(text).factors(blocks) == pytest.approx(factors, rel=1e-15)


def test_a_list_of_another_length_than_the_partition_is_refused_when_the_trainer_is_made():
    with pytest.raises(UsageError, match=r"^\[optim\] block_lr = '1,2': expected 3 factors, one per block of the "
                                         r"partition"):  # a rule of the resolved run (`check_resolved`)
        make_trainer(optim__block_lr="1,2")


@pytest.mark.parametrize("text", ["depth:0.5", "depth:0.5..x", "width:1..2", "1,,2", "1,0,2", "-1", "1,inf", "nan"])
def test_a_malformed_value_is_refused_in_one_line_before_anything_is_opened(text, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--model", "/does/not/exist", "--out", str(out), "--block-lr", text], capsys)
    line = failure_line(err)
    assert code == 2 and f"--block-lr {text} ([optim] block_lr): expected depth:LO..HI or a comma list" in line
    assert not out.exists()


def test_each_visit_trains_at_its_block_s_rate_and_the_records_show_it():
    records = []
    trainer = make_trainer(optim__block_lr="depth:0.5..1.5", blocks__sweeps=2, on_record=records.append)
    trainer.fit()
    factors = {0: 0.5, 1: 1.0, 2: 1.5}
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert steps and all(r.lr == pytest.approx(1e-3 * factors[r.block], rel=1e-12) for r in steps)
    assert [v["lr"] for v in trainer.position.visits] == pytest.approx([1e-3 * factors[v["block"]]
                                                                        for v in trainer.position.visits])


def test_a_factor_of_two_everywhere_trains_as_twice_the_rate():
    doubled, faster, plain = (make_trainer(**options) for options in (
        dict(optim__block_lr="2,2,2"), dict(optim__lr=2e-3), dict()))
    for trainer in (doubled, faster, plain):
        trainer.fit()
    a, b, c = (snapshot(t.staged.model) for t in (doubled, faster, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
