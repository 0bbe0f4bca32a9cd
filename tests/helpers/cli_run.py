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
