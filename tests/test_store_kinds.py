"""What differs between a local run directory and an object store's is answered by `Store`, so
the callers never ask which kind it is: how a file becomes visible, a local path for the tools
that need one, how rows are appended and how often a file is looked at, and where Ray keeps its
files. Each test holds for both kinds (the object store: moto on loopback, in the slow tier)."""

from __future__ import annotations

import json
import os
import time

import pytest

from raytrain.rundir import MetricsRow, RunDir, RunLock, RunLocked, Store, claimed
from raytrain.rundir.writer import RunWriter


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store.of(tmp_path / "runs" / "kinds")
    s3, bucket = request.getfixturevalue("s3"), request.getfixturevalue("bucket")
    return Store.of(s3.uri(bucket, "runs/kinds"))


def test_a_staged_file_becomes_visible_whole_when_its_block_ends_and_never_when_it_fails(store):
    store.make_dir()
    store.write_text("model.pt", "old")
    with store.staged_file("model.pt") as tmp:
        tmp.write_bytes(b"new")
        assert store.read_text("model.pt") == "old"  # not visible while it is written
    assert store.read_text("model.pt") == "new"
    with pytest.raises(RuntimeError), store.staged_file("model.pt") as tmp:
        tmp.write_bytes(b"torn")
        raise RuntimeError("the writer died")
    assert store.read_text("model.pt") == "new" and store.list() == ["model.pt"]  # nothing torn, no leftovers


def test_files_written_locally_are_the_stores_once_the_block_ends(store):
    with store.write_locally(("*.json", "plots/*")) as local:
        (local / "plots").mkdir(parents=True)
        (local / "bench.json").write_text("{}")
        (local / "plots" / "loss.png").write_bytes(b"png")
    assert store.read_text("bench.json") == "{}" and store.read_bytes("plots/loss.png") == b"png"
    assert local.exists() == store.local  # the run directory itself, or a temporary copy: gone
    with pytest.raises(RuntimeError), store.write_locally() as local:
        (local / "half.json").write_text("{")
        raise RuntimeError("the report failed")
    assert store.read_text("bench.json") == "{}"


def test_a_local_copy_holds_the_named_files_and_directories_that_exist(store):
    store.make_dir()
    store.write_text("model.pt", "weights")
    with store.write_locally() as local:  # plots/ made whichever the kind
        (local / "plots").mkdir(parents=True, exist_ok=True)
        (local / "plots" / "loss.png").write_text("png")
    with store.local_copy(("model.pt", "plots", "report.md")) as copy:
        assert (copy / "model.pt").read_text() == "weights" and (copy / "plots" / "loss.png").read_text() == "png"
        assert not (copy / "report.md").exists()
    with store.local_copy() as everything:
        assert (everything / "model.pt").read_text() == "weights"
    assert copy.exists() == store.local  # the run directory itself, or a temporary copy: gone


def test_the_local_dir_is_a_path_on_this_node_whose_files_can_be_made_the_stores(store):
    with claimed(store) as run_dir:
        local = run_dir.local_dir
        local.mkdir(parents=True, exist_ok=True)
        (local / "events.out.tfevents.1").write_bytes(b"tb")
        (local / "heartbeats").write_text("1")
        run_dir.upload_from(local, ("events.out.tfevents.*",))
        assert run_dir.read_bytes("events.out.tfevents.1") == b"tb"
    # After the run: a node-local stand-in is removed, a local run directory keeps its files.
    assert local.exists() == store.local
    assert store.exists("events.out.tfevents.1") and not store.exists(".lock")


def test_rays_files_land_in_the_store(store):
    import pyarrow.fs as pafs

    store.make_dir()
    options = store.ray_storage()
    # As Ray resolves them: a given file system takes the path as it is; else the path is a URI.
    fs, path = (
        (options["storage_filesystem"], options["storage_path"])
        if "storage_filesystem" in options
        else pafs.FileSystem.from_uri(options["storage_path"])
    )
    with fs.open_output_stream(f"{path}/snapshot.json") as out:
        out.write(b"{}")
    assert store.read_text("snapshot.json") == "{}"


def test_rank_0s_rows_and_the_stop_request_reach_the_driver(store):
    store.make_dir()
    writer, files = RunWriter(store, enabled=True), RunDir(store)
    writer.metrics(MetricsRow(epoch=0, step=1, loss=0.5))
    if store.appends_in_place:
        assert [row.step for row in files.metrics()] == [1]  # appended at once
    writer.flush()  # on an object store the rows were queued: written now
    assert [row.step for row in files.metrics()] == [1]
    assert not writer.stop_requested()
    files.request_stop()
    time.sleep(store.poll_s)  # an object store is looked at once a second at most
    assert writer.stop_requested()
    writer.close()


def test_check_creates_a_local_run_directory_and_says_so(store):
    if store.local:
        assert store.check() is True and store.path.is_dir() and store.check() is False
    else:
        assert store.check() is False


def test_a_lock_held_on_another_host_says_how_to_remove_it_whichever_the_kind(store):
    store.make_dir()
    store.write_text(".lock", json.dumps({"pid": 1, "host": "elsewhere", "since": time.time()}))
    with pytest.raises(RunLocked, match=r"on elsewhere .*leaves .*/\.lock: delete it"):
        RunLock(store).acquire()
    store.delete(".lock")
    here = RunLock(store)
    here.acquire()  # a live holder on this host: it is checked, and nothing is to be deleted by hand
    with pytest.raises(RunLocked, match=f"in use by process {os.getpid()}") as refused:
        RunLock(store).acquire()
    assert "delete it" not in str(refused.value)
    here.release()
