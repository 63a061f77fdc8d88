"""The driver (internal: not part of raytrain's public API; `raytrain.fit` is).

- `run`: one run, `fit`, from the resolved configuration to the run files;
- `session`: the Ray it runs on (joined or embedded) and what that can hold;
- `launch`: the Ray Train TorchTrainer and its timers;
- `failfast`: deterministic errors end the run instead of being retried;
- `interrupts`: Ctrl-C and SIGTERM, leaving the run resumable;
- `summary`: summary.json, and a failure explained in one paragraph.
"""
