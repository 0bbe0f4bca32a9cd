"""A chat-format dataset built from text that ships with every CPython: Python's own pydoc topics
(`pydoc_data.topics.topics`, the text of `help("assert")`).

Every titled section of every topic (the topic's title, underlined with `*`, and its sections, underlined with
`=` or `-`) becomes one conversation of two turns: the user asks `What is <title> in Python?`, the assistant
answers with the section's first paragraph, its lines joined by spaces. Sections whose first paragraph is a code
sample (indented) or shorter than 40 characters are left out. The records are written in `messages` form, one
JSON object a line, in topic order:

    {"messages": [{"role": "user", "content": "What is The \\"assert\\" statement in Python?"},
                  {"role": "assistant", "content": "Assert statements are a convenient way to ..."}]}

    python -m bench.chat_data --out pydoc-chat.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.lib.chat_records import records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chat_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl file to write")
    args = parser.parse_args(argv)
    found = records()
    args.out.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in found))
    print(f"{len(found)} conversations: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
