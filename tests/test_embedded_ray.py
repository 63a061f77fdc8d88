"""Fresh `raytrain` processes with their own embedded Ray: the README's "bring your own pipeline"
example works as written, and the embedded Ray answers no unauthenticated HTTP on the machine's
network address."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
RAYTRAIN = str(Path(sys.executable).with_name("raytrain"))


def test_the_readmes_own_pipeline_example_runs_as_written(tmp_path):
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Bring your own pipeline") :]
    code = re.search(r"```python\n# my_project/train.py\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(raytrain train my_project\.train:Regression[^\n#]*)", section).group(1).split()
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "__init__.py").write_text("")
    (tmp_path / "my_project" / "train.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user has it: nothing on the path
    done = subprocess.run(
        [RAYTRAIN, *command[1:], "--storage", str(tmp_path / "runs"), "--name", "readme", "--progress", "off"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "readme" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["samples_seen"] == 3 * 10_000
    assert "global 256 = 4 workers × 64 per worker" in done.stdout


PROBE = textwrap.dedent("""
    import json, os, socket, urllib.request
    import psutil
    from raytrain.config import TrainConfig
    from raytrain.driver.session import METRICS_PORT_VARIABLES, ray_session
    import ray

    started_only = [*METRICS_PORT_VARIABLES, "RAY_worker_niceness"]
    before = {name: os.environ.get(name) for name in started_only}
    with ray_session(TrainConfig(workers=1)):
        ip = ray.util.get_node_ip_address()
        mine = {p.pid for p in psutil.Process().children(recursive=True)} | {psutil.Process().pid}
        listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        ports = sorted({c.laddr.port for c in listening if c.pid in mine})
        answered = {}
        for port in ports:
            try:
                answered[port] = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=3).status
            except Exception as exc:
                answered[port] = type(exc).__name__
    after = {name: os.environ.get(name) for name in started_only}
    print(json.dumps({"ip": ip, "answered": answered, "env_kept": before == after}))
""")


def test_the_embedded_ray_serves_no_metrics_to_the_network(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    open_ports = [port for port, status in found["answered"].items() if status == 200]
    assert found["answered"] and not open_ports, found  # Ray's own /metrics exporters are off
    # What only the started Ray's processes read leaves the driver as it was: a process the
    # driver starts later (a cluster of its own, a job) does not inherit a stale port.
    assert found["env_kept"], found
