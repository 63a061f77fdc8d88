"""The data layer (internal): checked rows from Ray Data, cut into each rank's share of every
step; its modules: docs/architecture.md, the data row. However a dataset is held, every row is
trained exactly once per epoch, all ranks run the same steps, and an epoch continues from one
stored offset at any worker count."""
