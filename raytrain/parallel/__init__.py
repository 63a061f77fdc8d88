"""The model on the workers (internal): how it is held, whoever holds it.

- `strategy`: `--strategy` ddp or fsdp, activation checkpointing and compile on the pipeline's
  blocks, --precision's one map to torch, and which failures are a lost peer's;
- `batchnorm`: BatchNorm over the global batch (--sync-batchnorm).

The worker (`raytrain.worker`), `raytrain check` and the torchrun baseline use the same pieces.
"""
