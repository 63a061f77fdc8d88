"""A real S3 endpoint on loopback for the tests: moto's `moto_server` (the `test` extra
installs moto[server]), started once per session at a free port on 127.0.0.1, checking
signatures (auth mode: a user with full S3 access, whose keys every test passes), and stopped
by its process id.

`pause()` / `resume()` freeze and thaw the server (SIGSTOP/SIGCONT): an outage that keeps
every object, as a store that stops answering for a while does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import quote

# moto lets this many requests through unchecked, for the IAM calls that make the test user.
UNCHECKED_SETUP_CALLS = 3


def moto_server_binary() -> str | None:
    """RAYTRAIN_TEST_MOTO_SERVER, else the one installed beside this Python, else on PATH."""
    given = os.environ.get("RAYTRAIN_TEST_MOTO_SERVER")
    if given:
        return given
    beside = Path(sys.executable).with_name("moto_server")
    return str(beside) if beside.exists() else shutil.which("moto_server")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MotoServer:
    def __init__(self, binary: str, log: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(UNCHECKED_SETUP_CALLS)}
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [binary, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._wait_ready()
        self.key, self.secret = self._make_user()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with status {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=1) as answer:
                    answer.read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"moto_server not ready in {timeout_s:.0f} s") from None
                time.sleep(0.1)

    def _make_user(self) -> tuple[str, str]:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
            region_name="us-east-1",
        )
        iam.create_user(UserName="trainer")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"rt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def uri(self, bucket: str, prefix: str = "", *, key: str | None = None, secret: str | None = None) -> str:
        """`s3://KEY:SECRET@bucket/prefix?endpoint_override=…&scheme=http` (keys always given)."""
        auth = f"{quote(key or self.key, safe='')}:{quote(secret or self.secret, safe='')}@"
        return f"s3://{auth}{bucket}/{prefix}?endpoint_override=127.0.0.1:{self.port}&scheme=http".replace("/?", "?")

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix`: key -> size."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {item["Key"]: item["Size"] for page in pages for item in page.get("Contents", [])}

    def read(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
