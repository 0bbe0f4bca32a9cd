"""Benchmark of `preinfer tokenize`: peak memory against corpus size, and tokenize throughput per process.

For each size (tokens of the byte tokenizer, one per byte of text) the benchmark writes a corpus of JSON lines
into a temporary directory (word soup drawn from a fixed vocabulary with a Zipf-like law, 100-600 words per record,
seeded), runs `preinfer tokenize --workers 1` on it as a child process, and measures:
- peak RSS: the child's own (wait4's ru_maxrss) and the largest sum over its process tree sampled every 20 ms;
- throughput: MB of text per second of the job itself (`seconds` of `--json`: fingerprinting, tokenising, packing,
  writing; not the interpreter's start and imports, given apart as `wall_s`).
With an HF tokenizer too: a byte-level BPE trained in-process with the `tokenizers` package on the smallest corpus
(no download), run with TOKENIZERS_PARALLELISM=false so that one process means one core.

Targets (issue 11): at least 20 MB of text/s per process with the byte tokenizer; peak RSS grows by at most 100 MB
from the smallest corpus to the largest. Prints a table, writes bench/out/data.json.

    python bench/data.py [--sizes 10M,100M] [--hf-size 10M] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine, table, write_json  # noqa: E402

MB = 1e6
VOCABULARY = 5000
TARGET_MB_PER_S = 20.0
TARGET_RSS_GROWTH_MB = 100.0


def parse_size(text: str) -> int:
    """`10M`, `100k`, `1.5G` or a plain number of tokens."""
    scale = {"k": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def write_corpus(path: pathlib.Path, tokens: int, seed: int = 0) -> int:
    """JSON lines of about `tokens` bytes of text at `path`; returns the bytes of text (byte tokens, eos left out)."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{rank}{'x' * (rank % 7)}" for rank in range(VOCABULARY)])
    weights = 1.0 / np.arange(1, VOCABULARY + 1)
    weights /= weights.sum()
    written = 0
    with path.open("w", encoding="utf-8") as stream:
        while written < tokens:
            text = " ".join(rng.choice(words, size=int(rng.integers(100, 600)), p=weights))
            stream.write(json.dumps({"text": text}) + "\n")
            written += len(text)
    return written


def train_bpe(corpus: pathlib.Path, directory: pathlib.Path, vocab_size: int = 8000) -> pathlib.Path:
    """A byte-level BPE trained on `corpus`, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        with corpus.open(encoding="utf-8") as stream:
            for line in stream:
                yield json.loads(line)["text"]

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>").save_pretrained(directory)
    return directory


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (0 once it is gone)."""
    total = 0
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += tree_rss(int(child))
    except (OSError, StopIteration, ValueError):
        pass
    return total


def run_tokenize(corpus: pathlib.Path, out: pathlib.Path, tokenizer: str) -> dict:
    """`preinfer tokenize` in a child process: its JSON result, wall time and peak memory."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pipelines.cli", "tokenize", "--data", str(corpus), "--tokenizer", tokenizer,
               "--out", str(out), "--workers", "1", "--quiet", "--json"]
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples: list[int] = []
    finished = threading.Event()

    def sample() -> None:
        while not finished.wait(0.02):
            samples.append(tree_rss(child.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout = child.stdout.read()
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    finished.set()
    sampler.join()
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"preinfer tokenize failed ({child.returncode}): {stderr.decode()[-2000:]}")
    result = json.loads(stdout)
    stored = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    return {"result": result, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss * 1024 / MB,
            "sampled_tree_rss_mb": max(samples, default=0) / MB, "store_mb": stored / MB}


def measure(corpus: pathlib.Path, text_bytes: int, tokenizer: str, name: str, work: pathlib.Path) -> dict:
    """One row of the table: `tokenizer` (called `name`) over `corpus`."""
    run = run_tokenize(corpus, work / f"tokens-{name}-{corpus.stem}", tokenizer)
    splits = run["result"]["splits"]
    seconds = run["result"]["seconds"]
    return {
        "tokenizer": name, "text_mb": round(text_bytes / MB, 1), "file_mb": round(corpus.stat().st_size / MB, 1),
        "tokens": sum(split["tokens"] for split in splits.values()), "job_s": seconds,
        "wall_s": round(run["wall_s"], 2),
        "mb_per_s": round(text_bytes / MB / seconds, 2), "peak_rss_mb": round(run["peak_rss_mb"], 1),
        "sampled_tree_rss_mb": round(run["sampled_tree_rss_mb"], 1), "store_mb": round(run["store_mb"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M", help="corpus sizes in byte tokens [10M,100M]")
    parser.add_argument("--hf-size", default="10M", help="corpus size for the HF tokenizer; 0 = none [10M]")
    parser.add_argument("--quick", action="store_true", help="sizes 200k,2M and the HF tokenizer on 200k")
    parser.add_argument("--out", help="JSON file [bench/out/data.json]")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in ("200k,2M" if args.quick else args.sizes).split(",")]
    hf_size = parse_size("200k" if args.quick else args.hf_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        work = pathlib.Path(scratch)
        corpora = {}
        for size in sorted(set(sizes + ([hf_size] if hf_size else []))):
            corpus = work / f"corpus-{size}.jsonl"
            corpora[size] = (corpus, write_corpus(corpus, size))
        for size in sizes:
            rows.append({"size": size, **measure(*corpora[size], "byte", "byte", work)})
            print(table(rows[-1:], list(rows[-1])), flush=True)
        if hf_size:
            corpus, text_bytes = corpora[hf_size]
            tokenizer = train_bpe(corpus, work / "bpe")
            rows.append({"size": hf_size, **measure(corpus, text_bytes, str(tokenizer), "hf-bpe", work)})
    byte_rows = [row for row in rows if row["tokenizer"] == "byte"]
    growth = byte_rows[-1]["peak_rss_mb"] - byte_rows[0]["peak_rss_mb"]
    rate = byte_rows[-1]["mb_per_s"]  # the largest corpus: fixed costs (tokenizer, store creation) weigh least
    targets = {
        "byte_mb_per_s_per_process": {"target": TARGET_MB_PER_S, "measured": rate, "size": byte_rows[-1]["size"],
                                      "met": rate >= TARGET_MB_PER_S},
        "peak_rss_growth_mb": {"target": TARGET_RSS_GROWTH_MB, "measured": round(growth, 1),
                               "from_size": byte_rows[0]["size"], "to_size": byte_rows[-1]["size"],
                               "met": growth <= TARGET_RSS_GROWTH_MB},
    }
    print(table(rows, list(rows[0])))
    print(json.dumps(targets, indent=1))
    payload = {"command": " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "rows": rows, "targets": targets}
    path = write_json("data", payload) if args.out is None else pathlib.Path(args.out)
    if args.out is not None:
        path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
