"""Running `preinfer` in the test's own process, as a user would from the shell."""

import pytest

from pipelines.cli import main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """The exit code of `preinfer ARGV` (also when it ends in SystemExit) and what it printed to stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def failure_line(err: str) -> str:
    """The one line a failed command printed to stderr (a progress bar's redraws, text before a carriage return,
    left out); fails the test on a traceback or more than one line."""
    assert "Traceback" not in err, err
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def tree(root) -> dict[str, bytes]:
    """Every file under `root` (a pathlib.Path) by relative path, with its bytes; {} when `root` does not exist."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
