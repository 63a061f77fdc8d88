"""What reads a run while it goes and after it ended (internal: not part of raytrain's public
API; `raytrain.rundir`'s readers are).

- `sinks`: the follower that feeds the run's records, in time order, to sinks;
- `console`: the driver's console (one live bar, or plain lines);
- `tracking`, `trackers`: TensorBoard (always), MLflow and Weights & Biases;
- `report`: report.md and its plots;
- `render`: numbers, tables and figures as the rest print them.
"""
