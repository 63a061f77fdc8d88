"""Process environment variables set for a block and given back after it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ inside the block, and each variable as it was after it."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
