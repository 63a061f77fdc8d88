"""Offline checks of the shipped Ray cluster launcher configs (cluster*.yaml).

`ray up` has no dry run, so these tests do what it does before touching a cloud:
Ray's own `prepare_config` (defaults for the provider, setup-command merging,
per-type min/max workers, and for `type: local` Ray's `prepare_local`) followed by
`validate_config` (ray-schema.json plus cross-field checks). The provider
bootstrap step (AWS's `bootstrap_aws`: IAM, key pairs, security groups, AMIs) needs
credentials and network and is deliberately not called. No Ray cluster is started.
"""

from __future__ import annotations

import copy
import pathlib
import shlex

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_PATHS = sorted(REPO_ROOT.glob("cluster*.yaml"))
CLOUD_PROVIDERS = {"aws", "gcp", "azure"}


def _load(path: pathlib.Path) -> dict:
    with open(path) as f:
        cfg = yaml.safe_load(f)
    assert isinstance(cfg, dict), f"{path.name} is not a YAML mapping"
    return cfg


def _prepared(raw: dict) -> dict:
    # prepare_config leaves its input alone in Ray 2.60; the copy keeps it that way.
    return prepare_config(copy.deepcopy(raw))


def _worker_types(cfg: dict) -> dict:
    return {name: nt for name, nt in cfg["available_node_types"].items() if name != cfg["head_node_type"]}


def test_cluster_configs_are_shipped():
    names = [p.name for p in CONFIG_PATHS]
    assert len(CONFIG_PATHS) >= 2, names
    assert "cluster.yaml" in names


@pytest.fixture(params=CONFIG_PATHS, ids=lambda p: p.name)
def config_path(request) -> pathlib.Path:
    return request.param


def test_validates_with_rays_schema(config_path):
    prepared = _prepared(_load(config_path))
    validate_config(prepared)  # raises jsonschema.ValidationError / ValueError


def _safety_problems(raw: dict) -> list[str]:
    """Safe-default properties Ray's validation does not check (it accepts per-type
    min_workers > max_workers, any security-group rule and any dashboard host)."""
    problems = []
    prepared = _prepared(raw)

    head_starts = [c for c in prepared["head_start_ray_commands"] if "ray start" in c and "--head" in c]
    if len(head_starts) != 1:
        problems.append(f"expected one `ray start --head`: {head_starts}")
    for cmd in head_starts:
        tokens = shlex.split(cmd.split(";")[-1])
        if "--dashboard-host=127.0.0.1" not in tokens or "0.0.0.0" in cmd:
            problems.append(f"dashboard not bound to 127.0.0.1: {cmd}")

    # Ray's default AWS group allows SSH plus intra-cluster traffic; extra rules
    # from provider.security_group.IpPermissions are added to it.
    perms = raw["provider"].get("security_group", {}).get("IpPermissions", [])
    for rule in perms:
        if (rule.get("FromPort"), rule.get("ToPort")) != (22, 22):
            problems.append(f"ingress beyond SSH: {rule}")
    for name, nt in raw.get("available_node_types", {}).items():
        if "SecurityGroupIds" in nt.get("node_config", {}):
            problems.append(f"{name}: own SecurityGroupIds bypass Ray's default group")

    if raw["provider"]["type"] in CLOUD_PROVIDERS:
        workers = _worker_types(prepared)
        gpu_types = {n: nt for n, nt in workers.items() if nt["resources"].get("GPU", 0) > 0}
        if not gpu_types:
            problems.append("no worker type declares GPU resources")
        for name, nt in workers.items():
            if name not in gpu_types:
                problems.append(f"{name}: worker type without GPU resources")
            if not 0 <= nt["min_workers"] <= nt["max_workers"]:
                problems.append(f"{name}: min_workers > max_workers")
        if not any(nt["min_workers"] < nt["max_workers"] for nt in gpu_types.values()):
            problems.append("no GPU type can scale (min_workers < max_workers)")
    return problems


def test_safe_defaults(config_path):
    assert _safety_problems(_load(config_path)) == []


def test_head_dashboard_binds_localhost(config_path):
    prepared = _prepared(_load(config_path))
    joined = " ".join(prepared["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in joined


@pytest.mark.parametrize("breakage", ["type_min_gt_max", "dashboard_public", "open_8265", "cpu_only_worker"])
def test_safety_checks_catch_broken_copies(breakage):
    broken = _load(REPO_ROOT / "cluster.yaml")
    if breakage == "type_min_gt_max":
        broken["available_node_types"]["gpu_1x"].update(min_workers=3, max_workers=2)
    elif breakage == "dashboard_public":
        broken["head_start_ray_commands"] = [
            c.replace("127.0.0.1", "0.0.0.0") for c in broken["head_start_ray_commands"]
        ]
    elif breakage == "open_8265":
        broken["provider"]["security_group"] = {
            "GroupName": "raytrain",
            "IpPermissions": [
                {
                    "FromPort": 8265,
                    "ToPort": 8265,
                    "IpProtocol": "tcp",
                    "IpRanges": [{"CidrIp": "0.0.0.0/0"}],
                }
            ],
        }
    elif breakage == "cpu_only_worker":
        broken["available_node_types"]["gpu_1x"]["resources"] = {"CPU": 4}
    # Ray 2.60's validate_config accepts every one of these, so the project's own
    # checks must flag them.
    assert _safety_problems(broken), breakage


def test_setup_installs_raytrain_from_mount(config_path):
    prepared = _prepared(_load(config_path))
    assert prepared["file_mounts"].get("~/raytrain") == "."
    for key in ("head_setup_commands", "worker_setup_commands"):
        cmds = prepared[key]
        assert any("pip install -e ~/raytrain" in c for c in cmds), (key, cmds)
        assert any("ray[" in c and "==2.60.0" in c for c in cmds), (key, cmds)


def test_cloud_config_node_types(config_path):
    raw = _load(config_path)
    if raw["provider"]["type"] not in CLOUD_PROVIDERS:
        pytest.skip("node types of a local provider are built by Ray, not declared")
    prepared = _prepared(raw)
    for name, nt in _worker_types(prepared).items():
        assert nt["resources"].get("CPU", 0) >= nt["resources"]["GPU"], name
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert head.get("max_workers") == 0
    assert head["resources"].get("GPU", 0) == 0
    # Spot is only a documented alternative: the shipped file launches on-demand.
    for nt in prepared["available_node_types"].values():
        assert "InstanceMarketOptions" not in nt["node_config"]


def test_onprem_config_keeps_listed_machines(config_path):
    raw = _load(config_path)
    if raw["provider"]["type"] != "local":
        pytest.skip("not a local-provider config")
    # Ray aborts on available_node_types for the local provider.
    assert "available_node_types" not in raw
    prepared = _prepared(raw)
    (node_type,) = prepared["available_node_types"].values()
    n_ips = len(raw["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == n_ips


def test_aws_config_details():
    raw = _load(REPO_ROOT / "cluster.yaml")
    prepared = _prepared(raw)
    assert prepared["cluster_name"] == "raytrain"
    assert prepared["provider"]["type"] == "aws"
    types = prepared["available_node_types"]
    assert types["gpu_8x_a100"]["node_config"]["InstanceType"] == "p4d.24xlarge"
    assert types["gpu_8x_a100"]["resources"] == {"CPU": 96, "GPU": 8}
    assert types["gpu_1x"]["node_config"]["InstanceType"] == "g5.xlarge"
    assert types["gpu_1x"]["resources"] == {"CPU": 4, "GPU": 1}
    # Global cap covers what the per-type caps allow.
    assert prepared["max_workers"] >= sum(nt["max_workers"] for nt in _worker_types(prepared).values())
    # The head's setup (after Ray's merge of setup_commands) has boto3 for the autoscaler.
    assert any("boto3" in c for c in prepared["head_setup_commands"])


@pytest.mark.parametrize(
    "breakage",
    [
        "min_gt_max_global",
        "fractional_resource",
        "unknown_key",
        "head_not_a_type",
    ],
)
def test_validate_config_rejects_broken_copies(breakage):
    raw = _load(REPO_ROOT / "cluster.yaml")
    broken = copy.deepcopy(raw)
    if breakage == "min_gt_max_global":
        # Sum of per-type min_workers above the global max_workers.
        broken["max_workers"] = 1
        for nt in _worker_types(broken).values():
            nt["min_workers"] = 1
            nt["max_workers"] = max(nt["max_workers"], 1)
    elif breakage == "fractional_resource":
        broken["available_node_types"]["gpu_1x"]["resources"]["GPU"] = 0.5
    elif breakage == "unknown_key":
        broken["available_node_types"]["gpu_1x"]["min_worker"] = 1  # typo
    elif breakage == "head_not_a_type":
        broken["head_node_type"] = "no_such_type"
    with pytest.raises(Exception) as excinfo:
        validate_config(_prepared(broken))
    assert type(excinfo.value).__name__ in {"ValidationError", "ValueError"}


@pytest.mark.parametrize("config_path", CONFIG_PATHS, ids=lambda p: p.name)
def test_each_head_declares_a_silent_node_dead_as_the_heads_raytrain_starts(config_path):
    """The health checks of `ray start --head` in each config are raytrain's (NODE_HEALTH_CONFIG):
    a lost, frozen or cut-off host is a failure within seconds, not a minute."""
    import json

    from raytrain.driver.session import NODE_HEALTH_CONFIG

    (start,) = [c for c in _load(config_path)["head_start_ray_commands"] if "ray start --head" in c]
    (flag,) = [word for word in shlex.split(start.split(";")[-1]) if word.startswith("--system-config=")]
    assert json.loads(flag.split("=", 1)[1]) == NODE_HEALTH_CONFIG
