"""Chat records from Python's own pydoc topics (`pydoc_data.topics.topics`): one two-turn `messages` conversation
per titled section (bench.chat_data writes them, bench.finetune trains on them)."""

from __future__ import annotations

import re
from collections.abc import Iterator

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

