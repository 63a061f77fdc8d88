"""Following a JSONL run file while it grows (the driver's console and trackers)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable


class Tail:
    """The rows appended to a JSONL file since the last `read`.

    Rank 0 rewrites metrics.jsonl when it resumes from a checkpoint, keeping only the
    rows up to the checkpoint's step: a prefix of what was there. A rewrite is noticed
    (the last line read is no longer where it was) and only lines after the common
    prefix are returned. A partial last line is left for the next read.
    """

    def __init__(self, path: Path, skip_existing: bool = True):
        self.path = Path(path)
        self.offset = 0
        self.hashes: list[bytes] = []  # digest of every complete line read so far
        self.last_line = b""
        if skip_existing:
            self.read()

    def read(self) -> list[dict[str, Any]]:
        try:
            handle = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if size < self.offset or not self._last_line_in_place(handle):
                return self._parse(self._resync(handle))
            handle.seek(self.offset)
            chunk = handle.read(size - self.offset)
        lines = chunk.split(b"\n")[:-1]  # the part after the last newline is incomplete
        self._consume(lines)
        return self._parse(lines)

    def _last_line_in_place(self, handle) -> bool:
        if not self.last_line:
            return True
        handle.seek(self.offset - len(self.last_line) - 1)
        return handle.read(len(self.last_line) + 1) == self.last_line + b"\n"

    def _resync(self, handle) -> list[bytes]:
        handle.seek(0)
        lines = handle.read().split(b"\n")[:-1]
        common = 0
        for line, seen in zip(lines, self.hashes):
            if _digest(line) != seen:
                break
            common += 1
        self.offset, self.hashes, self.last_line = 0, [], b""
        self._consume(lines[:common])
        new = lines[common:]
        self._consume(new)
        return new

    def _consume(self, lines: list[bytes]) -> None:
        for line in lines:
            self.offset += len(line) + 1
            self.hashes.append(_digest(line))
        if lines:
            self.last_line = lines[-1]

    @staticmethod
    def _parse(lines: Iterable[bytes]) -> list[dict[str, Any]]:
        rows = []
        for line in lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
        return rows


def _digest(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=8).digest()


__all__ = ["Tail"]
