"""CPU Ray tier: faults during a run end with one message, the right status, and nothing lost —
divergence, deterministic errors in the pipeline's code, a full disk, `--resume` as documented,
a resume that cannot work, and two runs under one name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from rt_test_pipelines import (
    BrokenPipeline,
    DivergingPipeline,
    DroppingTransformPipeline,
    NegativeRatePipeline,
    OtherShapePipeline,
    RecordingPipeline,
    read_jsonl,
)

import raytrain
from raytrain.cli import main
from raytrain.errors import PipelineCodeError, StorageError, exit_status
from raytrain.instruments.window import TrainingDiverged
from raytrain.rundir.checkpoints import checkpoint_dirs
from raytrain.rundir.host import host_id

pytestmark = pytest.mark.ray


def ours(err: str, command: str = "train") -> list[str]:
    """raytrain's own lines on stderr (the shared test Ray also forwards its workers' logs)."""
    return [line for line in err.splitlines() if line.startswith(f"raytrain {command}:")]


def test_a_nan_loss_stops_the_run_as_diverged_without_saving_bad_weights(ray_session, tmp_path, make_config):
    cfg = make_config(workers=2, epochs=3, batch_size_per_worker=8, name="nan", max_failures=3, log_every_steps=5)
    with pytest.raises(TrainingDiverged) as failure:
        raytrain.fit(DivergingPipeline(str(tmp_path), nan_at_step=30, nan_rank=1), cfg)
    message = str(failure.value)
    assert exit_status(failure.value) == 1  # the command line's: the run failed (never retried, like a UserError)
    assert "NaN or inf at step 30 on rank 1" in message and "--lr" in message and "Last good checkpoint:" in message
    run = tmp_path / "nan"
    strict = {"parse_constant": lambda c: pytest.fail(f"non-strict JSON {c}")}  # json.loads would take NaN
    summary = json.loads((run / "summary.json").read_text(), **strict)
    assert summary["status"] == "diverged"
    assert summary["model_path"] is None and not (run / "model.pt").exists()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, **strict)
    # The epoch-1 checkpoint (step 25) is good and named; nothing from step 30 on was saved.
    steps = [json.loads((d / "position.json").read_text())["step"] for d in checkpoint_dirs(run)]
    assert steps == [25] and str(checkpoint_dirs(run)[0]) in message
    # Noticed within --log-every-steps steps, and not retried: one attempt only.
    attempts = {row["attempt"] for row in read_jsonl(tmp_path / "ids-rank0.jsonl")}
    assert max(row["step"] for row in read_jsonl(tmp_path / "ids-rank0.jsonl")) < 30 + 5 and attempts == {"first"}


@pytest.mark.parametrize(
    "where, expected",
    [
        ("build_model", ["build_model raised KeyError: 'hidden_size'", "rt_test_pipelines.py", "in make_layers"]),
        ("label", ["compute_loss raised IndexError", "rt_test_pipelines.py", "in compute_loss"]),
        ("vector", ["compute_loss must return a scalar loss tensor", "its loss has shape (8,)", "reduction='mean'"]),
    ],
)
def test_errors_in_the_pipelines_code_are_not_retried_and_name_the_method(
    ray_session, tmp_path, where, expected, make_config
):
    cfg = make_config(workers=2, epochs=1, batch_size_per_worker=8, name=where, max_failures=3)
    with pytest.raises(PipelineCodeError) as failure:
        raytrain.fit(BrokenPipeline(str(tmp_path), where=where), cfg)
    for text in expected:
        assert text in str(failure.value), str(failure.value)
    assert len(list(tmp_path.glob("attempt-*"))) <= 2  # two ranks, one attempt: --max-failures 3 unused
    assert json.loads((tmp_path / where / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    "pipeline, expected",
    [
        (NegativeRatePipeline, "pipeline NegativeRatePipeline: lr_factor must return a number ≥ 0"),
        (DroppingTransformPipeline, "pipeline DroppingTransformPipeline: transform_batch returned 4 row(s) in column"),
    ],
)
def test_a_wrong_return_from_a_newer_hook_is_the_pipelines_error_never_retried(
    ray_session, tmp_path, pipeline, expected, make_config
):
    cfg = make_config(workers=2, epochs=1, batch_size_per_worker=8, name="hook", max_failures=3, warmup_epochs=0)
    with pytest.raises(PipelineCodeError) as failure:
        raytrain.fit(pipeline(str(tmp_path), where="none"), cfg)
    assert str(failure.value).startswith(expected) and "rt_test_pipelines.py" in str(failure.value)
    assert len(list(tmp_path.glob("attempt-*"))) <= 2  # two ranks, one attempt: --max-failures 3 unused
    summary = json.loads((tmp_path / "hook" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failures_recovered"] == 0


def test_resume_as_documented_continues_the_runs_own_settings(ray_session, tmp_path, capsys):
    base = ["--workers", "2", "--storage", str(tmp_path), "--name", "long", "--checkpoint-every-steps", "10"]
    # One epoch, then one more on resume, then one more at another batch: each resume's
    # changes are what is checked, not how long the run is.
    assert (
        main(["train", "digits", "--epochs", "1", "--batch-size-per-worker", "8", "--max-failures", "0", *base[:-2]])
        == 0
    )
    config_before = (tmp_path / "long" / "config.yaml").read_text()
    capsys.readouterr()
    # The documented command: no pipeline, no options but the name (and where runs live).
    assert main(["train", "--name", "long", "--resume", "--storage", str(tmp_path), "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "Resuming long from step 90 (epoch 2); changed: --epochs 1 → 2" in out
    summary = json.loads((tmp_path / "long" / "summary.json").read_text())
    assert (
        summary["status"] == "finished" and summary["epochs"] == 2 and summary["steps"] == 2 * 90
    )  # 1438 rows / 16 per step
    after = (tmp_path / "long" / "config.yaml").read_text()
    assert "batch_size_per_worker: 8" in after and after.replace("epochs: 2", "epochs: 1") == config_before.replace(
        "resume: false", "resume: true"
    )
    # Changing the batch re-plans and says so with the rate the rules give: global 32 on
    # the frozen reference batch 8 → lr 4 × 1e-3.
    assert (
        main(
            [
                "train",
                "--name",
                "long",
                "--resume",
                "--storage",
                str(tmp_path),
                "--epochs",
                "3",
                "--global-batch-size",
                "32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--global-batch-size null → 32" in out
    assert (
        "global 32 = 2 workers × 16 per worker × 1 accumulation step; lr 4.0e-3 = 1.0e-3 × 4 (linear rule, reference "
        "batch 8)" in out
    )


def test_a_resume_that_cannot_work_is_refused_before_any_run_file_changes(one_epoch_recording_run, tmp_path, capsys):
    # A finished 2-worker RecordingPipeline run, shared with test_train_ray.py (tests/conftest.py).
    base, storage, run = one_epoch_recording_run.base, one_epoch_recording_run.storage, one_epoch_recording_run.run_dir
    out = tmp_path / "records"  # not the run's own records: nothing here may add to them
    out.mkdir()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    # Another model shape: refused on the driver, before Ray Train starts.
    with pytest.raises(raytrain.rundir.checkpoints.CheckpointError, match="does not load the run's checkpoint"):
        raytrain.fit(
            OtherShapePipeline(str(out), num_rows=64), raytrain.TrainConfig(**{**base, "epochs": 2, "resume": True})
        )
    # Another pipeline: refused with exit 2, naming both.
    code = main(["train", "digits", "--name", "good", "--resume", "--storage", str(storage)])
    err = capsys.readouterr().err
    assert code == 2 and "trains 'RecordingPipeline', not 'digits'" in err
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # byte-identical: config.yaml, summary.json, metrics, model.pt
    assert main(["export", str(run), "-o", str(tmp_path / "m.pt")]) == 0


def test_a_second_run_under_the_same_name_is_refused_naming_the_holder(ray_session, tmp_path, capsys):
    from raytrain.rundir import RunLock

    holder = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / ".lock").write_text(
            json.dumps({"pid": holder.pid, "host": os.uname().nodename, "host_id": host_id(), "since": 0})
        )
        code = main(["train", "digits", "--name", "busy", "--storage", str(tmp_path), "--workers", "1"])
        err = capsys.readouterr().err
        assert code == 2 and f"in use by process {holder.pid}" in err
    finally:
        holder.kill()
        holder.wait()
    # Its holder gone, the lock is stale and taken over.
    lock = RunLock(tmp_path / "busy")
    lock.acquire()
    assert lock.holder()["pid"] == os.getpid()
    lock.release()


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root only: skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_stops_the_run_once_naming_the_path_and_resume_continues_after(ray_session, small_disk, tmp_path):
    base = dict(
        workers=2,
        batch_size_per_worker=32,
        storage=str(small_disk),
        name="full",
        max_failures=3,
        num_checkpoints_to_keep=5,
    )
    records = tmp_path / "records"
    records.mkdir()
    # digits' checkpoints take ~1.4 MB each: the third does not fit in 3 MiB.
    with pytest.raises(StorageError) as failure:
        raytrain.fit("digits", raytrain.TrainConfig(epochs=4, **base))
    message = str(failure.value)
    assert "(ENOSPC)" in message and str(small_disk) in message and "Traceback" not in message
    good = checkpoint_dirs(small_disk / "full")
    assert [json.loads((d / "position.json").read_text())["step"] for d in good] == [23, 46]  # intact, none partial
    assert not (small_disk / "full" / ".staging").exists()
    summary = (
        json.loads((small_disk / "full" / "summary.json").read_text() or "{}")
        if (small_disk / "full" / "summary.json").exists()
        else {}
    )
    assert summary.get("status") in (None, "failed")
    # More room, and --resume continues from the last complete checkpoint, not from step 0.
    subprocess.run(["mount", "-o", "remount,size=40m", str(small_disk)], check=True)
    result = raytrain.fit("digits", raytrain.TrainConfig(epochs=4, resume=True, **base))
    assert result.summary["status"] == "finished" and result.summary["steps"] == 4 * 23
    events = read_jsonl(small_disk / "full" / "events.jsonl")
    assert any("Restarted from the checkpoint at step 46" in e["message"] for e in events)


# Scenario stage (docs/testing.md): Ray's record naming a deleted checkpoint set aside is
# tests/test_hardening.py's; resumes on Ray stay in CI through the tests above.
@pytest.mark.scenario
def test_resuming_a_run_whose_only_checkpoint_was_deleted_starts_over_and_says_so_every_time(
    ray_session, tmp_path, make_config
):
    """--num-checkpoints-to-keep 1, the one checkpoint deleted, then --resume: Ray Train's own
    record still names it (CheckpointManagerInitializationError if it reads that); every time,
    the run starts over from the start and says so."""
    from raytrain.rundir.checkpoints import RAY_SNAPSHOT

    out = tmp_path / "records"
    out.mkdir()
    base = dict(workers=1, epochs=1, batch_size_per_worker=16, name="kept1")
    raytrain.fit(RecordingPipeline(str(out), num_rows=64), make_config(**base, num_checkpoints_to_keep=1))
    run = tmp_path / "kept1"
    for _ in range(2):
        (only,) = checkpoint_dirs(run)
        assert only.name in (run / RAY_SNAPSHOT).read_text()  # Ray's record names it
        shutil.rmtree(only)
        lines: list[str] = []
        result = raytrain.fit(
            RecordingPipeline(str(out), num_rows=64), make_config(**base, resume=True), echo=lines.append
        )
        assert any("Resuming kept1 from the start (it has no checkpoint yet)" in line for line in lines)
        assert any(f"names 1 that are gone ({only.name})" in line for line in lines), lines
        assert result.summary["status"] == "finished" and result.summary["steps"] == 4
