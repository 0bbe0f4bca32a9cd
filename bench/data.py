"""Benchmark of the token store: peak memory of `preinfer tokenize` and `preinfer cache` against corpus size,
tokenize throughput per process, and `bcd`'s time against corpus size.

For each size (tokens of the byte tokenizer, one per byte of text) the benchmark writes a corpus of JSON lines
into a temporary directory (word soup drawn from a fixed vocabulary with a Zipf-like law, 100-600 words per record,
seeded), runs `preinfer tokenize --workers 1` on it as a child process, and measures:
- peak RSS: the child's own (wait4's ru_maxrss) and the largest sum over its process tree sampled every 20 ms;
- throughput: MB of text per second of the job itself (`seconds` of `--json`: fingerprinting, tokenising, packing,
  writing; not the interpreter's start and imports, given apart as `wall_s`).
With an HF tokenizer too: a byte-level BPE trained in-process with the `tokenizers` package on the smallest corpus
(no download), run with TOKENIZERS_PARALLELISM=false so that one process means one core.

For each size also `preinfer cache` (tiny-llama, boundary 1, train split, one process) over its token store:
peak RSS, the job stopped after `--cache-window` seconds if it has not finished (caching 100M tokens writes
tens of GB; the job streams the store shard by shard from its start, so the window shows what it holds). For the
largest size and `--bcd-base`: the wall time of `preinfer bcd --model tiny-llama --steps-per-visit 2` (default
evaluation cap), once on the prebuilt token store and once on the corpus with an empty token-store cache (the
implicit build counted).

Targets (issue 11): at least 20 MB of text/s per process with the byte tokenizer; peak RSS of tokenize and of
cache grows by at most 100 MB from the smallest corpus to the largest; bcd on the largest corpus takes less than
twice its time on `--bcd-base`. Prints a table, writes bench/out/data.json.

    python -m bench.data [--sizes 10M,100M] [--hf-size 10M] [--bcd-base 1M] [--cache-window 180] [--quick]
                         [--out FILE]   (0 for --hf-size, --bcd-base or --cache-window: not measured)
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

from bench.lib.common import ROOT, machine, table, write_json

MB = 1e6
VOCABULARY = 5000
TARGET_MB_PER_S = 20.0
TARGET_RSS_GROWTH_MB = 100.0
TARGET_BCD_RATIO = 2.0


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


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmarked command: one core per process, this checkout importable."""
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


def run_child(arguments: list[str], env: dict[str, str], window: float | None = None) -> dict:
    """`preinfer ARGUMENTS` in a child process: its stdout, wall time and peak memory. With `window`, a job still
    running after that many seconds is stopped (SIGKILL) and measured over the window (`stopped` is then True)."""
    command = [sys.executable, "-m", "pipelines.cli", *arguments]
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples: list[int] = []
    finished = threading.Event()
    stopped = threading.Event()

    def sample() -> None:
        while not finished.wait(0.02):
            samples.append(tree_rss(child.pid))
            if window is not None and time.perf_counter() - started > window and not stopped.is_set():
                stopped.set()
                child.kill()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout = child.stdout.read()
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    finished.set()
    sampler.join()
    wall = time.perf_counter() - started
    if child.returncode != 0 and not stopped.is_set():
        raise SystemExit(f"preinfer {arguments[0]} failed ({child.returncode}): {stderr.decode()[-2000:]}")
    return {"stdout": stdout, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss * 1024 / MB,
            "sampled_tree_rss_mb": max(samples, default=0) / MB, "stopped": stopped.is_set()}


def run_tokenize(corpus: pathlib.Path, out: pathlib.Path, tokenizer: str) -> dict:
    """`preinfer tokenize` in a child process: its JSON result, wall time and peak memory."""
    run = run_child(["tokenize", "--data", str(corpus), "--tokenizer", tokenizer, "--out", str(out), "--workers", "1",
                     "--quiet", "--json"], child_env())
    stored = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    return {**run, "result": json.loads(run["stdout"]), "store_mb": stored / MB}


def measure_cache(tokens: pathlib.Path, work: pathlib.Path, window: float) -> dict:
    """Peak RSS of `preinfer cache` (tiny-llama, boundary 1, the train split) over the token store `tokens`,
    stopped after `window` seconds if it has not finished: the job streams the store shard by shard, so what it
    holds in the window is what it holds at any time."""
    out = work / f"cache-{tokens.name}"
    run = run_child(["cache", "--model", "tiny-llama", "--boundary", "1", "--data", str(tokens), "--splits", "train",
                     "--out", str(out), "--quiet", "--json"], child_env(), window)
    stored = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    return {"cache_wall_s": round(run["wall_s"], 1), "cache_finished": not run["stopped"],
            "cache_peak_rss_mb": round(run["peak_rss_mb"], 1),
            "cache_sampled_tree_rss_mb": round(run["sampled_tree_rss_mb"], 1), "cache_written_mb": round(stored / MB, 1)}


def time_bcd(data: pathlib.Path, work: pathlib.Path, name: str, cache_home: pathlib.Path) -> float:
    """Wall seconds of `preinfer bcd` with 2 steps per visit on `data` (a corpus, tokenised into `cache_home` by
    the run itself, or a token store), the default evaluation cap included."""
    arguments = ["bcd", "--model", "tiny-llama", "--data", str(data), "--steps-per-visit", "2",
                 "--out", str(work / f"bcd-{name}")]
    return round(run_child(arguments, child_env(XDG_CACHE_HOME=str(cache_home)))["wall_s"], 1)


def measure_bcd(corpus: pathlib.Path, tokens: pathlib.Path, work: pathlib.Path) -> dict:
    """`bcd` on `corpus` with its token store prebuilt, and with the implicit build (an empty cache)."""
    return {"bcd_prebuilt_s": time_bcd(tokens, work, f"{corpus.stem}-prebuilt", work / "xdg-unused"),
            "bcd_implicit_s": time_bcd(corpus, work, f"{corpus.stem}-implicit", work / f"xdg-{corpus.stem}")}


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
    parser = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M", help="corpus sizes in byte tokens [10M,100M]")
    parser.add_argument("--hf-size", default="10M", help="corpus size for the HF tokenizer; 0 = none [10M]")
    parser.add_argument("--bcd-base", default="1M",
                        help="the corpus the largest size's bcd time is compared with; 0 = no bcd runs [1M]")
    parser.add_argument("--cache-window", type=float, default=180.0,
                        help="seconds after which a preinfer cache run is stopped and measured over the window; "
                             "0 = no cache runs [180]")
    parser.add_argument("--quick", action="store_true", help="sizes 200k,2M, bcd base 100k, HF on 200k, cache 60 s")
    parser.add_argument("--out", help="JSON file [bench/out/data.json]")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in ("200k,2M" if args.quick else args.sizes).split(",")]
    hf_size = parse_size("200k" if args.quick else args.hf_size)
    base = parse_size("100k" if args.quick else args.bcd_base)
    window = 60.0 if args.quick else args.cache_window
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        work = pathlib.Path(scratch)
        corpora = {}
        byte_sizes = sorted(set(sizes + ([base] if base else [])))
        for size in sorted(set(byte_sizes + ([hf_size] if hf_size else []))):
            corpus = work / f"corpus-{size}.jsonl"
            corpora[size] = (corpus, write_corpus(corpus, size))
        for size in byte_sizes:
            row = {"size": size, **measure(*corpora[size], "byte", "byte", work)}
            tokens = work / f"tokens-byte-{corpora[size][0].stem}"
            if window and size in sizes:
                row.update(measure_cache(tokens, work, window))
            if base and size in (base, sizes[-1]):
                row.update(measure_bcd(corpora[size][0], tokens, work))
            rows.append(row)
            print(table(rows[-1:], list(rows[-1])), flush=True)
        if hf_size:
            corpus, text_bytes = corpora[hf_size]
            tokenizer = train_bpe(corpus, work / "bpe")
            rows.append({"size": hf_size, **measure(corpus, text_bytes, str(tokenizer), "hf-bpe", work)})
    by_size = {row["size"]: row for row in rows if row["tokenizer"] == "byte"}
    small, large = by_size[sizes[0]], by_size[sizes[-1]]
    targets = {
        # the largest corpus: fixed costs (tokenizer, store creation) weigh least
        "byte_mb_per_s_per_process": at_least(large["mb_per_s"], TARGET_MB_PER_S, size=sizes[-1]),
        "tokenize_peak_rss_growth_mb": at_most(large["peak_rss_mb"] - small["peak_rss_mb"], TARGET_RSS_GROWTH_MB,
                                               from_size=sizes[0], to_size=sizes[-1]),
    }
    if window:
        targets["cache_peak_rss_growth_mb"] = at_most(large["cache_peak_rss_mb"] - small["cache_peak_rss_mb"],
                                                      TARGET_RSS_GROWTH_MB, from_size=sizes[0], to_size=sizes[-1],
                                                      window_s=window)
    for how in ("prebuilt", "implicit") if base else ():
        ratio = large[f"bcd_{how}_s"] / by_size[base][f"bcd_{how}_s"]
        targets[f"bcd_time_ratio_{how}"] = at_most(ratio, TARGET_BCD_RATIO, from_size=base, to_size=sizes[-1])
    columns = list(dict.fromkeys(column for row in rows for column in row))  # rows measure different things
    print(table([{column: row.get(column, "-") for column in columns} for row in rows], columns))
    print(json.dumps(targets, indent=1))
    payload = {"command": " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "rows": rows, "targets": targets}
    path = write_json("data", payload) if args.out is None else pathlib.Path(args.out)
    if args.out is not None:
        path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


def at_least(measured: float, target: float, **where) -> dict:
    return {"target": target, "measured": round(measured, 2), **where, "met": measured >= target}


def at_most(measured: float, target: float, **where) -> dict:
    return {"target": target, "measured": round(measured, 2), **where, "met": measured <= target}


if __name__ == "__main__":
    sys.exit(main())
