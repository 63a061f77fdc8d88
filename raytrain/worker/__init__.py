"""The worker (internal: not part of raytrain's public API): what runs on every Ray Train worker.

- `loop`: the per-worker function: restore → build → loop → report;
- `epoch`: one attempt of it (`Training`): its one epoch loop, a step of it (`Training.take_step`),
  what follows each step, and the epoch's end;
- `step`: one optimizer step's mechanics, validation, and the pipeline's hooks around them (`StepRunner`);
- `checkpointer`: the one owner of the worker's checkpoints: when, what, where, and restore;
- `state`: the training state, the one owner of what a checkpoint, a healed replica and an
  export hold, and a checkpoint being written;
- `runtime`: the worker's Ray Train and torch.distributed calls, in one place; `network`: its
  process group bound to the node's interface;
- `prefetch`: the next batch staged while a step computes; `optim`: the learning rate and
  per-group rates.

How a failure is recovered from is the fault-tolerance mode's worker half (`raytrain.faults`),
handed to the worker in its payload; what the worker measures and watches beside the loop is
`raytrain.instruments`; how the model is held (`--strategy`), `raytrain.parallel`.
"""
