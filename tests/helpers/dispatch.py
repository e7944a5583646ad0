"""Definitions more than one test module needs (a test module never imports another), moved out of test_dispatch.py;
used by tests/distributed/hdp/test_dispatch_dist.py, tests/unit/hdp/test_dispatch.py."""

from __future__ import annotations

import numpy as np
import torch

from hdp.packing import PlannerConfig, plan as make_plan
from helpers.plan_factory import random_plan


def _plans(num_ranks: int, seed: int):
    rng = np.random.default_rng(seed)
    plans = [random_plan(rng, num_ranks, s, max_k=min(4, num_ranks)) for s in (7, 1, 12)]
    plans.append(random_plan(rng, num_ranks, 5, max_k=min(4, num_ranks), min_len=0, max_len=3))  # tiny/empty samples
    lengths = rng.integers(1, 40, size=10)
    plans.append(make_plan(lengths, PlannerConfig(num_ranks=num_ranks, max_tokens_per_rank=24)))
    return plans


def _batch(plan, seed=0, feat=(2, 3), dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(int(n), *feat, generator=gen, dtype=torch.float64).to(dtype) for n in plan.lengths]
