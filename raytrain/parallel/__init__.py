"""The model on the workers (internal): how it is held, whoever holds it.

- `strategy`: `--strategy` ddp or fsdp, activation checkpointing and compile on the pipeline's
  blocks, and which failures are a lost peer's;
- `holding`: the strategy as an object (`Ddp`, `Fsdp`): its precision policy, --precision's one
  map to torch, and what the training state asks of it;
- `batchnorm`: BatchNorm over the global batch (--sync-batchnorm).

The worker (`raytrain.worker`), `raytrain check` and the torchrun baseline use the same pieces.
"""
