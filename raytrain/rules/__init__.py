"""Pure decisions (internal: not part of raytrain's public API). Nothing here imports Ray or
torch, so every rule is unit-tested on its own; each module's rule: docs/architecture.md, the
rules row."""
