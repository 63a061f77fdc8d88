"""The next step's batch staged while the current step computes (`--prefetch`).

Without it a step asks for its batch when it starts: the rows are cut on the host and copied
to the device then, from pageable memory, a copy the GPU waits for and that overlaps
nothing. With it, once a step's work is queued, the first (micro-)batch of the next step is
cut on the host, placed in pinned memory and copied to the device on a side CUDA stream
(recording an event); the next step's compute stream waits for that event only, so the copy
runs under the previous step's kernels and no host sync is added.

The rows are the data's own: the staged batch is exactly what `data.batch(rows, device)`
would give for those rows, asked in the same order (a streamed epoch's positions still
increase from call to call), so ids, order and loss are unchanged. A step whose rows differ
from the staged ones (none in the normal loop) is served the usual way. On a CPU the same
path runs with `--prefetch on` (the batch is cut one step early; no stream, no pinning): the
tests check with it that prefetching changes nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain.rules import steps

CPU = torch.device("cpu")


def wanted(setting: str, device: torch.device) -> bool:
    """Whether to prefetch: `auto` on CUDA devices only, `on` everywhere, `off` never."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


class Prefetched:
    """An epoch's data (TableEpoch, StreamEpoch, DrawsEpoch) whose next batch can be staged ahead."""

    def __init__(self, data: Any, device: torch.device):
        self.data, self.device = data, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staged: tuple[Any, dict[str, torch.Tensor], int, Any] | None = None  # rows, batch, count, event
        self.staged_batches = 0  # batches served from the stage (a test's proof that it ran)

    def __getattr__(self, name: str) -> Any:  # skipped_rows, ...: the data's own
        return getattr(self.data, name)

    def rows(self, step: steps.Step):
        return self.data.rows(step)

    def batch(self, rows, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """The batch of `rows` on `device`: the staged one when it is of these rows."""
        staged, self.staged = self.staged, None
        if staged is None or staged[0] != rows:
            return self.data.batch(rows, device)
        _, batch, count, event = staged
        if event is not None:  # the compute stream waits for the copy, the host does not
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in batch.values():
                tensor.record_stream(current)  # the allocator keeps its memory until the step is done
        self.staged_batches += 1
        return batch, count

    def stage(self, step: steps.Step, accumulation_steps: int) -> None:
        """Cut the first (micro-)batch of `step` now and start its copy to the device."""
        pieces = steps.micro_batches(self.data.rows(step), accumulation_steps)
        rows = pieces[0]
        if self.stream is None:
            batch, count = self.data.batch(rows, self.device)
            self.staged = (rows, batch, count, None)
            return
        host, count = self.data.batch(rows, CPU)
        with torch.cuda.stream(self.stream):
            batch = {name: tensor.pin_memory().to(self.device, non_blocking=True) for name, tensor in host.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        self.staged = (rows, batch, count, event)
