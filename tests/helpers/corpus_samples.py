"""Small corpora made the same way on every machine and Python version (words chosen by sha256, no RNG), in every
input form the data side reads; shared by the data and token-store tests, and the small corpora of the
corpus fixtures."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "ēta", "θeta", "iota", "kappa", "λambda", "mu",
         "日本"]
# Paragraph separators, including ones that do not separate (a "\r\n" blank line, or no blank line at all).
SEPARATORS = ["\n\n", "\n \t\n", "\n\n\n\n", "\n   \n  \n", "\r\n\r\n", "\n", "\n\t\n"]


def _pick(seed: str, i: int, n: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:4], "big") % n


def sentence(seed: str, i: int, words: int | None = None) -> str:
    """A deterministic run of words; its length (1..24 words unless given) is chosen by the hash too."""
    count = words or 1 + _pick(seed + "#", i, 24)
    return " ".join(WORDS[_pick(seed, i * 97 + k, len(WORDS))] for k in range(count))


def text_corpus(paragraphs: int = 200, seed: str = "txt") -> str:
    """A `.txt` corpus: paragraphs joined by varied separators, some with inner line breaks or leading blanks."""
    parts = [" \n" if _pick(seed, -1, 2) else ""]
    for i in range(paragraphs):
        body = sentence(seed, i)
        if _pick(seed + "!", i, 5) == 0:
            body += "\n  " + sentence(seed + "~", i)
        parts.append(body + SEPARATORS[_pick(seed + "/", i, len(SEPARATORS))])
    return "".join(parts)


def text_records(count: int = 150, seed: str = "jsonl") -> list[dict]:
    """LM text records (an extra field now and then, which readers ignore)."""
    return [{"text": sentence(seed, i), **({"meta": i} if i % 7 == 0 else {})} for i in range(count)]


def instruction_records(count: int = 100, seed: str = "sft") -> list[dict]:
    """Instruction records: an input on some, and a few prompts too long for seq_len 176 (dropped)."""
    records = []
    for i in range(count):
        instruction = sentence(seed, i, 40 if i % 23 == 5 else None)
        record = {"instruction": instruction, "output": sentence(seed + "o", i)}
        if i % 3 == 0:
            record["input"] = sentence(seed + "i", i)
        records.append(record)
    return records


def jsonl_text(records: list[dict], blank_every: int = 0) -> str:
    """The JSON lines of `records`, with a blank line after every `blank_every` records when it is positive."""
    lines = []
    for i, record in enumerate(records, start=1):
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        if blank_every and i % blank_every == 0:
            lines.append("\n")
    return "".join(lines)


def write_directory(root: Path) -> Path:
    """A directory of LM text: `.txt` and `.jsonl` files at two depths and a file that readers skip."""
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text(text_corpus(30, "dir-b"), encoding="utf-8")
    (root / "a.jsonl").write_text(jsonl_text(text_records(20, "dir-a")), encoding="utf-8")
    (root / "sub" / "c.txt").write_text(text_corpus(25, "dir-c"), encoding="utf-8")
    (root / "a.txt").write_text(text_corpus(10, "dir-a2"), encoding="utf-8")
    (root / "notes.md").write_text("not data\n", encoding="utf-8")
    return root


def write_corpora(root: Path) -> dict[str, Path]:
    """Every sample corpus under `root`, by name."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {
        "txt": root / "corpus.txt",
        "jsonl": root / "text.jsonl",
        "instruction": root / "sft.jsonl",
        "directory": root / "dir",
    }
    paths["txt"].write_text(text_corpus(), encoding="utf-8")
    paths["jsonl"].write_text(jsonl_text(text_records(), blank_every=11), encoding="utf-8")
    paths["instruction"].write_text(jsonl_text(instruction_records()), encoding="utf-8")
    write_directory(paths["directory"])
    return paths


# (corpus, seq_len, eval_fraction) of the pinned cases.
CASES = [("txt", 64, 0.2), ("jsonl", 32, 0.1), ("instruction", 176, 0.25), ("directory", 16, 0.3)]


def paragraphs_corpus(path: Path) -> str:
    """The tests' small shared corpus (the `corpus` fixture): 24 paragraphs, enough for a few dozen samples of 32
    tokens in each split; returns its path."""
    paragraphs = [f"Paragraph {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(30)) for i in range(24)]
    path.write_text("\n\n".join(paragraphs))
    return str(path)


def write_corpus(path: Path, paragraphs: int = 60) -> str:
    """The caching tests' corpus (the `cache_corpus` fixture): a small deterministic .txt corpus (~200 samples of 32
    bytes in train, ~20 in eval, so several shards of PER_SHARD); returns its path."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    text = "\n\n".join(
        f"Paragraph {i}: " + " ".join(words[(i * 7 + j) % len(words)] for j in range(12 + i % 9))
        for i in range(paragraphs)
    )
    path.write_text(text + "\n")
    return str(path)
