"""What DESIGN.md ("Files a run leaves") fixes of a run's records, for the tests that read them."""

# The keys of every metrics.jsonl row; validation metrics come beside them.
METRICS_KEYS = frozenset(
    {"epoch", "step", "samples_seen", "world_size", "global_batch_size", "lr", "loss", "samples_per_s", "time_s"}
)
