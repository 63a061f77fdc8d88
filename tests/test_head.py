"""The record of `raytrain up`'s head and what a command does with it: join a live one of the
same user and versions, clear a stale one, refuse another user's or another version's."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import threading

import pytest

from raytrain.cli import main
from raytrain.driver import head
from raytrain.errors import UsageError
from raytrain.rules.head import (
    JOIN,
    REFUSE,
    STALE,
    TEMP_DIR_PROOF,
    address_form_problem,
    head_verdict,
    join_failure,
    record_file_problem,
    record_problem,
    same_python,
)

RAY = head.ray_version()
MARKER = "0123456789abcdef0123456789abcdef"
PY = platform.python_version()


def record(**changes):
    base = {
        "address": "10.0.0.5:6379",
        "pid": 4242,
        "ray_version": RAY,
        "python_version": PY,
        "uid": os.getuid(),
        "user": "me",
        "marker": MARKER,
        "temp_dir": "/tmp/rthead-x",
    }
    return {**base, **changes}


def judge(rec, alive=True, process_uid=None, uid=None):
    return head_verdict(
        rec,
        alive=alive,
        uid=os.getuid() if uid is None else uid,
        process_uid=process_uid,
        ray_version=RAY,
        python_version=PY,
        where="~/.raytrain/head.json",
    )


def test_a_live_head_of_the_same_user_and_versions_is_joined_and_the_line_says_so():
    verdict = judge(record())
    assert verdict.kind == JOIN
    assert verdict.reason.startswith("raytrain: joining the local Ray head at 10.0.0.5:6379")
    assert "raytrain down" in verdict.reason


def test_a_gone_head_is_stale():
    verdict = judge(record(), alive=False)
    assert verdict.kind == STALE
    assert "is gone" in verdict.reason and "record cleared" in verdict.reason


def test_another_users_head_is_refused_by_its_record_or_by_its_processes_even_when_gone():
    for verdict in (
        judge(record(uid=os.getuid() + 1, user="alice")),
        judge(record(), process_uid=os.getuid() + 1),
        judge(record(uid=os.getuid() + 1, user="alice"), alive=False),
    ):
        assert verdict.kind == REFUSE
        assert "not to you" in verdict.reason and "--address 10.0.0.5:6379" in verdict.reason


def test_another_ray_or_python_version_is_refused_with_the_fix_but_a_python_patch_release_is_not():
    for rec in (record(ray_version="2.59.0"), record(python_version="3.10.12")):
        verdict = judge(rec)
        assert verdict.kind == REFUSE
        assert "raytrain down && raytrain up" in verdict.reason
    major, minor, _ = PY.split(".")
    assert judge(record(python_version=f"{major}.{minor}.999")).kind == JOIN
    assert same_python("3.11.7", "3.11.2") and not same_python("3.11.7", "3.12.7")


def test_a_file_that_is_not_a_record_is_named_with_the_fix(tmp_path):
    assert record_problem(record()) is None
    assert record_problem([1]) == "it is not a JSON object"
    assert record_problem({"address": "x"}).startswith("it lacks pid, ray_version")
    path = tmp_path / "head.json"
    assert head.read_record(path) is None
    path.write_text("{not json")
    with pytest.raises(UsageError, match="remove it, then `raytrain up`"):
        head.read_record(path)
    path.write_text('{"address": "x"}')
    with pytest.raises(UsageError, match="is not a raytrain head record"):
        head.read_record(path)


def test_the_record_is_private_to_its_user(tmp_path):
    path = tmp_path / "dir" / "head.json"
    head.write_record(path, record())
    assert head.read_record(path) == record()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


class FakeGcs:
    """A loopback server that answers an HTTP/2 preface with a SETTINGS frame, as a GCS does."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with connection:
                connection.recv(64)
                connection.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")

    def close(self):
        self.server.close()


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A record in tmp_path (RAYTRAIN_HEAD_FILE) of a 'head' whose GCS answers and whose raylet
    and leader are this process; RAY_ADDRESS unset."""
    path = tmp_path / "head.json"
    monkeypatch.setenv(head.HEAD_FILE_ENV, str(path))
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):  # unset, and unset again after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    gcs = FakeGcs()
    me = head.create_time(os.getpid())
    temp_dir = tmp_path / "rthead-x"
    temp_dir.mkdir()
    (temp_dir / TEMP_DIR_PROOF).write_text(MARKER + "\n")
    rec = record(
        address=gcs.address,
        pid=os.getpid(),
        pids={"raylet": os.getpid()},
        created={"pid": me, "raylet": me},
        temp_dir=str(temp_dir),
        auth_mode="token",
    )
    head.write_record(path, rec)
    yield path, rec
    gcs.close()


def test_a_live_head_is_joined_through_ray_address_and_a_given_address_wins(recorded):
    path, rec = recorded
    lines = []
    assert head.join_recorded_head("10.0.0.9:6379", lines.append) is None and not lines
    assert head.join_recorded_head(None, lines.append) == rec
    assert lines == [
        f"raytrain: joining the local Ray head at {rec['address']} "
        f"(started by `raytrain up`, pid {os.getpid()}, Ray {RAY}); `raytrain down` stops it"
    ]
    assert os.environ["RAY_ADDRESS"] == rec["address"] and os.environ["RAY_AUTH_MODE"] == "token"


def test_a_stale_record_is_cleared_and_said(recorded, tmp_path):
    path, rec = recorded
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    head.write_record(path, {**rec, "address": "127.0.0.1:1", "pid": dead, "pids": {"raylet": dead}})
    lines = []
    assert head.join_recorded_head(None, lines.append) is None
    assert not path.exists() and not os.path.exists(rec["temp_dir"])  # the proven temp dir goes with it
    assert len(lines) == 1 and "is gone; record cleared, this run starts its own Ray" in lines[0]
    assert "RAY_ADDRESS" not in os.environ


@pytest.mark.parametrize(
    "changes, words", [({"ray_version": "2.59.0"}, "Ray 2.59.0"), ({"uid": os.getuid() + 1}, "not to you")]
)
def test_train_refuses_a_head_of_another_version_or_user_with_exit_2_before_anything_starts(
    recorded, tmp_path, capsys, changes, words
):
    path, rec = recorded
    head.write_record(path, {**rec, **changes})
    status = main(["train", "digits", "--workers", "1", "--storage", str(tmp_path / "runs")])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("raytrain train: ") and words in err
    assert path.exists() and not (tmp_path / "runs").exists()
    assert "RAY_ADDRESS" not in os.environ


def test_down_without_a_record_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(head.HEAD_FILE_ENV, str(tmp_path / "head.json"))
    assert main(["down"]) == 0
    assert "no local Ray head is recorded" in capsys.readouterr().out


def test_a_named_token_file_that_is_missing_is_the_users_to_fix_not_a_traceback(tmp_path):
    missing = tmp_path / "token"
    with pytest.raises(UsageError, match=f"RAY_AUTH_TOKEN_PATH names {missing}, which does not exist"):
        head.ensure_token({"RAY_AUTH_TOKEN_PATH": str(missing)})
    missing.write_text("0" * 64)
    head.ensure_token({"RAY_AUTH_TOKEN_PATH": str(missing)})  # there: nothing to do, nothing run


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"temp_dir": ""}, "its temp_dir '' is not one `raytrain up` makes"),
        ({"temp_dir": "/home/me/data"}, "named rthead-*"),
        ({"temp_dir": "relative/rthead-x"}, "an absolute path"),
        ({"temp_dir": "/tmp/rthead-x/../data"}, "an absolute path"),
        ({"temp_dir": "/tmp/rthead-"}, "named rthead-*"),
        ({"marker": ""}, "its marker '' is not one"),
        ({"marker": "m"}, "32 hex digits"),
        ({"pid": 1}, "its pid 1 is not a process"),
        ({"pid": "4242"}, "its pid '4242'"),
        ({"uid": None}, "its uid None"),
    ],
)
def test_a_record_naming_what_up_never_writes_is_not_a_record(tmp_path, changes, words):
    """What `down` would end and delete must be shaped as `up` makes it: an empty temp_dir would
    match every process's command line, a user's directory would be deleted."""
    assert words in record_problem(record(**changes))
    path = tmp_path / "head.json"
    head.write_record(path, record(**changes))
    with pytest.raises(UsageError, match="is not a raytrain head record .*remove it, then `raytrain up`"):
        head.read_record(path)


def test_a_record_another_user_wrote_or_could_replace_is_not_acted_on(tmp_path):
    me = os.getuid()
    assert record_file_problem(file_uid=me, file_mode=0o100600, dir_mode=0o40700, uid=me) is None
    assert record_file_problem(file_uid=me, file_mode=0o100644, dir_mode=0o41777, uid=me) is None  # /tmp: sticky
    assert "owned by uid 7" in record_file_problem(file_uid=7, file_mode=0o100600, dir_mode=0o40700, uid=me)
    assert "mode 0666" in record_file_problem(file_uid=me, file_mode=0o100666, dir_mode=0o40700, uid=me)
    assert "folder has mode 0777" in record_file_problem(file_uid=me, file_mode=0o100600, dir_mode=0o40777, uid=me)
    folder = tmp_path / "open"
    path = folder / "head.json"
    head.write_record(path, record())
    path.chmod(0o666)
    with pytest.raises(UsageError, match=r"is not acted on: others can write it \(mode 0666\).*chmod 600"):
        head.read_record(path)
    path.chmod(0o600)
    folder.chmod(0o777)
    with pytest.raises(UsageError, match="anyone can replace it"):
        head.read_record(path)


def test_a_record_under_a_file_names_the_variable_not_a_file_to_remove(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "plain"
    blocker.write_text("x")
    monkeypatch.setenv(head.HEAD_FILE_ENV, str(blocker / "head.json"))
    assert main(["down"]) == 2
    err = capsys.readouterr().err
    assert f"{blocker} is a file, not a folder: point RAYTRAIN_HEAD_FILE at a path in a folder" in err
    assert "remove it" not in err and blocker.read_text() == "x"


@pytest.fixture
def bystander():
    """An unrelated process that leads a session of its own, as a reused pid would."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize("command", ["down", "train"])
def test_a_record_whose_pid_and_temp_dir_are_not_the_heads_ends_nothing_and_deletes_nothing(
    recorded, tmp_path, bystander, monkeypatch, capsys, command
):
    """A stale record whose pid now names an unrelated process (a reused pid) and whose temp dir
    is a user's directory shaped like one `up` makes but without the head's proof file: `down`
    and a `train` that clears the record end no process and delete no file."""
    path, rec = recorded
    users = tmp_path / "rthead-mine"
    users.mkdir()
    (users / "precious.txt").write_text("keep me")
    stale = {
        **rec,
        "address": "127.0.0.1:1",  # nothing answers: a gone head
        "pid": bystander.pid,
        "pids": {"raylet": bystander.pid},
        "created": {"pid": head.create_time(bystander.pid) - 100.0, "raylet": 0.0},  # not that process
        "started_at": 0.0,
        "temp_dir": str(users),
    }
    head.write_record(path, stale)
    assert head.head_processes(stale) == []
    if command == "down":
        assert main(["down"]) == 0
        said = capsys.readouterr().out
        assert "was already gone; record cleared" in said
    else:
        lines = []
        assert head.join_recorded_head(None, lines.append) is None
        said = lines[0]
        assert "is gone; record cleared, this run starts its own Ray" in said
    assert f"({users} left in place: it is not provably the head's temp dir)" in said
    assert bystander.poll() is None, "an unrelated process was ended"
    assert (users / "precious.txt").read_text() == "keep me"
    assert not path.exists()


def test_up_refused_before_the_start_leaves_no_temp_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(head.HEAD_FILE_ENV, str(tmp_path / "head.json"))
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing-token"))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    before = set(os.listdir("/tmp"))
    with pytest.raises(UsageError, match="RAY_AUTH_TOKEN_PATH names"):
        head.start_head(2, lambda line: None)
    assert not [name for name in set(os.listdir("/tmp")) - before if name.startswith("rthead-")]


def test_a_start_that_timed_out_says_load_is_the_likely_cause_and_a_retry_helps():
    assert "run `raytrain up` again" in head._load_hint("... node timed out during startup ...")
    assert head._load_hint("some other failure") == ""


# -- what an --address names, and why joining it failed ----------------------------------------


@pytest.mark.parametrize(
    "address, what, fix",
    [
        ("garbage", "it is not an address Ray joins: it has no :PORT", "give the head's GCS address HOST:PORT"),
        ("127.0.0.1:", "it has no port after the colon", "e.g. 127.0.0.1:6379"),
        ("ray://10.0.0.5:", "it has no port after the colon", "e.g. ray://10.0.0.5:10001"),
        ("127.0.0.1:99999", "its port 99999 is out of range: a port is a number from 1 to 65535", "6379"),
        ("127.0.0.1:0", "its port 0 is out of range", "6379"),
        ("head:abc", "its port 'abc' is not a number", "HOST:PORT"),
        (":6379", "it has no host before the port", "HOST:PORT"),
        ("fd00::5:6379", "an IPv6 host needs brackets", "[fd00::5]:6379"),
        ("http://127.0.0.1:8265", "the dashboard/Jobs API URL", "ray job submit"),
    ],
)
def test_an_address_of_the_wrong_form_is_named_by_what_is_wrong(address, what, fix):
    said, fixed = address_form_problem(address)
    assert what in said
    assert fix in fixed and "token" not in said + fixed


@pytest.mark.parametrize(
    "address", ["auto", "local", "10.0.0.5:6379", "head.example:6379", "[fd00::5]:6379", "ray://10.0.0.5:10001"]
)
def test_an_address_ray_can_try_passes_its_form(address):
    assert address_form_problem(address) is None


SENDS = "the token in /home/u/.ray/auth_token (last changed 2026-12-06 06:00:00)"


@pytest.mark.parametrize(
    "address, error, answers, what, fix",
    [
        (
            "auto",
            "ConnectionError: Could not find any running Ray instance. Please specify the one to connect to",
            False,
            "no Ray runs on this machine for `auto` to find",
            "start one here (`raytrain up`, or `ray start --head`)",
        ),
        (
            "auto",
            "ConnectionError: Failed to connect to Ray cluster at 10.0.0.9:6379",
            False,
            "nothing answers at 10.0.0.9:6379, where `auto` found the Ray last started on this machine: it has stopped",
            "start the head there",
        ),
        (
            "garbage",
            "ValueError: Invalid address format: garbage",
            False,
            "it is not an address Ray joins",
            "HOST:PORT",
        ),
        ("127.0.0.1:", "ValueError: Unable to parse port number from ", False, "it has no port after the colon", ""),
        (
            "ray://127.0.0.1:10001",
            "ConnectionError: ray client connection timeout",
            False,
            "nothing answers at 127.0.0.1:10001",
            "",
        ),
        (
            "10.0.0.5:6379",
            "ConnectionError: Failed to connect to Ray cluster at 10.0.0.5:6379\n"
            "RuntimeError: Version mismatch: The cluster was started with:\n    Ray: 2.59.0\n    Python: 3.11.7\n"
            "This process on node 10.0.0.7 was started with:\n    Ray: 2.60.0\n    Python: 3.11.7\n",
            True,
            "the cluster runs another Ray or Python than this process (Version mismatch: The cluster was started with: "
            "Ray: 2.59.0 Python: 3.11.7 This process on node 10.0.0.7 was started with: Ray: 2.60.0 Python: 3.11.7)",
            "the cluster's Ray and Python versions",
        ),
    ],
)
def test_a_failed_join_says_what_went_wrong_and_no_token_unless_a_head_answered(address, error, answers, what, fix):
    said, fixed = join_failure(address, error, answers=answers, sends=SENDS)
    assert said.startswith(what)
    assert fix in fixed
    assert SENDS not in fixed and "InvalidAuthToken" not in fixed


def test_a_head_that_answered_and_refused_the_join_names_the_token_this_process_sends():
    error = "ConnectionError: Failed to connect to Ray cluster at 10.0.0.5:6379\nConnectionError: Could not read 'x'"
    said, fixed = join_failure("10.0.0.5:6379", error, answers=True, sends=SENDS)
    assert said == "a Ray server answers at 10.0.0.5:6379, but it did not take this process"
    assert fixed.startswith("most likely it refused this process's token (Ray logs InvalidAuthToken): ")
    assert f"this process sends {SENDS}. Export RAY_AUTH_MODE=token" in fixed


def test_a_join_that_failed_where_nothing_answers_now_is_said_so_from_the_exceptions_chain():
    from raytrain.driver.session import join_problem

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    try:
        try:
            raise ConnectionError("Could not read 'session_name' from GCS. Did GCS start successfully?")
        except ConnectionError as inner:
            raise ConnectionError(f"Failed to connect to Ray cluster at {address}") from inner
    except ConnectionError as exc:
        said, fixed = join_problem(address, exc)
    assert said == f"nothing answers at {address}" and "token" not in fixed
