"""Faults during the token store's writes (issue 48, part 4; DESIGN invariants 12 and 13): `preinfer tokenize` and
the token store a run writes under `--token-store`, each failing with a full disk and with a read-only file system
at every write it makes (counted in an uninterrupted job: see tests/contract/test_write_faults.py for how), and on a
real tmpfs filled mid-store and remounted read-only between commands. Each time the complete token stores beside it
stay bit for bit, the command ends in one line (exit 1) naming the token store and the remedy, and the same command
ends with the bytes of an uninterrupted job."""


import shutil
from pathlib import Path

import pytest

from tests.helpers.cli_run import run_cli
from tests.helpers.disk_faults import ENOSPC, EROFS, FailingWrites, files
from tests.helpers.write_faults import ERRORS, assert_finished_as, bcd_args, failed, run_main, tokenize_args


# ---- the token store ----


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, corpus) -> tuple[dict[str, bytes], list[str]]:
    """`preinfer tokenize` uninterrupted: its files, and its writes (paths relative to --out)."""
    out = tmp_path_factory.mktemp("tokenized") / "tokens"
    with pytest.MonkeyPatch.context() as patch:
        writes = FailingWrites(patch, under=out)
        assert run_main(tokenize_args(corpus, out)) == 0
    return files(out), [path.relative_to(out).as_posix() for path in writes.paths]


def another_token_store(corpus: str, root: Path, capsys) -> dict[str, bytes]:
    """A complete token store of another setting (seq_len 16) in `root`: what no fault may change."""
    code, _, err = run_cli(["tokenize", "--data", corpus, "--seq-len", "16", "--quiet", "--out", str(root / "other")],
                           capsys)
    assert code == 0, err
    return files(root / "other")


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(ERRORS))
def test_tokenize_failing_at_any_write_resumes_to_the_uninterrupted_bytes(fault, tmp_path, corpus, tokenized,
                                                                          capsys):
    """Each write of `preinfer tokenize` in turn (staging, chunks, shards, their records, the manifests, the
    description) raises ENOSPC or EROFS: one line naming --out and the remedy, a complete token store beside it
    unchanged, and the same command ends with the bytes of an uninterrupted job."""
    expected, writes = tokenized
    assert {"token-store.json", "staging/plan.json"} <= set(writes) and any(w.startswith("train/") for w in writes)
    other = another_token_store(corpus, tmp_path, capsys)
    for at in range(1, len(writes) + 1):
        out = tmp_path / f"at-{at}"
        with pytest.MonkeyPatch.context() as patch:
            FailingWrites(patch, at, ERRORS[fault], under=out)
            line = failed(tokenize_args(corpus, out), capsys, ERRORS[fault])
        assert f"writing the token store in {out} failed" in line, f"write {at} ({writes[at - 1]}): {line}"
        assert line.endswith("then run the same command again: it resumes from the chunks and shards already "
                             "written"), line
        assert files(tmp_path / "other") == other
        code, _, err = run_cli(tokenize_args(corpus, out), capsys)
        assert code == 0, f"write {at} ({writes[at - 1]}): {err}"
        assert files(out) == expected


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(ERRORS))
def test_a_run_s_token_store_failing_at_any_write_keeps_the_complete_ones_and_the_same_command_ends_the_run(
        fault, tmp_path, corpus, uninterrupted_runs, capsys):
    """A run's token store, written under its --token-store root, fails at each of its writes in turn: one line
    naming it, the root's other complete token stores unchanged, and the same command ends with the token store and
    the weights of the uninterrupted run."""
    expected = uninterrupted_runs["adamw8bit-lowrank"]
    root = tmp_path / "tokens"
    other = another_token_store(corpus, root, capsys)
    with pytest.MonkeyPatch.context() as patch:  # how many writes a run makes in a token store of its own
        writes = FailingWrites(patch, under=root)
        assert run_main(bcd_args(corpus, root, tmp_path / "counted", "adamw8bit-lowrank")) == 0
    store = next(p for p in root.iterdir() if p.name != "other")
    store_files = files(store)
    count = len([path for path in writes.paths if path.is_relative_to(store)])
    assert count == len(writes.paths) >= 5
    for at in range(1, count + 1):
        shutil.rmtree(store)
        out = tmp_path / f"at-{at}"
        argv = bcd_args(corpus, root, out, "adamw8bit-lowrank")
        with pytest.MonkeyPatch.context() as patch:
            FailingWrites(patch, at, ERRORS[fault], under=root)
            line = failed(argv, capsys, ERRORS[fault])
        assert f"writing the token store in {store} failed" in line, line
        assert files(root / "other") == other
        code, _, err = run_cli(argv, capsys)
        assert code == 0, f"write {at}: {err}"
        assert files(store) == store_files
        assert_finished_as(out, expected.finished)


@pytest.mark.slow
def test_a_real_full_or_read_only_token_store_root_keeps_what_it_holds_and_the_same_command_then_runs(
        tmpfs, tmp_path, corpus, uninterrupted_runs, capsys):
    """A run's --token-store root on a tmpfs: full in the middle of the token store's writes (a real ENOSPC), then
    remounted read-only (a real EROFS); each time one line, the complete token store beside it unchanged; once
    writable with room, the same command ends with the uninterrupted run's weights."""
    expected = uninterrupted_runs["adamw8bit-lowrank"]
    root = tmpfs.path / "tokens"
    other = another_token_store(corpus, root, capsys)
    argv = bcd_args(corpus, root, tmp_path / "run", "adamw8bit-lowrank")
    with pytest.MonkeyPatch.context() as patch:
        writes = FailingWrites(patch, 4, None, under=root, before_fault=lambda _: tmpfs.leave_free(0))
        failed(argv, capsys, ENOSPC)
    assert len(writes.paths) >= 4 and files(root / "other") == other
    tmpfs.read_only()
    line = failed(argv, capsys, EROFS)
    assert str(root) in line and files(root / "other") == other
    tmpfs.writable()
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert_finished_as(tmp_path / "run", expected.finished)


def outside_staging(tree: dict[str, bytes]) -> dict[str, bytes]:
    return {path: data for path, data in tree.items() if not path.startswith("staging/")}


def test_tokenize_overwrite_failing_keeps_the_replaced_store_whole_and_the_same_command_replaces_it(
        tmpfs, tmp_path, corpus, tokenized, capsys):
    """`tokenize --overwrite` over a complete token store of another setting packs the new one beside it and swaps
    it in. A real full disk in the middle of the new store's shards (the tmpfs shrunk there), and an injected full
    or read-only one at the first and the last write of its shards, leave the replaced store bit for bit; a fault at
    the new store's description (the last write, after the swap) leaves the new splits in place. Each time the same
    command then ends with the bytes of an uninterrupted job."""
    expected, _ = tokenized
    out = tmpfs.path / "tokens"
    code, _, err = run_cli(["tokenize", "--data", corpus, "--seq-len", "16", "--samples-per-shard", "8", "--quiet",
                            "--out", str(out)], capsys)
    assert code == 0, err
    replaced, pristine = files(out), tmp_path / "replaced"
    shutil.copytree(out, pristine)
    argv = [*tokenize_args(corpus, out), "--overwrite"]
    with pytest.MonkeyPatch.context() as patch:  # the writes of an uninterrupted replacement, in order
        writes = FailingWrites(patch, under=out)
        assert run_main(argv) == 0
    assert outside_staging(files(out)) == expected
    written = [path.relative_to(out).as_posix() for path in writes.paths]
    shards = [at for at, path in enumerate(written, start=1) if path.startswith("staging/replacement/")]
    assert len(shards) >= 4 and written[-1] == "token-store.json"

    def restored() -> None:
        shutil.rmtree(out)
        shutil.copytree(pristine, out)

    restored()
    with pytest.MonkeyPatch.context() as patch:
        FailingWrites(patch, shards[len(shards) // 2], None, under=out, before_fault=lambda _: tmpfs.leave_free(0))
        failed(argv, capsys, ENOSPC)
    assert outside_staging(files(out)) == replaced
    tmpfs.writable()
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert files(out) == expected
    for at, fault in ((shards[0], "full-disk"), (shards[-1], "read-only"), (len(written), "full-disk")):
        restored()
        with pytest.MonkeyPatch.context() as patch:
            FailingWrites(patch, at, ERRORS[fault], under=out)
            failed(argv, capsys, ERRORS[fault])
        if at < len(written):
            assert outside_staging(files(out)) == replaced, written[at - 1]
        else:
            assert {path for path in files(out) if not path.startswith("staging/")} == set(expected) - {
                "token-store.json"}
        code, _, err = run_cli(argv, capsys)
        assert code == 0, f"{written[at - 1]}: {err}"
        assert files(out) == expected, written[at - 1]
