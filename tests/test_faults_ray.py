"""CPU Ray tier: failures that must end or recover a run, never hang it."""

from __future__ import annotations

import time

import pytest

import raytrain
from rt_test_pipelines import StallingPipeline

pytestmark = pytest.mark.ray


def test_stalled_rank_fails_the_attempt_naming_it_within_the_timeout(ray_session, tmp_path):
    timeout_s = 10
    cfg = raytrain.TrainConfig(
        workers=2, epochs=1, batch_size_per_worker=8, max_failures=0, collective_timeout_s=timeout_s,
        storage=str(tmp_path), name="stall",
    )
    with pytest.raises(raytrain.RunFailed) as failure:
        raytrain.fit(StallingPipeline(str(tmp_path), stall_rank=1, stall_at_step=3), cfg)
    stalled_for_s = time.time() - float((tmp_path / "stalled_at").read_text())
    message = str(failure.value)
    assert "stalled rank(s): 1" in message
    assert "rank 1 (STALLED): step 3, in forward" in message
    assert stalled_for_s < timeout_s + 30, stalled_for_s
