"""What raytrain sets in the environment for Ray's own processes (pure tier: no Ray started)."""

from __future__ import annotations

import os


def test_train_timers_poll_reports_often_unless_the_user_set_it(monkeypatch):
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE, HEALTH_CHECK_INTERVAL_S_ENV_VAR

    from raytrain.config import TrainConfig
    from raytrain.driver import launch as trainer

    # The name Ray's controller reads, and Train carries it from the driver to the controller
    # (on a joined cluster too): a Ray upgrade that changes either must fail here.
    assert HEALTH_CHECK_INTERVAL_S_ENV_VAR == "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    assert HEALTH_CHECK_INTERVAL_S_ENV_VAR in ENV_VARS_TO_PROPAGATE
    for key in (
        "RAY_TRAIN_COLLECTIVE_TIMEOUT_S",
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
        HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    ):
        # setenv first: monkeypatch then restores the key (set or absent) after the test,
        # as apply_train_timers writes them all.
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    monkeypatch.setattr(trainer, "_TIMERS_SET_HERE", set())
    trainer.apply_train_timers(TrainConfig())
    assert float(os.environ[HEALTH_CHECK_INTERVAL_S_ENV_VAR]) == trainer.REPORT_POLL_INTERVAL_S < 2.0

    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR, "5")
    monkeypatch.setattr(trainer, "_TIMERS_SET_HERE", set())
    trainer.apply_train_timers(TrainConfig())
    assert os.environ[HEALTH_CHECK_INTERVAL_S_ENV_VAR] == "5"
