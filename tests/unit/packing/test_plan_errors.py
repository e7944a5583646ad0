"""Plan defects name the column, the sample or round, and the fix (``PlanError``, a ``ValueError``).

``check_plan`` used to raise bare ``AssertionError``s (``train_step`` then reported "plan is
invalid: ;" with an empty reason) and ``Plan.from_columns`` accepted columns of different lengths.
"""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import Plan, PlanError, PlannerConfig, check_plan, plan


def _plan(lengths, round_of, start, size, *, n=4, budget=32):
    return Plan.from_columns(num_ranks=n, max_tokens_per_rank=budget, policy="explicit", lengths=np.array(lengths),
                             round_of=np.array(round_of), group_start=np.array(start), group_size=np.array(size))


def test_columns_of_different_lengths_are_refused_naming_the_column():
    with pytest.raises(ValueError, match=r"from_columns: group_start has shape \(2,\) but lengths has \(3,\)"):
        _plan([4, 4, 4], [0, 0, 0], [0, 1], [1, 1, 1])
    with pytest.raises(ValueError, match=r"Plan.group_size has 2 entries but Plan.lengths has 3"):
        Plan(num_ranks=2, max_tokens_per_rank=8, policy="x", lengths=np.array([1, 2, 3]), round_of=np.zeros(3, int),
             group_start=np.zeros(3, int), group_size=np.ones(2, int), num_rounds=1)
    with pytest.raises(ValueError, match=r"Plan.num_ranks=0: pass an integer >= 1"):
        Plan(num_ranks=0, max_tokens_per_rank=8, policy="x", lengths=np.array([1]), round_of=np.zeros(1, int),
             group_start=np.zeros(1, int), group_size=np.ones(1, int), num_rounds=1)
    with pytest.raises(ValueError, match=r"Plan.round_of: expected a 1-D integer column"):
        Plan(num_ranks=1, max_tokens_per_rank=8, policy="x", lengths=np.array([1]), round_of=np.zeros(1),
             group_start=np.zeros(1, int), group_size=np.ones(1, int), num_rounds=1)


@pytest.mark.parametrize("columns, message", [
    (([8, 8], [0, 0], [0, 3], [1, 2]), r"plan.group_start\[1\]=3, plan.group_size\[1\]=2: the group of sample 1 "
                                       r"spans domain ranks outside \[0, 4\)"),
    (([8, 8], [0, 0], [0, 0], [0, 1]), r"plan.group_size\[0\]=0: sample 0 needs a group of >= 1 rank"),
    (([8, 8, 8], [0, 0, 0], [0, 0, 2], [2, 1, 1]), r"round 0: samples 0 and 1 start a group at domain rank 0 with "
                                                   r"sizes 2 and 1"),
    (([8, 8, 8], [0, 0, 0], [0, 1, 3], [2, 2, 1]), r"round 0: the groups of samples 0 \(domain ranks 0..1\) and 1 "
                                                   r"\(domain ranks 1..2\) overlap"),
    (([30, 8, 4], [0, 0, 1], [0, 0, 0], [1, 1, 1]), r"round 0: domain rank 0 holds 38 tokens \(samples \[0, 1\]\) > "
                                                    r"plan.max_tokens_per_rank=32"),
])
def test_check_plan_names_the_field_the_sample_or_round_and_the_fix(columns, message):
    p = _plan(*columns)
    with pytest.raises(PlanError, match=message) as info:
        check_plan(p)
    msg = str(info.value)
    assert isinstance(info.value, ValueError), type(info.value)
    # and the fix: a valid plan from the planner, or a larger budget for an over-full rank
    fix = "raise the budget" if "max_tokens_per_rank=" in message else "build plans with hdp.packing.plan"
    assert msg.endswith(fix) or f"{fix} (" in msg, msg


def test_pow2_violations_name_the_sample():
    with pytest.raises(PlanError, match=r"plan.group_size\[0\]=3: sample 0's group is not a power of two"):
        check_plan(_plan([60], [0], [0], [3]), pow2=True)
    with pytest.raises(PlanError, match=r"plan.group_start\[0\]=1: sample 0's group of 2 ranks is not aligned"):
        check_plan(_plan([40], [0], [1], [2]), pow2=True)


def test_planner_plans_pass():
    p = plan([4000, 300, 1200, 50, 9000], PlannerConfig(num_ranks=8, max_tokens_per_rank=2048))
    check_plan(p)
