"""Following a JSONL run file while it grows (the driver's console and trackers), on a file
system or an object store."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from raytrain.rundir.files import parse_jsonl
from raytrain.rundir.storage import Store


class Tail:
    """The rows appended to a JSONL file since the last `read`.

    Rank 0 rewrites metrics.jsonl when it resumes from a checkpoint, keeping only the
    rows up to the checkpoint's step: a prefix of what was there. A rewrite is noticed
    (the last line read is no longer where it was) and only lines after the common
    prefix are returned. A partial last line is left for the next read. Each read is a size
    check and a ranged read of what is new (on an object store, where a file grows by being
    rewritten whole, two requests).

    `Tail(path)` follows a local file; `Tail(store, name)` the file `name` of a Store.
    """

    def __init__(self, path: "Path | Store", name: str | None = None, skip_existing: bool = True):
        if name is None:
            path = Path(path)
            self.store, self.name = Store.of(path.parent), path.name
        else:
            self.store, self.name = Store.of(path), name
        self.offset = 0
        self.hashes: list[bytes] = []  # digest of every complete line read so far
        self.last_line = b""
        if skip_existing:
            self.read()

    def read(self) -> list[dict[str, Any]]:
        size = self._size()
        if size is None:
            return []
        if size < self.offset or not self._last_line_in_place():
            return parse_jsonl(self._resync())
        chunk = self._bytes(self.offset, size - self.offset)
        lines = chunk.split(b"\n")[:-1]  # the part after the last newline is incomplete
        self._consume(lines)
        return parse_jsonl(lines)

    def _size(self) -> int | None:
        return self.store.size(self.name)

    def _bytes(self, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            return self.store.read_range(self.name, start, length)
        except FileNotFoundError:
            return b""

    def _last_line_in_place(self) -> bool:
        if not self.last_line:
            return True
        start = self.offset - len(self.last_line) - 1
        return self._bytes(start, len(self.last_line) + 1) == self.last_line + b"\n"

    def _resync(self) -> list[bytes]:
        size = self._size() or 0
        lines = self._bytes(0, size).split(b"\n")[:-1]
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


def _digest(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=8).digest()
