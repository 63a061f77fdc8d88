"""The worker (internal: not part of raytrain's public API): what runs on every Ray Train worker.

- `loop`: the per-worker function, a short story: restore → build → loop → report;
- `epoch`: an epoch's steps, what follows each step, and the epoch's end;
- `step`: one optimizer step's mechanics and the pipeline's hooks around it (`StepRunner`);
- `window`: the loss between syncs and the sync that shares it (divergence stops the run);
- `state`: the training state, the one owner of what a checkpoint, a healed replica and an
  export hold;
- `runtime`: the worker's Ray Train and torch.distributed calls, in one place;
- `replicas`: per-step fault tolerance (each worker a torchft replica);
- `heartbeat`, `phases`: each rank's phase and step, to name a hung rank; step timings;
- `optim`: per-group rates (the default optimizer is `Pipeline.build_optimizer`'s own).
"""
