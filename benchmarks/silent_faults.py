"""Slow and silent faults on CPU workers: a straggler named, a corrupted replica caught.

- `straggler`: 3 workers, steps paced at 0.05 s, rank 1 0.3 s slower per step from step 10
  (`tests/rt_test_pipelines.StragglingPipeline`), 40 steps: the step of the `straggler` event,
  the rank and ratio it names, how many steps after the slowdown, and the run's status.
- `corrupt`: 2 workers, checkpoints every 5 steps, one weight of rank 1's replica +1.0 at step 12
  (`CorruptingPipeline`): the step of the `replica_mismatch` event and the ranks it names, the
  checkpoint the run went back to, the status, the failures recovered, the replica checks after
  the rollback (all agreed: no second event), and whether `raytrain export` loads strict.

    python benchmarks/silent_faults.py OUT [--cases straggler,corrupt]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from rt_test_pipelines import CorruptingPipeline, StragglingPipeline, read_jsonl  # noqa: E402


def straggler(out: Path) -> dict:
    import raytrain

    records = out / "records"
    records.mkdir(parents=True)
    cfg = raytrain.TrainConfig(
        workers=3, batch_size_per_worker=8, max_steps=40, storage=str(out), name="straggler", schedule="constant",
        progress="off",
    )  # fmt: skip
    pipeline = StragglingPipeline(str(records), slow_rank=1, from_step=10, extra_s=0.3, step_sleep_s=0.05, num_rows=960)
    result = raytrain.fit(pipeline, cfg)
    events = read_jsonl(Path(result.run_dir) / "events.jsonl")
    found = [e for e in events if e["kind"] == "straggler"]
    first = found[0] if found else {}
    return {
        "status": result.summary["status"],
        "events": len(found),
        "named_at_step": first.get("step"),
        "steps_after_slowdown": first.get("step", 0) - 10 if first else None,
        "rank": first.get("rank"),
        "step_ratio": first.get("step_ratio"),
        "data_wait_fraction": first.get("data_wait_fraction"),
    }


def corrupt(out: Path) -> dict:
    import torch

    import raytrain
    from raytrain.cli import main

    records = out / "records"
    records.mkdir(parents=True)
    cfg = raytrain.TrainConfig(
        workers=2, batch_size_per_worker=8, epochs=1, checkpoint_every_steps=5, num_checkpoints_to_keep=10,
        storage=str(out), name="corrupt", progress="off",
    )  # fmt: skip
    result = raytrain.fit(CorruptingPipeline(str(records), rank=1, at_step=12, num_rows=400), cfg)
    run_dir = Path(result.run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    mismatches = [e for e in events if e["kind"] == "replica_mismatch"]
    exported = out / "model.pt"
    loads = main(["export", str(run_dir), "-o", str(exported)]) == 0
    if loads:
        model = CorruptingPipeline(str(records)).build_model(cfg)
        model.load_state_dict(torch.load(exported, weights_only=True), strict=True)
    first = mismatches[0] if mismatches else {}
    return {
        "status": result.summary["status"],
        "mismatch_events": len(mismatches),
        "caught_at_step": first.get("step"),
        "ranks": first.get("ranks"),
        "back_to": first.get("checkpoint"),
        "failures_recovered": result.summary["failures_recovered"],
        "export_loads_strict": loads,
    }


CASES = {"straggler": straggler, "corrupt": corrupt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(
            f"--cases: no case {', '.join(map(repr, unknown))}; choose among {', '.join(CASES)}, comma-separated"
        )
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"OUT {args.out} is a file; give a directory (made if missing)")
    rows = {}
    for name in args.cases.split(","):
        rows[name] = CASES[name](args.out / name)
        print(json.dumps({name: rows[name]}), flush=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
