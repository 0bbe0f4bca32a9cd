"""The caching job's progress bar."""

from __future__ import annotations

import threading
import time

from pipelines.cache.work import SplitJob


class Progress:
    """A tqdm bar (stderr) over the samples still to compute: samples/s, tokens/s, MB written."""

    def __init__(self, jobs: list[SplitJob], enabled: bool):
        self.total = sum(self._todo_samples(job) for job in jobs)
        self.seq_len = {job.name: job.store.fields["hidden"].shape[0] for job in jobs}
        self.bytes = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="sample", desc="cache", dynamic_ncols=True, leave=False)
        self._lock = threading.Lock()

    @staticmethod
    def _todo_samples(job: SplitJob) -> int:
        return sum(hi - lo for lo, hi in map(job.store.shard_range, job.todo))

    def shard_done(self, split: str, samples: int, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.tokens += samples * self.seq_len[split]
            if self.bar is not None:
                elapsed = max(time.perf_counter() - self.started, 1e-9)
                self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s, {self.bytes / 2**20:,.1f} MB",
                                         refresh=False)
                self.bar.update(samples)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
