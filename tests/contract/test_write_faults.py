"""Faults during the writes of issue 48's last wave (part 4; DESIGN invariants 12 and 13): a run's checkpoint with
8-bit optimizer state and low-rank expansion factors (mid-visit), with the kept optimizer state, and the export
(the token store's: tests/contract/test_token_store_faults.py), each failing with a full disk and with a read-only
file system at every write the command makes. Each time nothing already written is lost (the last
complete checkpoint, the previous export and a complete token store stay bit for bit), the command ends in one line
naming what failed and what to do (exit 1), and the command that line names (the same command, or `--resume`) ends
as an uninterrupted run ends, bit for bit.

"Every write" is counted, not guessed: `FailingWrites` counts the writes of the project's publishing writers
(`preinfer.atomic_write`'s two and storage's `LocalBlobs.write`) in an uninterrupted run, then fails each in turn
with OSError(ENOSPC) or OSError(EROFS). A real full disk is a tmpfs of a size limit (`Tmpfs`: the test is root, and
skips only where mounting is refused), shrunk at the write the fault is wanted in. A real read-only file system is
that tmpfs remounted read-only between commands (a run resumed, a run's --token-store root, a tokenize job's --out);
while a job runs the remount is refused (EBUSY: the job holds its owner lock and metrics log open for writing), so
a read-only fault at a given write is injected (EROFS). Root ignores permission bits, so no chmod."""

from pathlib import Path

import pytest

from tests.helpers.cli_run import run_cli
from tests.helpers.disk_faults import ENOSPC, EROFS, FailingWrites, files
from tests.helpers.write_faults import (
    ERRORS, RUNS, assert_finished_as, bcd_args, failed, kept, rerun_named, run_main, the_error_line,
)


# ---- checkpoints: 8-bit state, expansion factors, kept state ----


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(ERRORS))
@pytest.mark.parametrize("run", list(RUNS))
def test_a_run_failing_at_any_write_keeps_what_it_wrote_and_the_command_it_names_ends_it_as_uninterrupted(
        run, fault, tmp_path, corpus, run_tokens, uninterrupted_runs, capsys):
    """Each write of the run in its directory in turn (config.toml, inputs.json, every file of every checkpoint,
    the export, summary.json) raises ENOSPC or EROFS: every complete checkpoint and export written before it stays
    bit for bit, and the command the line names ends with the uninterrupted run's weights, optimizer state (8-bit
    moments, expansion factors, kept state) and export."""
    expected = uninterrupted_runs[run]
    assert expected.writes.count("checkpoint.tmp/state.safetensors") >= 3 and "export" in expected.writes
    for at in range(1, len(expected.writes) + 1):
        out = tmp_path / f"at-{at}"
        argv = bcd_args(corpus, run_tokens, out, run)
        before: dict[str, bytes] = {}
        with pytest.MonkeyPatch.context() as patch:
            FailingWrites(patch, at, ERRORS[fault], under=out, before_fault=lambda _: before.update(kept(out)))
            line = failed(argv, capsys, ERRORS[fault])
        where = expected.writes[at - 1]
        assert str(out) in line, line
        assert {k: v for k, v in kept(out).items() if k in before} == before, f"write {at}: {where}"
        code, _, err = run_cli(rerun_named(line, argv, out), capsys)
        assert code == 0, f"write {at} ({where}): {err}"
        assert_finished_as(out, expected.finished)


@pytest.mark.slow
@pytest.mark.parametrize("file", ["model.safetensors", "state.safetensors"])
def test_a_real_full_disk_inside_a_mid_visit_checkpoint_keeps_the_one_before(file, tmpfs, corpus, run_tokens,
                                                                             uninterrupted_runs, capsys):
    """The tmpfs holding the run fills inside the 8-bit, low-rank run's first checkpoint after a complete one (the
    visit's step 2), in its weights or its optimizer state: the first checkpoint stays, and --resume ends as the
    uninterrupted run."""
    expected = uninterrupted_runs["adamw8bit-lowrank"]
    out = tmpfs.path / "run"
    argv = bcd_args(corpus, run_tokens, out, "adamw8bit-lowrank")
    before: dict[str, bytes] = {}

    def fill(_: Path) -> None:
        before.update(kept(out))
        tmpfs.leave_free(4096)  # one page: less than the file needs
    with pytest.MonkeyPatch.context() as patch:
        FailingWrites(patch, expected.at(f"checkpoint.tmp/{file}", 2), None, under=out, before_fault=fill)
        line = failed(argv, capsys, ENOSPC)
    assert before and f"writing the checkpoint {out / 'checkpoint.tmp'} failed" in line, line
    assert kept(out) == before and not (out / "checkpoint.tmp").exists()
    tmpfs.writable()
    code, _, err = run_cli(rerun_named(line, argv, out), capsys)
    assert code == 0, err
    assert_finished_as(out, expected.finished)


# ---- the export ----

# The export's files in the order they are written: transformers' config and generation config, the weights, the
# tokenizer's config, then its tokenizer.json (written by the `tokenizers` library).
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
                "tokenizer.json")
PAGE = 4096


def pages(size: int) -> int:
    return -(-size // PAGE)


@pytest.fixture(scope="module")
def longer(tmp_path_factory, corpus, run_tokens) -> dict[str, bytes]:
    """The export of the 8-bit, low-rank run given 4 steps (both visits) uninterrupted."""
    out = tmp_path_factory.mktemp("longer") / "run"
    assert run_main(bcd_args(corpus, run_tokens, out, "adamw8bit-lowrank", "--total-steps", "4")) == 0
    return files(out / "export")


def finished_with_an_export(corpus: str, tokens: Path, out: Path, capsys) -> tuple[list[str], dict[str, bytes]]:
    """A run of 2 steps finished at `out` (its export written); the command that raises its budget to 4 steps,
    and the export it has now."""
    code, _, err = run_cli(bcd_args(corpus, tokens, out, "adamw8bit-lowrank", "--total-steps", "2"), capsys)
    assert code == 0, err
    return ["bcd", "--out", str(out), "--resume", "--total-steps", "4"], files(out / "export")


@pytest.mark.slow
@pytest.mark.parametrize("file", EXPORT_FILES)
def test_a_real_full_disk_in_any_file_of_the_export_keeps_the_previous_export(file, tmpfs, corpus, run_tokens, longer,
                                                                              capsys):
    """A finished run resumed with a larger --total-steps writes a new export; the tmpfs fills inside each of its
    files in turn (when the export starts it has room for the files before that one and half of that one): the
    previous export stays bit for bit, nothing of the new one is left, and the same command, given room, ends with
    the export of the run given the larger budget from the start."""
    out = tmpfs.path / "run"
    argv, previous = finished_with_an_export(corpus, run_tokens, out, capsys)
    assert set(previous) == set(EXPORT_FILES)
    index = EXPORT_FILES.index(file)
    room = sum(pages(len(longer[name])) for name in EXPORT_FILES[:index]) + pages(len(longer[file])) // 2
    with pytest.MonkeyPatch.context() as patch:
        FailingWrites(patch, "export", None, under=out, before_fault=lambda _: tmpfs.leave_free(room * PAGE))
        line = failed(argv, capsys, ENOSPC)
    assert f"the run in {out} stopped (No space left on device at {out / 'export'})" in line, line
    assert line.endswith(f"then run `preinfer bcd --out {out} --resume`")
    assert files(out / "export") == previous
    assert [p.name for p in out.iterdir() if p.name.startswith(".export")] == []
    tmpfs.writable()
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert files(out / "export") == longer


@pytest.mark.slow
def test_a_run_resumed_on_a_read_only_disk_keeps_its_checkpoint_and_export(tmpfs, corpus, run_tokens, longer, capsys):
    """The tmpfs holding a finished run is remounted read-only, and the run is resumed with a larger budget: one
    line, the checkpoint and the export as they were; once writable again the same command writes the new export."""
    out = tmpfs.path / "run"
    argv, previous = finished_with_an_export(corpus, run_tokens, out, capsys)
    before = files(out)
    tmpfs.read_only()
    code, _, err = run_cli(argv, capsys)
    line = the_error_line(err)
    assert code == 1 and f"--out {out}: its owner lock .owner.lock cannot be opened (Read-only file system" in line
    assert line.endswith("make it writable, then run the same command again"), line
    assert files(out) == before and files(out / "export") == previous
    tmpfs.writable()
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert files(out / "export") == longer
