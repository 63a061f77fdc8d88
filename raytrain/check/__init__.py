"""`raytrain check PIPELINE --workers N`: do N workers train like 1? Internal (docs/architecture.md
maps the modules: `verdict` pure, `probes`, `worker`, `driver`, `options`)."""
