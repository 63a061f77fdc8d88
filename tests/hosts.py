"""Hosts on one machine, for tests of what a real cluster has and `ray.cluster_utils.Cluster`
hides: a network stack per host, with its own address, its own interface name and a hostname
that resolves to loopback.

`made_hosts(root, k)` makes K Linux network namespaces (`rth<id>-0`, `rth<id>-1`, …) joined by
a bridge that lives in a namespace of its own (`rth<id>-sw`: nothing is added to the machine's
own network, and its firewall never sees the traffic). Host i holds 10.77.0.(i+1)/24 on an
interface named after `INTERFACE_NAMES[i]` (`ens5` on the first, `eth1` on the second, …), and
its /etc/hosts, Debian's default, resolves the machine's hostname to 127.0.1.1
(`ip netns exec` bind-mounts /etc/netns/NAME/hosts over /etc/hosts). The hosts share the
machine's hostname and file system, as hosts cloned from one image share a hostname.

`Hosts.start_ray()` starts a Ray node on every host, `ray start --block` in a process group of its
own (the head on the first host), with token authentication and a token file of the test's own
(RAY_AUTH_TOKEN_PATH: never ~/.ray/auth_token), and its own --temp-dir. Nothing sets
GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME: the environment is the test process's without them
and without any RAY_ variable.

Leaving the block ends every process of every host (`ip netns pids`: whatever runs inside a
host's namespace, the nodes, their workers and a driver started there; SIGTERM, then SIGKILL)
and removes the namespaces, their interfaces, /etc/netns/NAME and the temp dirs — also when the
test failed. Where namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`),
`skip_reason()` says why and the tests skip.

Faults, on `Host`: `lose()` (every process of the host SIGKILLed, as a machine that died),
`freeze()`/`thaw()` (every process SIGSTOPped, then SIGCONTed), `cut()`/`heal()` (its link
down, then up: a partition), `flap(period_s, down_s)` (a link that goes down and up on a cycle)
and `slow(pid, duty)` (one process stopped and continued on a duty cycle). The kernel here has
no netem qdisc: no latency or loss emulation.

`Hosts.start_ray(supervised=True)` runs every host's node but the head's under a supervisor, as
systemd's `Restart=always` or a KubeRay pod would: when its `ray start --block` exits (Ray
ends the raylet of a node it declared dead, once that node can reach the head again), it is
started again, and the node rejoins as a new one. A lost host is not restarted (its
supervisor died with it) until `boot()`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Sequence

BIN = Path(sys.executable).parent  # the venv's bin: `ray` lives next to python
REPO = Path(__file__).resolve().parents[1]
NETNS_ETC = Path("/etc/netns")
OWNERS = Path("/run/raytrain-test-hosts")  # a file per set of hosts: the id of the process that made them
SUBNET = "10.77.0"  # a private test range; its addresses exist only inside the test's namespaces
INTERFACE_NAMES = ("ens5", "eth1", "enp0s8", "eth2")
GCS_PORT = 6379  # each host has its own port space
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@functools.cache
def skip_reason() -> str | None:
    """Why hosts cannot be made here (None: they can): checked by making and removing one."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2): cannot make network namespaces"
    if os.geteuid() != 0:
        return "not root: making network namespaces needs CAP_NET_ADMIN"
    probe = f"rth{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace (ip netns add: {made.stderr.strip()[:200]})"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One host: a network namespace with one interface on the test's bridge."""

    netns: str
    address: str
    interface: str
    env: dict[str, str]
    temp_dir: str  # the Ray node's --temp-dir
    log_path: Path  # its node's output, every start of it
    proc: subprocess.Popen | None = None  # `ray start --block`, leader of its process group
    log: IO[str] | None = field(default=None, repr=False)
    start_args: list[str] = field(default_factory=list)  # its `ray start` command, for restarts
    supervised: bool = False  # restarted when its node exits (`Hosts.start_ray(supervised=True)`)
    starts: list[float] = field(default_factory=list)  # time.time() of each `ray start`

    def command(self, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def run(self, args: Sequence[str], *, timeout: float, env: dict[str, str] | None = None, **kwargs):
        """`args` run on this host (in its namespace), its output captured."""
        return subprocess.run(
            self.command(args), env=env or self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def popen(self, args: Sequence[str], *, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`args` started on this host in a process group of its own, output to `log`."""
        out = open(log, "w")
        try:
            return subprocess.Popen(
                self.command(args), env=env or self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            out.close()  # the child holds its own copy

    def pids(self) -> list[int]:
        """Every process running on this host."""
        listed = _ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit() and int(pid) != os.getpid()]

    def log_text(self, chars: int = 3000) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def signal_all(self, sig: int) -> list[int]:
        """`sig` to every process of the host; returns their ids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return pids

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        if self.log is not None:
            self.log.close()

    # -- its node -------------------------------------------------------------------------------

    def start_node(self) -> None:
        """Its `ray start --block` (`start_args`) in a process group of its own, output appended
        to its log."""
        if self.log is None or self.log.closed:
            self.log = open(self.log_path, "a")
        self.log.write(f"\n--- ray start at {time.time():.3f}\n")
        self.log.flush()
        self.starts.append(time.time())
        args = self.command(self.start_args)
        out = {"stdout": self.log, "stderr": subprocess.STDOUT}
        self.proc = subprocess.Popen(args, env=self.env, start_new_session=True, **out)

    def wait_started(self, timeout_s: float) -> None:
        """Until its latest `ray start` says the node started."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None and not self.supervised:
                raise AssertionError(f"ray start on {self.netns} exited ({self.proc.returncode}): {self.log_text()}")
            if "Ray runtime started" in self.log_text(chars=100_000).rsplit("--- ray start at", 1)[-1]:
                return
            time.sleep(0.5)
        raise AssertionError(f"ray start on {self.netns} did not start within {timeout_s} s: {self.log_text()}")

    # -- faults -----------------------------------------------------------------------------------

    def lose(self) -> float:
        """The host dies: every process of it SIGKILLed (its supervisor with it: it stays down
        until `boot`). Returns the time of the fault."""
        self.supervised = False
        at = time.time()
        self.signal_all(signal.SIGKILL)
        return at

    def boot(self) -> float:
        """A lost host back: its node started again, and supervised. Returns when."""
        at = time.time()
        self.supervised = True
        self.start_node()
        return at

    def freeze(self) -> float:
        """Every process of the host stopped (SIGSTOP), as a host that hangs; returns when."""
        at = time.time()
        self.signal_all(signal.SIGSTOP)
        return at

    def thaw(self) -> float:
        at = time.time()
        self.signal_all(signal.SIGCONT)
        return at

    def cut(self) -> float:
        """Its link down: a partition from every other host. Returns when."""
        at = time.time()
        _ip("-n", self.netns, "link", "set", self.interface, "down")
        return at

    def heal(self) -> float:
        at = time.time()
        _ip("-n", self.netns, "link", "set", self.interface, "up")
        return at

    @contextlib.contextmanager
    def flap(self, period_s: float, down_s: float) -> Iterator[list[float]]:
        """While inside: the link down for `down_s` of every `period_s`, from the start; yields
        the times it went down. Up again on leaving."""
        stop = threading.Event()
        downs: list[float] = []

        def cycle() -> None:
            while not stop.is_set():
                downs.append(self.cut())
                stop.wait(down_s)
                self.heal()
                stop.wait(period_s - down_s)

        thread = threading.Thread(target=cycle, name=f"flap-{self.netns}", daemon=True)
        thread.start()
        try:
            yield downs
        finally:
            stop.set()
            thread.join(timeout=period_s + 5)
            self.heal()

    @contextlib.contextmanager
    def slow(self, pid: int, duty: float, period_s: float = 1.0) -> Iterator[None]:
        """While inside: process `pid` of this host runs only `duty` of every `period_s` (stopped
        the rest), as a worker on a slow or overloaded host. Continued on leaving."""
        stop = threading.Event()

        def cycle() -> None:
            while not stop.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                stop.wait(period_s * (1 - duty))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                stop.wait(period_s * duty)

        thread = threading.Thread(target=cycle, name=f"slow-{pid}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=period_s + 5)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class Hosts:
    """K hosts on a bridge (see the module's docstring); `made_hosts` makes and removes them."""

    def __init__(self, root: Path, k: int, *, hostname_to_loopback: bool = True):
        self.root = root
        self.id = secrets.token_hex(3)
        self.switch = f"rth{self.id}-sw"
        self.bridge = "br0"
        self.token_path = root / "auth_token"
        self.hostname_to_loopback = hostname_to_loopback
        self._ending = threading.Event()
        base = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith("RAY_") and key not in INTERFACE_VARIABLES
        }
        self.env = {
            **base,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        self.temp_root = tempfile.mkdtemp(prefix=f"rth{self.id}-", dir="/tmp")  # short: Unix socket paths
        self.hosts = [
            Host(
                netns=f"rth{self.id}-{i}",
                address=f"{SUBNET}.{i + 1}",
                interface=INTERFACE_NAMES[i % len(INTERFACE_NAMES)],
                env=self.env,
                temp_dir=os.path.join(self.temp_root, str(i)),
                log_path=root / f"ray-{self.id}-{i}.log",
            )
            for i in range(k)
        ]

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    @property
    def head_address(self) -> str:
        return f"{self.hosts[0].address}:{GCS_PORT}"

    def make(self) -> None:
        """The namespaces, the bridge, one veth pair per host; each host's /etc/hosts. Its
        owner file first, so that hosts whose test died before removing them are swept."""
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.id).write_text(str(os.getpid()))
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.netns)
            # Made inside the host's namespace, its peer inside the switch's: the machine's own
            # network never holds either end, even for a moment.
            outer = f"port{i}"
            veth = ["link", "add", host.interface, "type", "veth", "peer", "name", outer, "netns", self.switch]
            _ip("-n", host.netns, *veth)
            _ip("-n", self.switch, "link", "set", outer, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", host.interface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            if self.hostname_to_loopback:
                etc = NETNS_ETC / host.netns
                etc.mkdir(parents=True, exist_ok=True)
                hostname = socket.gethostname()
                (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n")

    def start_ray(
        self, *, num_cpus: int = 1, ready_timeout_s: float = 90.0, supervised: bool = False, system_config=None
    ) -> None:
        """A Ray node on every host, the head on the first; returns once each says it started.
        `supervised`: every other host's node is started again whenever it exits (see the
        module's docstring). `system_config`: the head's `--system-config` (Ray's health checks)."""
        for i, host in enumerate(self.hosts):
            role = (
                ["--head", f"--port={GCS_PORT}", "--dashboard-host=127.0.0.1", "--include-dashboard=true"]
                if i == 0
                else [f"--address={self.head_address}"]
            )
            if i == 0 and system_config:
                role.append(f"--system-config={json.dumps(system_config)}")
            host.start_args = [
                str(BIN / "ray"),
                "start",
                "--block",
                *role,
                f"--node-ip-address={host.address}",
                f"--num-cpus={num_cpus}",
                "--num-gpus=0",
                f"--temp-dir={host.temp_dir}",
                "--disable-usage-stats",
            ]
            host.supervised = supervised and i > 0
            host.start_node()
            host.wait_started(ready_timeout_s)
        if supervised:
            self._supervisor = threading.Thread(target=self._supervise, name="hosts-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self, restart_after_s: float = 1.0) -> None:
        """`Restart=always` for every supervised host's node, until the hosts are removed."""
        while not self._ending.wait(0.5):
            for host in self.hosts:
                if host.supervised and host.proc is not None and host.proc.poll() is not None:
                    if self._ending.wait(restart_after_s) or not host.supervised:
                        return
                    host.start_node()

    def end_processes(self, grace_s: float = 5.0) -> dict[str, list[int]]:
        """SIGTERM to every process of every host, SIGKILL to what is left after `grace_s`;
        returns what survived even that, by host (a test's hosts hold nothing worth a drain)."""
        self._ending.set()
        for host in self.hosts:
            host.supervised = False
            host.signal_all(signal.SIGCONT)  # a frozen host ends too
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for host in self.hosts:
                host.signal_all(sig)
            deadline = time.monotonic() + wait_s
            while any(host.pids() for host in self.hosts) and time.monotonic() < deadline:
                time.sleep(0.2)
        for host in self.hosts:
            host.close()
        return {host.netns: host.pids() for host in self.hosts if host.pids()}

    def remove(self) -> list[str]:
        """End every process of every host, then remove what `make` made; returns what is left."""
        left = [f"{netns}: processes {pids}" for netns, pids in self.end_processes().items()]
        for netns in [host.netns for host in self.hosts] + [self.switch]:
            _ip("netns", "del", netns, check=False)  # its interfaces go with it
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only if no one else keeps a namespace's files there
        if self.temp_root:
            shutil.rmtree(self.temp_root, ignore_errors=True)
        listed = _ip("netns", "list", check=False).stdout
        left += [line.split()[0] for line in listed.splitlines() if line.startswith(f"rth{self.id}-")]
        if not left:
            (OWNERS / self.id).unlink(missing_ok=True)
        return left


def sweep_left_behind() -> list[str]:
    """Remove the hosts of tests that died without removing theirs (killed by SIGKILL or
    SIGTERM, where no `finally` runs): those whose owner process is gone. Returns their ids."""
    swept = []
    for owner in OWNERS.glob("*") if OWNERS.is_dir() else []:
        with contextlib.suppress(ValueError, OSError):
            pid = int(owner.read_text())
            if pid == os.getpid() or Path(f"/proc/{pid}").exists():
                continue
        hosts = Hosts.__new__(Hosts)  # only what `remove` needs: the names and the temp dirs
        listed = _ip("netns", "list", check=False).stdout.split()
        names = sorted({name for name in listed if name.startswith(f"rth{owner.name}-")})
        hosts.id, hosts._ending = owner.name, threading.Event()
        hosts.switch = f"rth{owner.name}-sw"
        hosts.temp_root = ""
        hosts.hosts = [
            Host(netns=name, address="", interface="", env={}, temp_dir="", log_path=Path(os.devnull))
            for name in names
            if name != hosts.switch
        ]
        for temp in Path("/tmp").glob(f"rth{owner.name}-*"):
            shutil.rmtree(temp, ignore_errors=True)
        if not hosts.remove():
            swept.append(owner.name)
    return swept


@contextlib.contextmanager
def made_hosts(root: Path, k: int = 2, **kwargs) -> Iterator[Hosts]:
    """K hosts made (not started: `Hosts.start_ray`); every process of them ended and they are
    removed on leaving, also on a failure. The exit fails if anything of them is left."""
    sweep_left_behind()
    hosts = Hosts(root, k, **kwargs)
    try:
        hosts.make()
        yield hosts
    finally:
        left = hosts.remove()
        assert not left, f"left behind by the test's hosts: {left}"
