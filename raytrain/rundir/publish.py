"""Making a checkpoint visible only when it is complete, on a file system and on an object store.

Every rank writes its part of a checkpoint into a staging directory on its own node (DCP
shards `__<rank>_<i>.distcp`; rank 0 also DCP's `.metadata`, the train state, the plain model
and the position: `checkpoints.FINAL_FILES`). Then:

- on a file system shared by all ranks, the coordinator renames the staging directory into
  the run directory once its files are written: one atomic step;
- on an object store there is no rename: every rank uploads its own shards; the
  coordinator (rank 0, or the one process that wrote everything) waits until every shard DCP's
  metadata names is in the store, uploads the final files, and writes the marker
  (`checkpoints.COMPLETE`) last. Readers look for the marker only, so a checkpoint is
  invisible until every byte of it is stored, and one whose upload failed is never seen (nor
  does it touch the previous one). The staged files are removed once uploaded.

One `Publish` does either, as its store does (`Store.publish`). Both run in the background
(Ray Train's upload thread for rank 0, a thread of their own elsewhere): the training loop
waits only for the state to be copied to host memory.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from raytrain.errors import StorageError
from raytrain.rundir import checkpoints as ckpt
from raytrain.rundir.storage import Store

# How long the coordinator waits for the other ranks' shards to appear in the store: their
# uploads run in parallel with its own, and a rank that failed ends the attempt anyway.
SHARDS_WAIT_S = 1800.0
POLL_S = 0.5


class Publish:
    """One rank's part in making one checkpoint visible (see the module's docstring).

    `wait_written()` returns once this rank's files are written locally (or raises what the
    write raised). `coordinator`: this rank writes the final files and the marker; `rank`:
    which shard files are this rank's (None: every file in the staging directory is)."""

    def __init__(
        self,
        staging: Path,
        target: Store,
        wait_written: Callable[[], None],
        *,
        rank: int | None,
        coordinator: bool,
        step: int,
        fence: Callable[[], None] | None = None,
    ):
        self.staging, self.target = Path(staging), target
        # Called just before the checkpoint becomes visible; raises when the run's driver no longer holds
        # the run (a resume may have chosen, and its workers be loading, another checkpoint): none is published.
        self.fence = fence or (lambda: None)
        self.wait_written, self.rank, self.coordinator, self.step = wait_written, rank, coordinator, step
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self, then: Callable[[], None] | None = None) -> None:
        """Publish (in the calling thread), then `then()`; errors are kept for `wait` and raised."""
        try:
            self.wait_written()
            self.target.publish(self)
            if then is not None:
                then()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.done.set()

    def upload(self) -> None:
        """Publish on an object store: every rank uploads its own files; the coordinator waits for the
        others', uploads the final files, and writes the marker last."""
        self._upload(self._own_files())
        if self.coordinator:
            self._wait_for_shards()
            self._upload([name for name in ckpt.FINAL_FILES if (self.staging / name).is_file()])
            self.fence()
            self._write_marker()
            shutil.rmtree(self.staging, ignore_errors=True)
        else:
            _remove_if_empty(self.staging)

    def start(self, then: Callable[[], None] | None = None) -> threading.Thread:
        """Publish in a background thread (its error is raised by `wait`); `then` once published."""

        def run() -> None:
            try:
                self.run(then)
            except BaseException:  # kept in self.error: raised by wait() on the loop's thread
                pass

        thread = threading.Thread(target=run, name="raytrain-publish", daemon=True)
        thread.start()
        return thread

    def wait(self, timeout_s: float | None = None) -> None:
        """Until this rank's part is published (the coordinator's: the checkpoint is visible)."""
        self.done.wait(timeout_s)
        if self.error is not None:
            raise self.error

    def _own_files(self) -> list[str]:
        if not self.staging.is_dir():
            return []
        names = sorted(p.name for p in self.staging.iterdir() if p.is_file() and not p.name.endswith(".tmp"))
        if self.rank is None:
            return [name for name in names if name not in ckpt.FINAL_FILES]
        return [name for name in names if name.startswith(f"__{self.rank}_")]

    def _upload(self, names: list[str]) -> None:
        for name in names:
            self.target.upload(self.staging / name, name)
            if not self.coordinator:
                (self.staging / name).unlink(missing_ok=True)

    def _wait_for_shards(self) -> None:
        """Until every file DCP's metadata names is in the store (the other ranks upload theirs)."""
        expected = _dcp_files(self.staging)
        deadline = time.monotonic() + SHARDS_WAIT_S
        while True:
            missing = expected - set(self.target.list())
            if not missing:
                return
            if time.monotonic() > deadline:
                raise StorageError(
                    0,
                    f"checkpoint {self.target}: {len(missing)} shard file(s) of other ranks did not reach the store "
                    f"within {SHARDS_WAIT_S:.0f} s ({', '.join(sorted(missing)[:3])}); it stays incomplete and unused",
                )
            time.sleep(POLL_S)

    def _write_marker(self) -> None:
        files = sorted(name for name in self.target.list() if name != ckpt.COMPLETE)
        marker = {"step": self.step, "files": files, "time": time.time()}
        self.target.write_text(ckpt.COMPLETE, json.dumps(marker))


def _dcp_files(staging: Path) -> set[str]:
    """The shard files DCP's metadata (in `staging`) says the checkpoint holds."""
    if not (staging / ckpt.DCP_METADATA).is_file():
        return set()
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(staging)).read_metadata()
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


__all__ = ["SHARDS_WAIT_S", "Publish"]
