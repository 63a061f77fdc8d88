"""Whether a run joins the local Ray head `raytrain up` recorded, clears its record, or refuses;
what an --address names, and why joining it failed.

A command without --address (and without RAY_ADDRESS) reads the record (`raytrain.driver.head`)
and asks `head_verdict`:

- another user's head (by the record, or by the uid of its processes) is never joined:
  refused (exit 2), whatever its state — its processes are not ours to judge or stop;
- a head that is gone (its GCS does not answer, or its raylet is not the process recorded) is
  stale: the record is cleared, the run says so and starts its own embedded Ray;
- a head of another Ray version or another Python (major.minor) cannot take this driver (Ray
  refuses mixed versions): refused (exit 2) with the fix, `raytrain down` then `raytrain up`;
- otherwise the run joins it, and its first line says so.

Refusing rather than falling back to an embedded Ray keeps the choice visible: a user who ran
`raytrain up` expects runs to use that head; a silent fallback would pay the full start again
and hide why.

An --address (or RAY_ADDRESS) is judged by its text first (`address_form_problem`: its form,
its port's range), then the driver asks whether anything answers there, and a ray.init that
failed is explained from Ray's words and whether a head answers (`join_failure`): the token is
named only when a head answered and refused this process.

A head started without raytrain's health-check settings (Ray's defaults: a bare `ray start
--head`, a KubeRay head with default rayStartParams) declares a silent node dead only a minute
after it goes silent: `seconds_to_declare_dead` says when, `slow_death_note` what
`raytrain doctor` and a run joining it say.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# What a local Ray offers Tune's trial drivers, embedded or started by `raytrain up`: units of
# `trial_driver`, far more than trials can run at once (the limit is max_concurrent_trials,
# sized from CPUs/GPUs).
TRIAL_DRIVER_RESOURCE = "trial_driver"
EMBEDDED_TRIAL_DRIVER_SLOTS = 1000

JOIN, STALE, REFUSE = "join", "stale", "refuse"

# The record's fields a verdict and the commands need; a record without them is not ours.
RECORD_FIELDS = ("address", "pid", "ray_version", "python_version", "uid", "user", "marker", "temp_dir")


@dataclass(frozen=True)
class HeadVerdict:
    kind: Literal["join", "stale", "refuse"]
    reason: str  # one sentence: why (for stale and refuse), or what is joined


# `up` makes the head's temp dir as /tmp/rthead-XXXXXXXX and writes this file in it, holding the
# record's marker: the proof, read before anything is deleted, that the directory is the head's.
TEMP_DIR_PREFIX = "rthead-"
TEMP_DIR_PROOF = ".raytrain-head"


def record_problem(record: Any) -> str | None:
    """Why `record` (the parsed file) is not a head record; None when it is one.

    Beyond the fields, what `down` and a stale record's clearing act on must be what `up`
    writes: a pid above 1, a marker of 32 hex digits (a uuid: an empty one would match every
    process), a temp dir that is an absolute path named rthead-* (never '' or a user's
    directory)."""
    if not isinstance(record, dict):
        return "it is not a JSON object"
    missing = [name for name in RECORD_FIELDS if name not in record]
    if missing:
        return f"it lacks {', '.join(missing)}"
    pid, marker, temp_dir = record["pid"], record["marker"], record["temp_dir"]
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return f"its pid {pid!r} is not a process `raytrain up` started"
    if not isinstance(record["uid"], int) or isinstance(record["uid"], bool):
        return f"its uid {record['uid']!r} is not a user id"
    if not isinstance(marker, str) or not re.fullmatch(r"[0-9a-f]{32}", marker):
        return f"its marker {marker!r} is not one `raytrain up` writes (32 hex digits)"
    if not temp_dir_shape_ok(temp_dir):
        return f"its temp_dir {temp_dir!r} is not one `raytrain up` makes (an absolute path named {TEMP_DIR_PREFIX}*)"
    return None


def temp_dir_shape_ok(temp_dir: Any) -> bool:
    """`temp_dir` is shaped as `up` makes it: absolute, normalized, its last part rthead-*."""
    return (
        isinstance(temp_dir, str)
        and os.path.isabs(temp_dir)
        and os.path.normpath(temp_dir) == temp_dir
        and os.path.basename(temp_dir).startswith(TEMP_DIR_PREFIX)
        and len(os.path.basename(temp_dir)) > len(TEMP_DIR_PREFIX)
    )


def same_python(a: str, b: str) -> bool:
    """Ray needs the same Python major.minor on the driver and the cluster."""
    return a.split(".")[:2] == b.split(".")[:2]


def head_verdict(
    record: dict[str, Any],
    *,
    alive: bool,
    uid: int,
    process_uid: int | None,
    ray_version: str,
    python_version: str,
    where: str,
) -> HeadVerdict:
    """The verdict on `record` for this process (`uid`, `ray_version`, `python_version`).

    `alive`: the head's GCS answers at the recorded address and its recorded raylet runs.
    `process_uid`: the uid of the head's leading process, None when it is gone. `where`: the
    record's path, for the messages."""
    owner = process_uid if process_uid is not None else record["uid"]
    if record["uid"] != uid or owner != uid:
        return HeadVerdict(
            REFUSE,
            f"the local Ray head recorded in {where} belongs to user {record['user']!r} (uid {owner}), not to you "
            f"(uid {uid}); raytrain joins only a head of your own: give --address {record['address']} to join it "
            f"on purpose, or point RAYTRAIN_HEAD_FILE at a record of your own (`raytrain up` writes one)",
        )
    if not alive:
        return HeadVerdict(
            STALE,
            f"the local Ray head recorded in {where} (pid {record['pid']}, {record['address']}) is gone; "
            "record cleared, this run starts its own Ray",
        )
    if record["ray_version"] != ray_version or not same_python(record["python_version"], python_version):
        return HeadVerdict(
            REFUSE,
            f"the local Ray head at {record['address']} runs Ray {record['ray_version']} on Python "
            f"{record['python_version']}, this raytrain has Ray {ray_version} on Python {python_version}, and Ray "
            "cannot join across versions; restart it from this environment with `raytrain down && raytrain up` "
            "(or give --address to use another Ray)",
        )
    return HeadVerdict(
        JOIN,
        f"raytrain: joining the local Ray head at {record['address']} (started by `raytrain up`, pid "
        f"{record['pid']}, Ray {record['ray_version']}); `raytrain down` stops it",
    )


def record_file_problem(*, file_uid: int, file_mode: int, dir_mode: int, uid: int) -> str | None:
    """Why a record file with this owner and mode (and its folder's mode) cannot be trusted by
    user `uid`; None when it can. A record names processes to end and a directory to delete:
    one that another user wrote, or could have replaced, is not acted on."""
    if file_uid != uid:
        return f"it is owned by uid {file_uid}, not by you (uid {uid})"
    if file_mode & 0o022:
        return f"others can write it (mode {file_mode & 0o777:04o})"
    if dir_mode & 0o002 and not dir_mode & 0o1000:  # world-writable without the sticky bit: replaceable
        return f"anyone can replace it: its folder has mode {dir_mode & 0o7777:04o}"
    return None


# -- what an --address names, and why joining it failed ---------------------------------------

# A problem of an address, or of joining it: (what is wrong, the fix).
Diagnosis = tuple[str, str]
ADDRESS_FORMS = (
    "give the head's GCS address HOST:PORT (e.g. 10.0.0.5:6379; `ray status` on the head prints it), "
    "ray://HOST:10001 (Ray Client), or auto (a Ray started on this machine); or leave --address out for a local Ray"
)
NO_HEAD_FIX = (
    "start the head there (`raytrain up`, or `ray start --head`), or give the address `ray status` prints on the "
    "head; from another machine, check that this one reaches it (a firewall, the port open)"
)
# How ray.init says that a HOST:PORT joined answered and then failed, naming where it tried
# (with `auto`, the address it found).
_FAILED_AT = re.compile(r"Failed to connect to Ray cluster at (\S+)")


def split_host_port(address: str) -> tuple[str, str] | None:
    """`10.0.0.5:6379` -> ("10.0.0.5", "6379"), `[fd00::5]:6379` -> ("fd00::5", "6379"), as
    written (the port unchecked); None without a colon."""
    host, colon, port = address.rpartition(":")
    if not colon:
        return None
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), port


def address_form_problem(address: str) -> Diagnosis | None:
    """What is wrong with the form of `address`, from its text alone; None when Ray can try it
    (`auto`, `local`, HOST:PORT or ray://HOST:PORT with a port from 1 to 65535, or another
    scheme, which Ray hands to the client module of that name)."""
    if address.startswith(("http://", "https://")):
        return "that is the dashboard/Jobs API URL (for `ray job submit`), not the GCS address a driver joins", (
            "give HOST:6379 (the GCS port), or submit the command as a job: ray job submit -- raytrain ..."
        )
    scheme, sep, rest = address.partition("://")
    if address in ("auto", "local") or (sep and scheme != "ray"):
        return None
    parts = split_host_port(rest if sep else address)
    if parts is None:
        return "it is not an address Ray joins: it has no :PORT", ADDRESS_FORMS
    host, port = parts
    if not host:
        return "it has no host before the port", ADDRESS_FORMS
    if ":" in host and not (rest if sep else address).startswith("["):
        return "an IPv6 host needs brackets", "write it as [HOST]:PORT, e.g. [fd00::5]:6379"
    if not port:
        return "it has no port after the colon", f"add the head's port, e.g. {address}{10001 if sep else 6379}"
    if not (port.isascii() and port.isdigit()):
        return f"its port {port!r} is not a number", ADDRESS_FORMS
    if not 1 <= int(port) <= 65535:
        return (
            f"its port {int(port)} is out of range: a port is a number from 1 to 65535",
            f"give the head's port: {'10001 for Ray Client' if sep else '6379'} unless the head was started on another",
        )
    return None


def tried_address(address: str, error: str) -> str | None:
    """The HOST:PORT a failed ray.init tried: the one Ray names in `error` (what `auto` found),
    else `address` itself (ray:// dropped); None when there was none (`auto` found nothing)."""
    found = _FAILED_AT.search(error)
    if found:
        return found.group(1)
    scheme, sep, rest = address.partition("://")
    if address in ("auto", "local") or (sep and scheme != "ray"):
        return None
    return rest if sep else address


def join_failure(address: str, error: str, *, answers: bool, sends: str) -> Diagnosis:
    """Why ray.init at `address` failed, and the fix, from Ray's words (`error`: the exception
    and its causes), whether a Ray server answers now where it tried (`answers`) and which token
    this process sends (`sends`). The token is named only when a head answered and refused."""
    form = address_form_problem(address)
    if form:
        return form
    tried = tried_address(address, error) or address
    if "Could not find any running Ray instance" in error:
        return "no Ray runs on this machine for `auto` to find", (
            "start one here (`raytrain up`, or `ray start --head`), give a head's HOST:PORT, or leave --address "
            "out for an embedded local Ray"
        )
    if "Version mismatch" in error:
        # Ray's six lines: the cluster's Ray and Python, then this process's.
        said = " ".join(" ".join(error[error.index("Version mismatch") :].splitlines()[:6]).split())
        return f"the cluster runs another Ray or Python than this process ({said})", (
            "run raytrain from an environment with the cluster's Ray and Python versions"
        )
    if not answers:
        found = ", where `auto` found the Ray last started on this machine: it has stopped" if address == "auto" else ""
        return f"nothing answers at {tried}{found}", NO_HEAD_FIX
    return f"a Ray server answers at {tried}, but it did not take this process", (
        "most likely it refused this process's token (Ray logs InvalidAuthToken): "
        f"this process sends {sends}. Export RAY_AUTH_MODE=token and give it the head's token: copy the "
        "head's ~/.ray/auth_token here, or point RAY_AUTH_TOKEN_PATH at a copy. A local Ray started without "
        "RAY_AUTH_MODE (a plain ray.init(), or raytrain without --address) writes a new ~/.ray/auth_token where "
        "none exists, which then differs from the cluster's. Otherwise check the versions: the same Ray and Python "
        "as the cluster"
    )


# -- how soon the head declares a silent node dead ----------------------------------------------

# Ray's defaults for the head's node health checks, as Ray 2.60 is built (a process that has
# joined no Ray reads them from ray._raylet.Config; tests/test_head_health.py checks that).
RAY_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 5000,
    "health_check_period_ms": 3000,
    "health_check_timeout_ms": 10000,
    "health_check_failure_threshold": 5,
}


def seconds_to_declare_dead(system_config: Mapping[str, Any]) -> tuple[float, float]:
    """The fewest and most seconds from a node going silent (cut off or frozen: each check waits
    its full timeout) to the head declaring it dead, under the head's `system_config` (the keys
    it was started with; Ray's defaults for the others).

    The GCS declares a node dead after `failure_threshold` failed checks in a row, each given
    `timeout_ms`, the next one started `period_ms` after one fails; the first failing check
    starts at most `period_ms` after the silence began (the initial delay is a new node's)."""
    settings = {**RAY_HEALTH_CHECKS, **{k: v for k, v in system_config.items() if k in RAY_HEALTH_CHECKS}}
    period_s, timeout_s = settings["health_check_period_ms"] / 1000, settings["health_check_timeout_ms"] / 1000
    misses = settings["health_check_failure_threshold"]
    fewest_s = misses * timeout_s + (misses - 1) * period_s
    return fewest_s, fewest_s + period_s


def slow_death_note(system_config: Mapping[str, Any], fix: Mapping[str, int]) -> str | None:
    """What to say of a head that declares a silent node dead later than it would with the
    health-check settings `fix` (raytrain's), and the fix; None when it does not. A run still
    works on it: a restart only waits longer for the lost node's workers."""
    fewest_s, most_s = seconds_to_declare_dead(system_config)
    fix_fewest_s, fix_most_s = seconds_to_declare_dead(fix)
    if most_s <= fix_most_s:
        return None
    keys = [key for key in RAY_HEALTH_CHECKS if key != "health_check_initial_delay_ms"]
    given = ", ".join(f"{key}={system_config[key]}" for key in keys if key in system_config)
    defaults = ", ".join(f"{key}={RAY_HEALTH_CHECKS[key]}" for key in keys if key not in system_config)
    found = "; ".join(filter(None, [given, defaults and f"Ray's defaults: {defaults}"]))
    return (
        f"the Ray head declares a silent node (cut off or frozen) dead {fewest_s:g}–{most_s:g} s after it goes "
        f"silent ({found}); until then Ray counts that node and its workers as alive (a restart-mode run leaves "
        "a host silent for 10 s without waiting for it). "
        f"Fix: start the head with `ray start --head --system-config='{json.dumps(dict(fix), separators=(',', ':'))}'` "
        f"({fix_fewest_s:g}–{fix_most_s:g} s; on KubeRay, the head's rayStartParams: docs/cluster.md)"
    )
