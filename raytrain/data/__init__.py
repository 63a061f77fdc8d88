"""The data layer (internal: not part of raytrain's public API): checked rows from Ray Data,
cut into each rank's share of every step.

- `sources`: on the driver, how each dataset reaches the workers (in memory or streamed,
  decided from metadata); on a worker, the dataset it opens;
- `table`, `stream`: the two ways a worker holds a dataset, each serving a rank's rows of a step;
- `shards`: a Ray Dataset cut into units read on their own (sharded reading);
- `checks`: every batch checked (numeric, one shape, finite), with the file and row named;
- `torch_dataset`: map-style torch Datasets read in parallel;
- `write`: `raytrain data`, a pipeline's datasets as Parquet row groups.

Either way every row is trained exactly once per epoch, all ranks run the same steps, and an
epoch continues from one stored offset at any worker count.
"""
