"""How soon a Ray head declares a silent node dead, from the system config it was started with,
and what `raytrain doctor` and a run joining it say of it (`raytrain.rules.head`). The heads
themselves: a bare one in tests/test_hosts_ray.py, raytrain's in tests/test_doctor.py and
tests/test_head_ray.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from raytrain.doctor import head_health_notes
from raytrain.driver.session import EMBEDDED_SYSTEM_CONFIG, NODE_HEALTH_CONFIG
from raytrain.rules.head import RAY_HEALTH_CHECKS, seconds_to_declare_dead, slow_death_note


def test_rays_defaults_are_the_installed_rays():
    # In a fresh process: one that has joined a Ray reads that Ray's settings instead.
    read = "import json, ray._raylet as r; print(json.dumps({k: getattr(r.Config, k)() for k in %r}))"
    done = subprocess.run([sys.executable, "-c", read % list(RAY_HEALTH_CHECKS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == RAY_HEALTH_CHECKS


@pytest.mark.parametrize(
    "system_config, seconds",
    [
        ({}, (62, 65)),  # 5 checks given 10 s each, 3 s apart, the first within 3 s of the silence
        (NODE_HEALTH_CONFIG, (14, 15)),  # RESULTS §30: declared dead 15.0 s after the cut
        ({"health_check_period_ms": 1000}, (54, 55)),  # the others Ray's
        ({"health_check_failure_threshold": 1, "health_check_timeout_ms": 500}, (0.5, 3.5)),
    ],
)
def test_seconds_to_declare_a_silent_node_dead(system_config, seconds):
    assert seconds_to_declare_dead(system_config) == seconds


def test_a_head_with_rays_defaults_is_named_with_its_cost_and_the_fix():
    note = slow_death_note({"automatic_object_spilling_enabled": True}, NODE_HEALTH_CONFIG)
    assert note.startswith("the Ray head declares a silent node (cut off or frozen) dead 62–65 s after it goes silent")
    assert (
        "(Ray's defaults: health_check_period_ms=3000, health_check_timeout_ms=10000, "
        "health_check_failure_threshold=5)" in note
    )
    assert "until then Ray counts that node and its workers as alive" in note
    given = re.search(r"`ray start --head --system-config='(.*)'` \(14–15 s; on KubeRay", note)
    assert given and json.loads(given.group(1)) == NODE_HEALTH_CONFIG
    assert slow_death_note(json.loads(given.group(1)), NODE_HEALTH_CONFIG) is None  # the fix silences it


def test_a_head_with_some_settings_given_names_them_apart_from_rays_defaults():
    note = slow_death_note({"health_check_period_ms": 1000}, NODE_HEALTH_CONFIG)
    assert "dead 54–55 s after" in note
    assert "(health_check_period_ms=1000; Ray's defaults: health_check_timeout_ms=10000, " in note


@pytest.mark.parametrize(
    "system_config",
    [
        NODE_HEALTH_CONFIG,
        EMBEDDED_SYSTEM_CONFIG,  # the embedded Ray's and `raytrain up`'s head
        {**NODE_HEALTH_CONFIG, "health_check_failure_threshold": 3},  # faster than raytrain's
    ],
)
def test_a_head_as_fast_as_raytrains_is_not_mentioned(system_config):
    assert slow_death_note(system_config, NODE_HEALTH_CONFIG) is None


def test_doctor_notes_a_slow_head_says_nothing_of_raytrains_and_names_one_it_cannot_read():
    assert head_health_notes({}) == [slow_death_note({}, NODE_HEALTH_CONFIG)]
    assert head_health_notes(dict(EMBEDDED_SYSTEM_CONFIG)) == []
    (unread,) = head_health_notes(None)
    assert "cannot be read through Ray Client" in unread and "HOST:6379" in unread


def test_the_kuberay_head_of_the_docs_has_raytrains_health_checks_once_its_shell_reads_them():
    """docs/cluster.md's RayCluster: KubeRay writes `--system-config=VALUE` into the head's shell
    command, so the value carries its own quotes."""
    import shlex
    from pathlib import Path

    import yaml

    docs = (Path(__file__).parents[1] / "docs" / "cluster.md").read_text()
    manifest = re.search(r"```yaml\n(.*?)```", docs[docs.index("## KubeRay") :], re.S).group(1)
    spec = yaml.safe_load(manifest)["spec"]
    flag = f"--system-config={spec['headGroupSpec']['rayStartParams']['system-config']}"
    (word,) = shlex.split(flag)
    assert json.loads(word.split("=", 1)[1]) == NODE_HEALTH_CONFIG
    pod = spec["workerGroupSpecs"][0]["template"]["spec"]
    (worker,) = pod["containers"]
    hook = worker["lifecycle"]["preStop"]["exec"]["command"][-1]
    drain = shlex.split(hook.replace("$HOSTNAME", "pod-0").split("&&")[0])
    assert drain[:2] == ["ray", "drain-node"]
    from ray.scripts.scripts import drain_node  # the installed Ray's command parses the hook's flags

    given = drain_node.make_context("drain-node", drain[2:]).params
    assert given["reason"] == "DRAIN_NODE_REASON_PREEMPTION" and given["deadline_remaining_seconds"] == 45
    assert given["deadline_remaining_seconds"] < pod["terminationGracePeriodSeconds"]
