"""`ray job submit --working-dir . -- raytrain train ...` against a real Ray head (issue 7).

The test starts a head of its own (tests/ray_head.py): `ray start --head --block` on
127.0.0.1 with free ports, its own --temp-dir (so /tmp/ray/ray_current_cluster of other tests
is never touched), token auth with a token file of its own (RAY_AUTH_TOKEN_PATH, never
~/.ray/auth_token), in its own process group. It submits a short digits job with the Jobs
CLI, follows its logs, checks the status and the run files, then stops only that head: never
`ray stop`, which kills every Ray process on the machine (RAY_NOTES, "Jobs and clusters").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest
from ray_head import running_head

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the head's processes through /proc"),
]


@pytest.fixture
def ray_head(tmp_path):
    with running_head(tmp_path) as head:
        yield head


def test_job_submit_trains_digits(ray_head, tmp_path):
    head = ray_head
    # Token auth is on: the Jobs API refuses a request without the token.
    assert head.get("/api/jobs/", token=None)[0] in (401, 403)

    work = tmp_path / "work"  # the uploaded --working-dir: small
    work.mkdir()
    (work / "note.txt").write_text("uploaded with the job\n")
    storage = tmp_path / "storage"
    job_id = f"raytrain-jobtest-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    submit = [
        "job",
        "submit",
        "--address",
        head.dashboard,
        "--working-dir",
        str(work),
        "--submission-id",
        job_id,
        "--no-wait",
        "--",
        "raytrain",
        "train",
        "digits",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--storage",
        str(storage),
        "--name",
        "jobtest",
    ]
    # The Jobs API answers before the head's job agent is up; on a loaded host the first
    # submissions can be dropped ("Remote end closed connection"): try again, once per id.
    deadline = time.monotonic() + 90
    while True:
        submitted = head.ray(*submit, timeout=90)
        if submitted.returncode == 0 or head.get(f"/api/jobs/{job_id}", head.token)[0] == 200:
            break
        assert time.monotonic() < deadline, submitted.stdout + submitted.stderr
        time.sleep(3)

    # `ray job logs --follow` returns when the job ends. (~60 s on an idle 2-core machine;
    # the limit leaves room for a loaded CI host.)
    try:
        followed = head.ray("job", "logs", "--address", head.dashboard, "--follow", job_id, timeout=300)
    except subprocess.TimeoutExpired as exc:
        code, body = head.get(f"/api/jobs/{job_id}", head.token)
        pytest.fail(
            f"job {job_id} still running after {exc.timeout} s: {code} {body[:500]!r}\n{(exc.stdout or b'')[-3000:]!r}"
        )
    logs = followed.stdout
    code, body = head.get(f"/api/jobs/{job_id}", head.token)
    info = json.loads(body or b"{}")
    print(f"job {job_id}: {info.get('status')} after {time.monotonic() - started:.1f} s")
    assert code == 200 and info.get("status") == "SUCCEEDED", (
        f"{code} {info}\n--- job logs ---\n{logs[-4000:]}\n{followed.stderr[-2000:]}"
    )
    assert f"Job '{job_id}' succeeded" in followed.stdout + followed.stderr
    assert "raytrain: jobtest" in logs, logs[-4000:]
    assert "epoch 2/2" in logs, logs[-4000:]

    run_dir = storage / "jobtest"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["epochs"] == 2
    assert summary["world_sizes"] == [2]
    assert summary["model_path"] == str(run_dir / "model.pt")
    assert (run_dir / "model.pt").is_file()
