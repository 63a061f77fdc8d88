"""What the start benchmarks share (startup.py, startup_phases.py, overhead.py); none of them is
imported here, so that they import one another one way only.

- `note`: one timestamped line to the phases file named by RAYTRAIN_PHASES_FILE, from the
  driver, the controller or a worker (a no-op without one);
- `start_template`: the classic torchrun template, 2 processes, one epoch of `digits`
  (`MarkedDigits` noting its first step), timed from before its start to its first step and
  its exit (`timed_process`);
- `head_command`: `raytrain up` / `raytrain down` with a benchmark's own head record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PHASES_ENV = "RAYTRAIN_PHASES_FILE"
MARK_ENV = "RAYTRAIN_OVERHEAD_MARK"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipelines.digits import DigitsPipeline  # noqa: E402


def note(label: str, at: float | None = None, path: str | None = None) -> None:
    """Append one timestamped line (this process) to the phases file; no-op without one."""
    path = path or os.environ.get(PHASES_ENV)
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"time": at or time.time(), "pid": os.getpid(), "label": label}) + "\n")


def echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class MarkedDigits(DigitsPipeline):
    """`digits`, noting (once per process, the first writer kept) when a training step starts."""

    def __init__(self) -> None:
        self.mark_file = os.environ.get(MARK_ENV)  # read on the driver, pickled to the workers
        self.marked = False

    def compute_loss(self, model, batch):
        if not self.marked and model.training and self.mark_file:
            self.marked = True
            stamp = repr(time.time())
            try:
                fd = os.open(self.mark_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass
            else:
                os.write(fd, stamp.encode())
                os.close(fd)
        return super().compute_loss(model, batch)

    @property
    def name(self) -> str:
        return "digits"


def head_command(verb: str, head_file: Path, extra_env: dict[str, str] | None = None) -> None:
    """`raytrain up` / `raytrain down` with the benchmark's own record."""
    env = {**os.environ, **(extra_env or {}), "RAYTRAIN_HEAD_FILE": str(head_file)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    command = [str(Path(sys.executable).with_name("raytrain")), verb]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    echo(f"raytrain {verb}: {(done.stdout + done.stderr).strip().splitlines()[:1]}")
    if done.returncode != 0:
        raise RuntimeError(f"raytrain {verb} failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")


def start_template(out: Path) -> dict[str, float]:
    from pipelines.digits.pipeline import load_arrays, split
    from raytrain.config import TrainConfig
    from raytrain.driver.session import free_port

    folder = out / "start-template"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "train.npz").exists():
        images, labels = load_arrays()
        rows, _ = split(len(labels))
        np.savez(folder / "train.npz", image=images[rows], label=labels[rows])
        cfg = TrainConfig.from_dict({**DigitsPipeline.default_config, "workers": 2, "epochs": 1})
        (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command += ["-m", "raytrain.baselines.classic_ddp", "--pipeline", "benchmarks.start_common:MarkedDigits"]
    command += ["--data", str(folder / "train.npz"), "--config", str(folder / "config.json"), "--epochs", "1"]
    command += ["--warmup-steps", "0", "--out", str(folder / "out.json")]
    return timed_process(command, out / "mark-template", threads=1)


def timed_process(
    command: list[str], mark: Path, threads: int | None = None, env: dict[str, str] | None = None
) -> dict[str, float]:
    mark.unlink(missing_ok=True)
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **(env or {}), MARK_ENV: str(mark), "PYTHONPATH": pythonpath}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # as Ray gives its 1-CPU workers
    started = time.time()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    ended = time.time()
    if done.returncode != 0 or not mark.exists():
        raise RuntimeError(f"{command[:4]} failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return {"first_step_s": float(mark.read_text()) - started, "end_to_end_s": ended - started}
