"""Run files on a real S3 server (moto on loopback, signatures checked): the Store's semantics,
the lock, checkpoints complete or invisible, the errors a user sees (exit 2 before Ray starts,
one message each), transient outages ridden out and long ones stopped once."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from raytrain.errors import StorageError
from raytrain.rundir import Event, MetricsRow, RunDir, RunLock, RunLocked, StorageUnavailable, Store, formats
from raytrain.rundir import checkpoints as ckpt
from raytrain.rundir.files import DriverWatch, LockUnreadable, read_beat
from raytrain.rundir.publish import Publish

pytestmark = pytest.mark.slow


def test_whole_object_writes_appends_listing_and_tail(s3, bucket):
    store = Store.of(s3.uri(bucket, "runs/one"))
    files = RunDir(store)
    files.write_config({"epochs": 2, "pipeline": "digits"})
    tail = files.tail("metrics.jsonl")
    for step in (1, 2):
        files.append_metrics(MetricsRow(epoch=0, step=step, loss=1.0 / step))
    files.append_event(Event("plan", "the plan"))
    assert [row["step"] for row in tail.read()] == [1, 2]
    files.append_metrics(MetricsRow(epoch=0, step=3))
    assert [row["step"] for row in tail.read()] == [3]  # a ranged read of what is new
    files.truncate_metrics(2)  # a restart drops the rows after its checkpoint: a rewrite
    files.append_metrics(MetricsRow(epoch=0, step=3, loss=0.25))
    assert [(row["step"], row["loss"]) for row in tail.read()] == [(3, 0.25)]
    assert [row.step for row in files.metrics()] == [1, 2, 3] and files.config()["epochs"] == 2
    assert set(s3.objects(bucket, "runs/one/")) == {
        "runs/one/config.yaml",
        "runs/one/metrics.jsonl",
        "runs/one/events.jsonl",
    }
    # Stored bytes are the bytes written (signed requests, no transfer framing left in them).
    assert s3.read(bucket, "runs/one/config.yaml").decode().startswith("epochs: 2")


def test_one_run_per_name_by_a_conditional_create(s3, bucket):
    store = Store.of(s3.uri(bucket, "runs/locked"))
    first, second = RunLock(store), RunLock(store)
    first.acquire()
    with pytest.raises(RunLocked, match=f"in use by process {os.getpid()}"):
        second.acquire()
    # The create is conditional: of many racing starters exactly one wins.
    first.release()
    winners, refused = [], []

    def race() -> None:
        lock = RunLock(store)
        try:
            lock.acquire()
            winners.append(lock)
        except RunLocked:
            refused.append(lock)

    threads = [threading.Thread(target=race) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1 and len(refused) == 5
    winners[0].release()
    assert "runs/locked/.lock" not in s3.objects(bucket, "runs/")


def test_a_drivers_beat_beside_its_lock_and_its_workers_look_on_a_store(s3, bucket):
    store = Store.of(s3.uri(bucket, "runs/beating"))
    lock = RunLock(store, owner="driver-a", beat_s=0.05)
    lock.acquire()
    try:
        deadline = time.monotonic() + 30
        while read_beat(store, "driver-a") is None:  # written beside the lock, never into it
            assert time.monotonic() < deadline, "the beat never came"
            time.sleep(0.05)
        assert DriverWatch(store, "driver-a").why_gone() is None  # the lock read by a ranged GET
        assert "held by another driver" in DriverWatch(store, "driver-z").why_gone()
    finally:
        lock.release()
    assert not [key for key in s3.objects(bucket, "runs/") if key.startswith("runs/beating/.lock")]
    assert "lock is gone" in DriverWatch(store, "driver-a").why_gone()  # a missing object: not an error
    store.write_bytes(".lock", b"[" * 4096)
    with pytest.raises(LockUnreadable, match="holds more than 1024 bytes"):
        RunLock(store, owner="driver-b").acquire()


def _stage(directory: Path, step: int) -> None:
    """A tiny checkpoint as one writer stages it: a shard, DCP metadata, the final files."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True)
    with formats.single_process():
        dcp.save({"model": {"w": torch.full((4,), float(step))}}, checkpoint_id=str(directory), no_dist=True)
    ckpt.write_train_state(directory, {"position": {"step": step}, "scaler": {}, "rng": []})


def test_a_checkpoint_is_invisible_until_its_marker_and_a_failed_upload_leaves_the_last_one(s3, bucket, tmp_path):
    run = Store.of(s3.uri(bucket, "runs/ck"))
    _stage(tmp_path / "a", 4)
    Publish(tmp_path / "a", run / "checkpoint_s000000004_x", lambda: None, rank=None, coordinator=True, step=4).run()
    assert [c.name for c in ckpt.checkpoint_dirs(run)] == ["checkpoint_s000000004_x"]
    assert ckpt.load_state(ckpt.latest_complete(run))["model"]["w"].tolist() == [4.0] * 4

    # The next checkpoint's upload fails half-way (its write failed on this node): its files
    # that did arrive are never listed, and the previous checkpoint is untouched.
    _stage(tmp_path / "b", 8)
    (tmp_path / "b" / ckpt.TRAIN_STATE_FILE).unlink()

    def failed_write() -> None:
        raise StorageError(28, "disk full while writing the checkpoint")

    upload = Publish(tmp_path / "b", run / "checkpoint_s000000008_y", failed_write, rank=None, coordinator=True, step=8)
    with pytest.raises(StorageError):
        upload.run()
    run_parts = Publish(
        tmp_path / "b", run / "checkpoint_s000000008_y", lambda: None, rank=None, coordinator=True, step=8
    )
    run_parts._upload(run_parts._own_files())  # the shards reach the store, the marker never does
    assert any("checkpoint_s000000008_y/" in key for key in s3.objects(bucket))
    assert [c.name for c in ckpt.checkpoint_dirs(run)] == ["checkpoint_s000000004_x"]
    assert ckpt.stored_step(ckpt.latest_complete(run)) == 4


def test_weights_read_back_from_the_bucket_load_strict(s3, bucket):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    Store.of(s3.uri(bucket, "runs/w")).write_bytes("model.pt", buffer.getvalue())
    weights = ckpt.load_model_weights(s3.uri(bucket, "runs/w"))
    torch.nn.Sequential(torch.nn.Linear(3, 2)).load_state_dict(weights, strict=True)


def test_a_short_outage_is_ridden_out_and_a_long_one_stops_with_one_message(s3, bucket):
    store = Store.of(s3.uri(bucket, "runs/outage"), retry_s=60)
    s3.pause()
    timer = threading.Timer(2.0, s3.resume)
    timer.start()
    try:
        store.write_text("progress.json", "{}")  # retried with backoff until the server is back
    finally:
        timer.join()
        s3.resume()
    assert s3.read(bucket, "runs/outage/progress.json") == b"{}"

    brief = Store.of(s3.uri(bucket, "runs/outage"), retry_s=3)
    s3.pause()
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailable) as failure:
            brief.write_text("progress.json", '{"step": 2}')
        took = time.monotonic() - started
    finally:
        s3.resume()
    message = str(failure.value)
    assert "did not answer" in message and "--resume" in message and len(message.splitlines()) == 1
    assert took < 60
    assert s3.read(bucket, "runs/outage/progress.json") == b"{}"  # the old object, whole


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from raytrain.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env or dict(os.environ)
    )


def test_bad_storage_is_exit_2_before_ray_starts_with_one_message_each(s3, bucket, tmp_path):
    """No credentials, wrong keys, a missing bucket, an unreachable endpoint: each is one line on
    stderr and exit status 2, found before Ray starts (no Ray session directory is made)."""
    quiet = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    quiet.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        RAY_TMPDIR=str(tmp_path / "ray"),
    )
    endpoint = f"?endpoint_override=127.0.0.1:{s3.port}&scheme=http"
    cases = {
        "no AWS credentials found": f"s3://{bucket}/runs{endpoint}",
        "the store does not know the access key id": s3.uri(bucket, "runs", key="AKIANOBODY", secret="x"),
        "the secret key does not match": s3.uri(bucket, "runs", secret="wrong"),
        "the bucket does not exist": s3.uri("no-such-bucket", "runs"),
        "cannot reach the store": f"s3://k:s@{bucket}/runs?endpoint_override=127.0.0.1:9&scheme=http",
    }
    for expected, uri in cases.items():
        done = _cli("train", "digits", "--workers", "1", "--epochs", "1", "--storage", uri, "--name", "r", env=quiet)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], (expected, done.stderr)
        assert s3.secret not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "ray").exists()
    assert s3.objects(bucket) == {}


@pytest.mark.ray
def test_doctor_checks_the_store_from_every_node(ray_session, s3, bucket):
    from raytrain.doctor import run_doctor

    lines: list[str] = []
    assert run_doctor(address=None, storage=s3.uri(bucket, "runs"), echo=lines.append) == 0
    text = "\n".join(lines)
    assert "credentials, bucket and a write, read and delete checked here" in text
    assert "written, read and deleted from every node" in text or "1 node(s)" in text
    assert not [key for key in s3.objects(bucket) if not key.endswith("/")]  # the marker and probes are gone
    lines.clear()
    assert run_doctor(address=None, storage=s3.uri("no-such-bucket", "runs"), echo=lines.append) == 1
    assert any(line.startswith("FAIL") and "the bucket does not exist" in line for line in lines)
