"""Checks that a usage error is one line."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from preinfer.errors import UsageError


@contextmanager
def raises_one_line(match: str) -> Iterator[pytest.ExceptionInfo]:
    """pytest.raises for a UsageError whose message matches `match` and is one line."""
    with pytest.raises(UsageError, match=match) as caught:
        yield caught
    assert "\n" not in str(caught.value)
