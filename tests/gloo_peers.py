"""Run under `python -m torch.distributed.run --standalone --nproc_per_node=2 tests/gloo_peers.py HOW OUT`:
both ranks all-reduce once over gloo, then rank 1 goes away (HOW: "exits") or stops answering
(HOW: "stalls") while rank 0 all-reduces again; rank 0 writes to OUT, as JSON, what torch raised
and whether raytrain takes it for a collective failure (a worker fault, retried) rather than the
pipeline's."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from raytrain.parallel.strategy import is_collective_failure

if __name__ == "__main__":
    how, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    values = torch.ones(4)
    dist.all_reduce(values)  # both ranks connected
    if dist.get_rank() == 1:
        if how == "stalls":
            time.sleep(8)
        os._exit(0)
    time.sleep(0.5)
    try:
        dist.all_reduce(values)
        seen = {"type": None}
    except Exception as exc:
        seen = {"type": type(exc).__name__, "message": str(exc), "collective": is_collective_failure(exc)}
    with open(out, "w") as file:
        json.dump(seen, file)
    os._exit(0)
