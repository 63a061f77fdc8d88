"""Where the time to the first step goes: `raytrain train` and the bare TorchTrainer, phase by phase.

Each contender runs in a fresh process, as in benchmarks/startup.py, with raytrain's and
Ray's phase functions wrapped to note wall-clock times (driver and workers append to one
file). The timeline runs from just before the process starts to rank 0's first training
forward pass. Contenders:

- raytrain: `raytrain train benchmarks.startup_phases:PhasedDigits --workers N --epochs 1`
  (the CLI's `main`, called after noting the interpreter's start and the CLI's import);
- raytrain-nice15: the same with RAY_worker_niceness=15, Ray's default worker niceness, which
  raytrain's embedded Ray no longer uses;
- raytrain-head: the same joining the head `raytrain up` recorded in --head-file (started
  before, stopped after, by the caller: benchmarks/overhead.py does); the other contenders
  never join one;
- bare, bare+data: `benchmarks/startup.py`'s floor (ray.init + TorchTrainer + prepare_model
  + one step, with and without reading the dataset once per worker);
- bare-epoch, bare-epoch-head: the floor for the same work, a plain TorchTrainer running one
  epoch of `digits` as the template does (`startup.digits_epoch`: no raytrain), on its own
  embedded Ray or joining the --head-file head;
- template: the classic torchrun template (`start_common.start_template`), first step and exit.

Ray Train's own phases (controller started, worker group starting, worker actors up, process
group formed, train function launched) are noted by `PhaseNotes`, a Ray Train callback that
RAY_TRAIN_CALLBACKS puts in every contender's controller. Every timeline ends with the
process's exit. With --head-file and no head recorded there, `raytrain up` starts one before the
rounds and `raytrain down` stops it after.

Rounds alternate the order; each phase's figure is the median over rounds. Usage:

    python benchmarks/startup_phases.py --workers 2 --rounds 3 [--contenders raytrain,bare] [--json out.json]
    python benchmarks/startup_phases.py --rounds 3 --head-file /tmp/h.json \
        --contenders template,bare-epoch-head,raytrain-head,bare-epoch,raytrain
"""

from __future__ import annotations

import time

STARTED = time.time()  # noqa: E402 — before any import worth timing

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = (
    "raytrain",
    "raytrain-nice15",
    "raytrain-head",
    "bare",
    "bare+data",
    "bare-epoch",
    "bare-epoch-head",
    "template",
)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import startup  # noqa: E402
from benchmarks.start_common import PHASES_ENV, head_command, note, start_template  # noqa: E402
from pipelines.digits import DigitsPipeline  # noqa: E402


def timed(owner, attr: str, label: str, describe=None) -> None:
    """Replace owner.attr by a wrapper noting '<label> start' and '<label> end' around each call
    (nothing when the code no longer has that name: the phase is left out, not the run)."""
    original = getattr(owner, attr, None)
    if original is None or getattr(original, "_phased", False):
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        name = f"{label} {describe(*args, **kwargs)}" if describe else label
        note(f"{name} start")
        try:
            return original(*args, **kwargs)
        finally:
            note(f"{name} end")

    wrapper._phased = True
    setattr(owner, attr, wrapper)


def wrap_driver() -> None:
    import ray
    from ray.train.torch import TorchTrainer

    from raytrain.driver import run as trainer
    from raytrain.observe import tracking

    timed(ray, "init", "ray.init")
    timed(TorchTrainer, "fit", "TorchTrainer.fit")
    timed(tracking, "RunTracker", "run tracker")
    for name in ("resolve_gpu", "build_datasets", "prepare_datasets", "build_torch_trainer"):
        timed(trainer, name, name)


@functools.lru_cache(maxsize=None)
def phase_notes_class():
    """`PhaseNotes`, built on first use: importing Ray Train's callbacks costs the parent nothing."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    class Notes(ControllerCallback, WorkerGroupCallback):
        """Notes Ray Train's phases from its controller. Made by Ray in the driver (no
        arguments: RAY_TRAIN_CALLBACKS), where the phases file is read, and run in the
        controller. The order in Ray 2.60 (worker_group.WorkerGroup._start_impl): actors
        created, train context set, then the `after_worker_group_start` callbacks, this one
        first and Ray's backend callback (which forms the process group) after it."""

        def __init__(self) -> None:
            self.path = os.environ.get(PHASES_ENV)

        def after_controller_start(self, train_run_context) -> None:
            note("controller started", path=self.path)

        def before_worker_group_start(self, worker_group_context) -> None:
            note("worker group starting (placement group, actors)", path=self.path)

        def before_init_train_context(self, workers):
            note("worker actors up", path=self.path)
            return {}

        def after_execution_group_start(self, execution_group) -> None:
            note("train context set; process group next", path=self.path)

        def after_worker_group_training_start(self, worker_group) -> None:
            note("process group formed; train function launched", path=self.path)

    Notes.__qualname__ = Notes.__name__ = "PhaseNotes"
    return Notes


def __getattr__(name: str):
    if name == "PhaseNotes":  # what RAY_TRAIN_CALLBACKS names
        return phase_notes_class()
    raise AttributeError(name)


_WRAPPED: list[bool] = []  # non-empty once this process's worker wrappers are in place


def wrap_worker() -> None:
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker import loop, runtime

    _WRAPPED.append(True)

    timed(loop, "Runtime", "worker context")
    timed(loop, "begin", "restore and build")
    timed(loop, "open_source", "open_source", describe=lambda name, source, *_: f"{name} ({type(source).__name__})")
    timed(loop.StepRunner, "build", "StepRunner.build")
    timed(runtime.Runtime, "prepare_model", "prepare_model")
    timed(RunWriter, "start_attempt", "start_attempt")


class PhasedDigits(DigitsPipeline):
    """`digits`, noting its phases on the workers and when rank 0 starts its first step."""

    def __init__(self) -> None:
        self.phases_file = os.environ.get(PHASES_ENV)  # read on the driver, pickled to the workers
        self.marked = False

    def __setstate__(self, state: dict) -> None:
        # Unpickled on a worker just before the train function runs: install the wrappers.
        self.__dict__.update(state)
        if self.phases_file and not _WRAPPED:
            os.environ[PHASES_ENV] = self.phases_file
            note("train function received")
            wrap_worker()

    def build_model(self, cfg):
        note("build_model")
        return super().build_model(cfg)

    def compute_loss(self, model, batch):
        if not self.marked and model.training:
            self.marked = True
            note("first step")
        return super().compute_loss(model, batch)

    @property
    def name(self) -> str:
        return "digits"


# -- the child processes --------------------------------------------------------------------


def child_raytrain(argv: list[str]) -> int:
    note("python started", at=STARTED)
    from raytrain.cli import main

    note("CLI imported")
    wrap_driver()
    note("phase wrappers installed (imports ray.train.torch)")
    return main(argv)


def child_bare(workers: int, with_data: bool, epoch: bool) -> None:
    note("python started", at=STARTED)
    wrap_driver()
    note("phase wrappers installed (imports ray.train.torch)")
    mark = Path(tempfile.mkstemp(prefix="startup-phases-")[1])
    os.environ[startup.MARK_ENV] = str(mark)
    startup.bare(workers, with_data, address=os.environ.get("RAY_ADDRESS") or "local", epoch=epoch)
    if not epoch:  # the epoch's rank 0 notes its own phases
        note("first step", at=float(mark.read_text()))
    mark.unlink()


# -- the parent ---------------------------------------------------------------------------------


def measure(kind: str, workers: int, storage: str, head_file: str | None = None) -> list[tuple[str, str, float]]:
    """(process, label, seconds since the start) for the driver and rank 0, in time order."""
    if kind == "template":
        figures = start_template(Path(storage))
        return [("driver", "first step", figures["first_step_s"]), ("driver", "exit", figures["end_to_end_s"])]
    phases = Path(tempfile.mkstemp(prefix=f"phases-{kind}-")[1])
    env = {
        **os.environ,
        PHASES_ENV: str(phases),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        # Only raytrain-head joins a `raytrain up` head; the others read a record that is never there.
        "RAYTRAIN_HEAD_FILE": head_file if kind == "raytrain-head" else str(phases) + ".no-head.json",
        "RAY_TRAIN_CALLBACKS": "benchmarks.startup_phases.PhaseNotes",
    }
    if kind.endswith("-head") and not head_file:
        raise ValueError(f"{kind} needs --head-file (a record `raytrain up` wrote)")
    if kind == "bare-epoch-head":  # joins as any Ray program would: the address and auth `raytrain up` printed
        record = json.loads(Path(head_file).read_text())
        env.update(RAY_ADDRESS=record["address"], RAY_AUTH_MODE=record["auth_mode"])
    env.pop("RAY_worker_niceness", None)  # Ray's default (15) for the bare floor; raytrain sets its own
    if kind == "raytrain-nice15":
        env["RAY_worker_niceness"] = "15"
    if kind.startswith("raytrain"):
        spec = "benchmarks.startup_phases:PhasedDigits"
        command = [
            sys.executable,
            __file__,
            "--child",
            "train",
            spec,
            "--workers",
            str(workers),
            "--epochs",
            "1",
            "--storage",
            storage,
        ]
    else:
        command = [sys.executable, __file__, "--child-bare", "--workers", str(workers)]
        command += ["--with-data"] if kind == "bare+data" else []
        command += ["--epoch"] if kind.startswith("bare-epoch") else []
    started = time.time()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed ({done.returncode}): {done.stderr[-2000:]}")
    records = [json.loads(line) for line in phases.read_text().splitlines() if line.strip()]
    phases.unlink()
    return timeline(records, started) + [("driver", "exit", ended - started)]


CONTROLLER_LABELS = ("controller", "worker group", "worker actors", "train context", "process group formed")


def timeline(records: list[dict], started: float) -> list[tuple[str, str, float]]:
    """The driver's, the controller's and rank 0's records (rank 0: the worker that noted the
    first step or first batch), up to that step."""
    driver = records[0]["pid"]
    first = next(r for r in records if r["label"] in ("first step", "first batch"))
    controller = {r["pid"] for r in records if r["label"].startswith(CONTROLLER_LABELS)}
    kept = [r for r in records if r["pid"] in {driver, first["pid"]} | controller and r["time"] <= first["time"]]
    kept.sort(key=lambda r: r["time"])
    names = {driver: "driver", first["pid"]: "rank 0"}
    return [(names.get(r["pid"], "ctrl"), r["label"], r["time"] - started) for r in kept]


def phase_table(runs: list[list[tuple[str, str, float]]]) -> list[dict]:
    """Per step of the timeline: median seconds since the previous step and since the start."""
    rows = []
    for index, (process, label, _) in enumerate(runs[0]):
        same = [run for run in runs if len(run) > index and run[index][1] == label]
        since_start = [run[index][2] for run in same]
        gap = [run[index][2] - (run[index - 1][2] if index else 0.0) for run in same]
        previous = runs[0][index - 1][1] if index else "process start"
        rows.append(
            {
                "process": process,
                "from": previous,
                "to": label,
                "seconds": statistics.median(gap),
                "at": statistics.median(since_start),
                "rounds": len(same),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"comma-separated, from {', '.join(CONTENDERS)}"
    )
    parser.add_argument("--json", help="write the timelines and tables here")
    parser.add_argument("--head-file", help="the record of a running `raytrain up` head (for raytrain-head)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--child-bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--with-data", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--epoch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.exit(child_raytrain(args.child))
    if args.child_bare:
        child_bare(args.workers, args.with_data, args.epoch)
        return
    kinds = [k for k in args.contenders.split(",") if k]
    unknown = [k for k in kinds if k not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    storage = tempfile.mkdtemp(prefix="raytrain-startup-phases-")
    own_head = bool(args.head_file) and not Path(args.head_file).exists()
    if own_head:
        head_command("up", Path(args.head_file))
    try:
        runs = run_rounds(args, kinds, storage)
    finally:
        if own_head:
            head_command("down", Path(args.head_file))
    report(args, runs)


def run_rounds(args, kinds: list[str], storage: str) -> dict[str, list]:
    runs: dict[str, list] = {kind: [] for kind in kinds}
    for index in range(args.rounds):
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            try:
                run = measure(kind, args.workers, storage, args.head_file)
            except Exception as exc:  # one contender failing leaves the others' figures
                print(f"round {index + 1}: {kind} failed: {str(exc)[-1500:]}", flush=True)
                continue
            runs[kind].append(run)
            first, end = first_step_s(run), run[-1][2]
            print(
                f"round {index + 1}: {kind:15s} first step after {first:.1f} s, exit after {end:.1f} s "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    return runs


def first_step_s(run: list[tuple[str, str, float]]) -> float:
    return next(at for _, label, at in run if label in ("first step", "first batch"))


def report(args, runs: dict[str, list]) -> None:
    print(f"\nstart -> first step, -> exit: median of {args.rounds} round(s), s (ratio: exit to the template's)")
    template = [run[-1][2] for run in runs.get("template", [])]
    runs = {kind: kind_runs for kind, kind_runs in runs.items() if kind_runs}
    for kind, kind_runs in runs.items():
        first = statistics.median(first_step_s(run) for run in kind_runs)
        end = statistics.median(run[-1][2] for run in kind_runs)
        ratio = f"{statistics.median(run[-1][2] / t for run, t in zip(kind_runs, template)):.2f}x" if template else "-"
        print(f"  {kind:15s} first step {first:6.1f}  exit {end:6.1f}  {ratio}")
    tables = {kind: phase_table(kind_runs) for kind, kind_runs in runs.items()}
    for kind, rows in tables.items():
        print(f"\n{kind}: median over {args.rounds} round(s), seconds")
        for row in rows:
            print(f"  {row['at']:6.2f}  +{row['seconds']:5.2f}  {row['process']:6s}  {row['to']}")
    if args.json:
        summary = {
            "date": time.strftime("%Y-%m-%d"),
            "workers": args.workers,
            "rounds": args.rounds,
            "load_average_at_end": list(os.getloadavg()),
            "tables": tables,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
