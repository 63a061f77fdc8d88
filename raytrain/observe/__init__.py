"""What reads a run while it goes and after it ended (internal: `raytrain.rundir`'s readers are
the public API; docs/architecture.md maps the modules)."""
