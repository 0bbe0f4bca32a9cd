"""Every `preinfer` command in README.md and the guides in docs/ runs as written: the quick ones (`plan`, `--help`)
for real, the slow ones through the command line's own parser, so that a renamed or retyped flag fails here.
A `plan` of a model file the docs only name (`--model some/config.json`) is parsed, not run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from pipelines.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _argv(line: str) -> list[str] | None:
    """The arguments after `preinfer` (or `torchrun ... -m pipelines.cli`) of a command line; None for other
    lines. `...` (flags left out) is dropped."""
    words = line.split()
    if words[:1] != ["preinfer"] and "pipelines.cli" not in words:
        return None
    words = shlex.split(line, comments=True)
    start = 1 if words[0] == "preinfer" else words.index("pipelines.cli") + 1
    return [word for word in words[start:] if word != "..."]


def page_commands(page: Path) -> list[list[str]]:
    """The commands of a page's code blocks, and its inline `preinfer ... --flag` examples (COMMAND stands for
    each subcommand); results.md's inline spans are fragments of prose (`cache --boundary K`), not commands."""
    text = page.read_text()
    lines = [line for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
             for line in block.replace("\\\n", " ").splitlines()]
    if page.name != "results.md":
        lines += [" ".join(span.split()) for span in re.findall(r"`(preinfer [^`]*--[^`]*)`", text)]
    commands = []
    for line in lines:
        argv = _argv(line)
        if argv is not None and "COMMAND" in argv:
            commands += [[name if word == "COMMAND" else word for word in argv] for name in COMMANDS]
        elif argv is not None:
            commands.append(argv)
    return commands


def _runs_here(argv: list[str]) -> bool:
    """`plan` and `--help` run in a moment, unless the plan's model is a file the page only names."""
    if "--help" in argv:
        return True
    model = argv[argv.index("--model") + 1] if "--model" in argv[:-1] else ""
    return argv[0] == "plan" and ("/" not in model or Path(model).exists())


def _id(command: tuple[str, list[str]]) -> str:
    return f"{command[0]}: {' '.join(command[1])}"


COMMAND_LINES = [(page.relative_to(ROOT).as_posix(), argv) for page in PAGES for argv in page_commands(page)]


def test_the_readme_shows_every_command_but_the_demo():
    readme = [argv for page, argv in COMMAND_LINES if page == "README.md"]
    assert {argv[0] for argv in readme} == set(COMMANDS)  # the demo through `preinfer COMMAND --help`
    assert len(readme) >= 10


def test_every_guide_is_read():
    pages = {page for page, _ in COMMAND_LINES}
    assert {"docs/fine-tuning.md", "docs/pre-inference.md", "docs/parallelism.md", "docs/reliability.md"} <= pages
    assert len(COMMAND_LINES) >= 60


QUICK = [command for command in COMMAND_LINES if _runs_here(command[1])]
SLOW = [command for command in COMMAND_LINES if command not in QUICK]


@pytest.mark.parametrize("command", QUICK, ids=_id)
def test_a_quick_command_runs(command, capsys):
    page, argv = command
    try:
        code = main(argv)
    except SystemExit as exit_:  # --help
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 0, f"{page}: {captured.err}"
    assert captured.out.strip() and not captured.err


@pytest.mark.parametrize("command", SLOW, ids=_id)
def test_a_slow_command_parses(command, capsys):
    page, argv = command
    here = ["cpu" if torch.cuda.device_count() == 0 and word.startswith("cuda") and before == "--device" else word
            for before, word in zip(["", *argv], argv)]  # a page's GPU line parses on this machine's device
    try:
        args = build_parser().parse_args(here)
    except SystemExit:
        pytest.fail(f"{page}: preinfer {' '.join(argv)}: {capsys.readouterr().err.strip()}")
    assert args.command == argv[0] and callable(args.run)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_short_and_links_every_guide():
    assert len(README.read_bytes()) <= 10240
    links = set(re.findall(r"\]\(docs/([^)#]+)", README.read_text()))
    assert {page.name for page in PAGES[1:]} - {"README.md"} <= links
    assert {"reference/cli.md", "reference/config.md", "reference/metrics.md"} <= links


@pytest.mark.parametrize("page", PAGES + sorted((ROOT / "docs" / "reference").glob("*.md")), ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.is_file(), f"{page.name}: {target}"
        assert not anchor or anchor in _anchors(linked), f"{page.name}: {target}"


def test_the_in_memory_data_example_runs():
    """concepts.md's example of `pipelines.data.in_memory` runs as written and gives what its comments say."""
    blocks = [block for page in PAGES for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
              if "pipelines.data.in_memory" in block]
    assert len(blocks) == 1
    names: dict = {}
    exec(blocks[0], names)
    data, batch = names["data"], names["batch"]
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "input_ids": (8, 64), "attention_mask": (8, 64), "labels": (8, 64)}
    streamed = torch.cat([torch.from_numpy(block.ids.astype("int64")) for block in names["blocks"]])
    assert torch.equal(streamed, data.input_ids)


@pytest.mark.slow
def test_the_trainer_guide_s_example_runs_as_written(tmp_path, monkeypatch):
    """docs/trainer.md's Python block, executed as it stands, trains by blocks through transformers.Trainer and
    leaves a checkpoint whose optimizer state holds the block position."""
    (code,) = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "trainer.md").read_text(), re.S | re.M)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/trainer.md", "exec"), scope)
    assert (scope["bcd"].optimizer.sweep, scope["bcd"].optimizer.visit) == (1, 0)  # 2 visits of 4 steps each
    saved = torch.load(tmp_path / "runs/hf-bcd/checkpoint-4/optimizer.pt", weights_only=True)
    assert saved["position"] == dict(sweep=0, visit=1, visit_step=0, global_step=4)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_bench_script_named_exists(page: Path):
    """A benchmark is named as it runs, `python -m bench.NAME` (`python bench/NAME.py` finds no `bench.lib`)."""
    text = page.read_text()
    named = {f"bench/{name}.py" for name in re.findall(r"\bpython -m bench\.(\w+)", text)}
    assert {name for name in named if not (ROOT / name).is_file()} == set(), page.name
    assert re.findall(r"\bpython bench/\w+\.py\b", text) == [], page.name
