"""The worker (internal: not part of raytrain's public API): what runs on every Ray Train worker.

- `loop`: the per-worker function and one attempt of it (`Training`): restore → build → loop → report;
- `epoch`: the one epoch loop, a step of it (`Epochs.take_step`), what follows each step, and
  the epoch's end;
- `step`: one optimizer step's mechanics, validation, and the pipeline's hooks around them (`StepRunner`);
- `checkpointer`: the one owner of the worker's checkpoints: when, what, where, and restore;
- `state`: the training state, the one owner of what a checkpoint, a healed replica and an
  export hold, and a checkpoint being written;
- `window`: the loss between syncs and the sync that shares it (divergence stops the run);
- `recovery`: how a failure is recovered from, one object per fault-tolerance mode, built once
  where the worker starts and the only place that knows the mode (restart mode's is the base);
  `replicas`: per-step fault tolerance's (each replica a torchft replica group), and `groups`:
  a per-step replica of one worker or of several that shard one model;
- `runtime`: the worker's Ray Train and torch.distributed calls, in one place;
- `phases`: what an attempt measures of itself, and a step's phases, told to the heartbeat and
  the timer; `prefetch`: the next batch staged while a step computes; `optim`: the learning
  rate and per-group rates.

How the model is held (`--strategy`) is `raytrain.parallel`; the heartbeat files,
`raytrain.rundir.heartbeats`.
"""
