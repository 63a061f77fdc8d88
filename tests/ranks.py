"""Run one of the tests' scripts under torchrun: N local processes over gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from raytrain.bench.baselines import GLOO_ABORT

TESTS = Path(__file__).parent


def run_ranks(script: str, *args: str, ranks: int = 2, timeout_s: float = 300, check: bool = True):
    """`tests/<script> args...` under `torch.distributed.run --standalone` with `ranks` processes;
    once more when a rank was aborted by gloo itself (GLOO_ABORT), not by the script. Returns the
    completed process (its output captured); with `check`, a failed run raises."""
    env = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    command += [str(TESTS / script), *map(str, args)]
    for attempt in range(2):
        done = subprocess.run(command, env=env, timeout=timeout_s, capture_output=True, text=True)
        if done.returncode == 0 or GLOO_ABORT not in done.stderr or attempt == 1:
            break
        print(f"{script}: a rank was aborted by gloo ({GLOO_ABORT!r}); running it once more", file=sys.stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"{script} failed (exit status {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done
