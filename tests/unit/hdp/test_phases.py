"""Per-phase step timing (`hdp.core.phases`): the names, the one-step lag of the late phases, and the
slowest rank's seconds carried on the calibration gather (the library door; the verl door's metrics are
checked in tests/distributed/verl/test_verl_engine_dist.py)."""

from __future__ import annotations

import math
import time

import pytest

from hdp.core.phases import LATE_PHASES, PHASES, PhaseTimer, metric_name

"""What one rank's loss function sleeps in one step (the others do not)."""


def test_timer_rows_and_late_phases() -> None:
    t = PhaseTimer()
    t.begin()
    t.add("rounds", 2.0)
    t.add("collect", 5.0)  # after the gather of this step: goes out with the next row
    first = dict(zip(PHASES, t.row()))
    assert first["rounds"] == 2.0 and all(math.isnan(first[p]) for p in LATE_PHASES)
    t.add("calibrate", 1.0)  # the rest of this step's calibration
    t.begin()
    assert dict(zip(PHASES, t.row()))["rounds"] == 0.0  # a step starts from zero
    t.begin()
    with t.phase("plan"):
        time.sleep(0.01)
    second = dict(zip(PHASES, t.row()))
    assert second["plan"] >= 0.01 and second["calibrate"] == 0.0 and second["collect"] == 0.0  # drained by the row before
    with pytest.raises(KeyError, match="phase 'nap'"):
        with t.phase("nap"):
            pass
    with pytest.raises(ValueError, match="one per phase"):
        PhaseTimer.metrics([1.0])
    assert set(PhaseTimer.metrics([0.0] * len(PHASES))) == {metric_name(p) for p in PHASES}
