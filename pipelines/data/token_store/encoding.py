"""The encode step of a tokenize job: the corpus's chunks tokenised (in this process or a pool of worker processes)
and staged (`pipelines.data.token_store.staging`)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from pipelines.data.corpus import Document, iter_documents
from pipelines.data.samples import document_chunks, encode_chunk, sample_kind
from pipelines.data.token_store.layout import STAGING
from pipelines.data.token_store.options import TokenizeOptions
from pipelines.data.token_store.staging import Staging
from pipelines.data.tokenizers import Tokenizer
from pipelines.progress import Progress
from preinfer.errors import UsageError


def encode_chunks(options: TokenizeOptions, staging: Staging, tokenizer: Tokenizer) -> int:
    """Stage every chunk not staged yet; record the number of chunks and the kind. Returns the chunks encoded."""
    chunks = document_chunks(iter_documents(options.data, options.text_column, options.dataset_split),
                             options.chunk_chars)
    encoder = Encoder(options, staging, tokenizer)
    kind, count = None, 0
    try:
        for index, chunk in enumerate(chunks):
            kind = kind or sample_kind(chunk[0], tokenizer)
            count = index + 1
            if not staging.is_staged(index):
                encoder.submit(index, chunk)
    finally:
        encoder.close()
    if kind is None:
        raise UsageError(f"{options.data}: no documents found (empty dataset)")
    staging.finish_encoding(count, kind)
    return encoder.submitted


def encode_and_stage(
    index: int, chunk: list[Document], tokenizer: Tokenizer, options: TokenizeOptions, staging: Staging
) -> int:
    """Tokenise chunk `index` and stage it; returns its tokens (both splits, padding left out)."""
    encoded = encode_chunk(chunk, tokenizer, options.seq_len, options.eval_fraction,
                           skip_unrenderable=options.skip_unrenderable)
    staging.write_chunk(index, encoded)
    return sum(part.tokens for part in encoded.values())


# The worker process's tokenizer, options and staging directory (set once by `_start_worker`).
_WORKER: dict[str, Any] = {}


def _start_worker(options: TokenizeOptions) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker: no thread pool of its own
    _WORKER.update(
        options=options, tokenizer=options.load_tokenizer(),
        staging=Staging(Path(options.out) / STAGING),
    )


def _encode_in_worker(index: int, chunk: list[Document]) -> int:
    return encode_and_stage(index, chunk, _WORKER["tokenizer"], _WORKER["options"], _WORKER["staging"])


class Encoder:
    """Tokenises chunks in this process (one worker) or in a pool of spawned processes, at most two chunks per
    worker in flight; a progress bar counts tokens."""

    def __init__(self, options: TokenizeOptions, staging: Staging, tokenizer: Tokenizer) -> None:
        self.options, self.staging, self.tokenizer = options, staging, tokenizer
        self.submitted = 0
        self.progress = Progress(quiet=not options.progress)
        self.progress.start("tokenize", "tok", unit_scale=True)
        self.pool = None
        if options.workers > 1:
            context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(
                options.workers, mp_context=context, initializer=_start_worker, initargs=(options,)
            )
        self.pending: set[Future] = set()

    def submit(self, index: int, chunk: list[Document]) -> None:
        self.submitted += 1
        if self.pool is None:
            self.progress.advance(encode_and_stage(index, chunk, self.tokenizer, self.options, self.staging))
            return
        if len(self.pending) >= 2 * self.options.workers:
            self._collect(FIRST_COMPLETED)
        self.pending.add(self.pool.submit(_encode_in_worker, index, chunk))

    def _collect(self, how: str) -> None:
        done, self.pending = wait(self.pending, return_when=how)
        for future in done:
            self.progress.advance(future.result())

    def close(self) -> None:
        """Wait for the chunks in flight (all of them, unless one failed) and stop the workers."""
        try:
            if self.pending:
                self._collect("ALL_COMPLETED")
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)
            self.progress.close()
