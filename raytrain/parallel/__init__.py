"""The model on the workers (internal), whoever holds it: the worker (`raytrain.worker`),
`raytrain check` and the torchrun baseline use the same pieces; its modules: docs/architecture.md,
the parallel row."""
