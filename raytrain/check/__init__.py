"""`raytrain check PIPELINE --workers N`: do N workers train like 1? Internal.

- `verdict`: pure: the tolerance per precision and why, the step-by-step comparison, the
  verdict and its table;
- `probes`: the pipeline's own code run on one batch in one process, each suspect
  neutralized in turn, to name the cause of a gap (BatchNorm, randomness, a loss that
  scales with the per-rank batch, state in the pipeline object, the rank in the loss);
- `worker`: the per-worker function (rank 0's 1-worker reference, then the N-worker steps,
  a --sync-batchnorm rerun and the probes when they differ);
- `driver`: the shared configuration, the Ray Train run, the report;
- `options`: what the command takes besides the training options.
"""
