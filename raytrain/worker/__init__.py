"""The worker (internal: not part of raytrain's public API): what runs on every Ray Train worker.

- `loop`: the per-worker function and one attempt of it (`Training`): restore → build → loop → report;
- `epoch`: the one epoch loop, a step of it (`Epochs.take_step`), what follows each step, and
  the epoch's end;
- `step`: one optimizer step's mechanics and the pipeline's hooks around it (`StepRunner`);
- `checkpointer`: the one owner of the worker's checkpoints: when, what, where, and restore;
- `state`: the training state, the one owner of what a checkpoint, a healed replica and an
  export hold, and a checkpoint being written;
- `window`: the loss between syncs and the sync that shares it (divergence stops the run);
- `runtime`: the worker's Ray Train and torch.distributed calls, in one place, and its policy of
  the step; `replicas`: per-step fault tolerance's policy (each worker a torchft replica);
- `phases`: a step's phases, told to the heartbeat and the timer; `prefetch`: the next batch
  staged while a step computes; `optim`: per-group rates.

How the model is held (`--strategy`) is `raytrain.parallel`; the heartbeat files,
`raytrain.rundir.heartbeats`.
"""
