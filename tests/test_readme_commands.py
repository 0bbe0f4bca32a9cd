"""Every `preinfer` command in README.md runs as written: the quick ones (`plan`, `--help`) for real, the slow
ones through the command line's own parser, so that a renamed or retyped flag fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pipelines.cli import COMMANDS, build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"


def _argv(line: str) -> list[str] | None:
    """The arguments after `preinfer` (or `torchrun ... -m pipelines.cli`) of a command line; None for other
    lines. `...` (flags left out) is dropped."""
    words = line.split()
    if words[:1] != ["preinfer"] and "pipelines.cli" not in words:
        return None
    words = shlex.split(line, comments=True)
    start = 1 if words[0] == "preinfer" else words.index("pipelines.cli") + 1
    return [word for word in words[start:] if word != "..."]


def readme_commands() -> list[list[str]]:
    """The commands of README.md's code blocks, and its inline `preinfer ... --flag` examples (COMMAND stands
    for each subcommand)."""
    text = README.read_text()
    lines = [line for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
             for line in block.replace("\\\n", " ").splitlines()]
    lines += [" ".join(span.split()) for span in re.findall(r"`(preinfer [^`]*--[^`]*)`", text)]
    commands = []
    for line in lines:
        argv = _argv(line)
        if argv is not None and "COMMAND" in argv:
            commands += [[name if word == "COMMAND" else word for word in argv] for name in COMMANDS]
        elif argv is not None:
            commands.append(argv)
    return commands


COMMAND_LINES = readme_commands()


def test_the_readme_shows_every_command_but_the_demo():
    assert {argv[0] for argv in COMMAND_LINES} == set(COMMANDS)  # the demo through `preinfer COMMAND --help`
    assert len(COMMAND_LINES) >= 20


QUICK = [argv for argv in COMMAND_LINES if argv[0] == "plan" or "--help" in argv]
SLOW = [argv for argv in COMMAND_LINES if argv not in QUICK]


@pytest.mark.parametrize("argv", QUICK, ids=" ".join)
def test_a_quick_command_runs(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # --help
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip() and not captured.err


@pytest.mark.parametrize("argv", SLOW, ids=" ".join)
def test_a_slow_command_parses(argv, capsys):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"preinfer {' '.join(argv)}: {capsys.readouterr().err.strip()}")
    assert args.command == argv[0] and callable(args.run)
