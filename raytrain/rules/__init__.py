"""Pure decisions (internal: not part of raytrain's public API).

Nothing here imports Ray or torch, so every rule is unit-tested on its own:

- `batch`: the batch plan of a worker count and how the peak rate follows the global batch;
- `schedule`: the rate at every sample count (warmup, then the schedule);
- `steps`: an epoch's order, its optimizer steps, each rank's rows and micro-batches;
- `order`: the order of a streamed epoch (partitions, windows, which rank reads what);
- `attempt`: what an attempt is (a fresh start, a restart, a resize) and the line it says;
- `position`: where training is, stored in every checkpoint;
- `resume`: every rule of `--resume`;
- `replicas`: per-step fault tolerance's replicas: how one starts, when it is stuck, how long it
  waits for its quorum;
- `costmodel`: the predicted speedup of data-parallel training on a given link.
"""
