"""The reference pages in docs/reference are the ones `python -m pipelines.reference` generates from the code:
a flag, config key or metrics field changed without `make docs` fails here."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from pipelines import reference
from preinfer.config import Config
from preinfer.metrics import RECORD_KINDS


def test_the_committed_pages_are_the_generated_ones():
    assert reference.stale_pages(reference.REFERENCE) == [], "run `make docs` and commit docs/reference"


def test_check_names_a_stale_page_and_exits_1(tmp_path: Path, capsys):
    assert reference.main(["--out", str(tmp_path)]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(reference.PAGES)
    assert reference.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "config.md").write_text((tmp_path / "config.md").read_text().replace("`seq_len`", "`seq_length`"))
    (tmp_path / "metrics.md").unlink()
    assert reference.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "config.md is stale" in err and "metrics.md is stale" in err and "cli.md" not in err


def test_generation_is_deterministic():
    assert [page() for page in reference.PAGES.values()] == [page() for page in reference.PAGES.values()]


def test_the_pages_cover_every_command_section_key_and_record_field():
    cli, config, metrics = reference.cli_page(), reference.config_page(), reference.metrics_page()
    for name, parser in reference.command_parsers().items():
        assert f"## preinfer {name}\n" in cli
        page = cli.split(f"## preinfer {name}\n", 1)[1].split("\n## ", 1)[0]
        options = [option for action in parser._actions if action.dest != "help" for option in action.option_strings]
        assert all(re.search(rf"(?<![\w-]){option}\b(?!-)", page) for option in options)
    for section, values in Config().to_dict().items():
        assert f"## [{section}]\n" in config
        assert all(f"| `{key}` |" in config for key in values)
    for kind, cls in RECORD_KINDS.items():
        section = metrics.split(f"\n## {kind}\n", 1)[1].split("\n## ", 1)[0]
        assert all(f"| `{name.rstrip('_')}` |" in section for name in (item.name for item in fields(cls)))


def test_a_field_comment_is_its_description():
    doc, notes = reference.source_notes(RECORD_KINDS["cache"])
    assert doc == "Pre-inference made, reused or deleted a store of boundary states."
    assert notes["from_"].startswith("input and roll_forward: the boundary the store was made from")
    assert "| `from` | `int \\| None` | when set | input and roll_forward" in reference.metrics_page()
