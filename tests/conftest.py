"""Test tiers: pure (no mark), CPU Ray (`ray` mark, one shared Ray instance), GPU (`gpu` mark)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session: 4 logical CPUs, isolated from any other Ray on the host."""
    import ray

    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    from raytrain.trainer import free_port

    pythonpath = os.pathsep.join([str(REPO), str(TESTS), *[p for p in sys.path if p]])
    dashboard_port = free_port()
    env_vars = {
        "PYTHONPATH": pythonpath,
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        # Other Rays may run on this host (the job test starts one): name our dashboard.
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard_port}",
    }
    ray.init(
        address="local",
        num_cpus=4,
        # raytrain tune places its trial drivers on this custom resource (0 CPUs each), as
        # its embedded Ray does; a running Ray cannot gain a resource later.
        resources={"trial_driver": 1000},
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        logging_level="ERROR",
        runtime_env={"env_vars": env_vars},
    )
    yield ray
    ray.shutdown()
