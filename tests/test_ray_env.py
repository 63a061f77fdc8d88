"""What raytrain sets in the environment for Ray's own processes (pure tier: no Ray started)."""

from __future__ import annotations

import os


def test_train_timers_poll_reports_often_unless_the_user_set_it(monkeypatch):
    from ray.train.v2._internal.constants import HEALTH_CHECK_INTERVAL_S_ENV_VAR

    from raytrain import trainer
    from raytrain.config import TrainConfig

    # The name Ray's controller reads: a Ray upgrade that renames it must fail here.
    assert HEALTH_CHECK_INTERVAL_S_ENV_VAR == "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    monkeypatch.delenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR, raising=False)
    monkeypatch.setattr(trainer, "_TIMERS_SET_HERE", set())
    trainer.apply_train_timers(TrainConfig())
    assert float(os.environ[HEALTH_CHECK_INTERVAL_S_ENV_VAR]) == trainer.REPORT_POLL_INTERVAL_S < 2.0

    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR, "5")
    monkeypatch.setattr(trainer, "_TIMERS_SET_HERE", set())
    trainer.apply_train_timers(TrainConfig())
    assert os.environ[HEALTH_CHECK_INTERVAL_S_ENV_VAR] == "5"
