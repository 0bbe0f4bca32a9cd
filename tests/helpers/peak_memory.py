"""The bound a test holds a case's memory to: the process's peak resident memory before and after it."""

import resource

RSS_GROWTH = 512 << 20  # bytes a generated case may add to the process's peak memory


def peak_rss() -> int:
    """The process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
