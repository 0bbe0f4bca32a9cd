"""A chat-format dataset built from text that ships with every CPython: Python's own pydoc topics
(`pydoc_data.topics.topics`, the text of `help("assert")`).

Every titled section of every topic (the topic's title, underlined with `*`, and its sections, underlined with
`=` or `-`) becomes one conversation of two turns: the user asks `What is <title> in Python?`, the assistant
answers with the section's first paragraph, its lines joined by spaces. Sections whose first paragraph is a code
sample (indented) or shorter than 40 characters are left out. The records are written in `messages` form, one
JSON object a line, in topic order:

    {"messages": [{"role": "user", "content": "What is The \\"assert\\" statement in Python?"},
                  {"role": "assistant", "content": "Assert statements are a convenient way to ..."}]}

    python bench/chat_data.py --out pydoc-chat.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

MIN_ANSWER = 40
# A title line followed by a line of one underline character as long as the title.
_HEADING = re.compile(r"^(?P<title>\S[^\n]*)\n(?P<rule>[*=\-])(?P=rule)+\n", re.M)


def sections(text: str) -> Iterator[tuple[str, str]]:
    """(title, first paragraph) of each titled section of one topic's text."""
    headings = list(_HEADING.finditer(text))
    for heading, following in zip(headings, [*headings[1:], None]):
        body = text[heading.end():following.start() if following else len(text)]
        paragraphs = [p for p in re.split(r"\n\s*\n", body.strip("\n")) if p.strip()]
        if paragraphs:
            yield heading["title"].strip(), paragraphs[0]


def conversation(title: str, paragraph: str) -> dict | None:
    """The `messages` record for one section, or None where its first paragraph is code or too short."""
    if paragraph.startswith((" ", "\t")):
        return None
    answer = " ".join(line.strip() for line in paragraph.splitlines())
    if len(answer) < MIN_ANSWER:
        return None
    return {"messages": [{"role": "user", "content": f"What is {title} in Python?"},
                         {"role": "assistant", "content": answer}]}


def records() -> list[dict]:
    """Every conversation, in topic (key) order, then section order."""
    from pydoc_data.topics import topics

    found = (conversation(title, paragraph) for key in sorted(topics) for title, paragraph in sections(topics[key]))
    return [record for record in found if record is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl file to write")
    args = parser.parse_args(argv)
    found = records()
    args.out.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in found))
    print(f"{len(found)} conversations: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
