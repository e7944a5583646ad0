"""Peer schedulers run for real, converted to our `Plan` for like-for-like comparison.

`megatron_core_plan` runs megatron-core's own ``BalancedCPScheduler`` (hybrid context parallel)
on the lengths and turns its micro-batches into our rounds.  Megatron's memory model is per
sample (each sub-sample is its own forward/backward), so in our per-round model a rank may hold
more than B tokens in a round: `budget_ok` reports that instead of hiding it.  megatron-core is
imported inside the functions so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.plan import Plan
from hdp.packing.policies.common import refuse_above
from hdp.packing.simulate import simulate

__all__ = ["megatron_core_plan", "budget_ok", "megatron_core_report", "MAX_WORK"]

MAX_WORK = 6e7
"""Largest samples x ranks the real scheduler is run on: its Python loops grow with both
(8,192 samples on 512 ranks take about 2 s, 16,384 on 1,024 about 7 s)."""


class _GroupSize:
    """Stand-in for the DPxCP process group: the scheduler's constructor only calls size()."""

    def __init__(self, n: int) -> None:
        self._n = n

    def size(self) -> int:
        """Number of ranks of the DPxCP domain."""
        return self._n


def megatron_core_plan(lengths: Sequence[int] | np.ndarray, config: PlannerConfig) -> Plan:
    """Megatron-core's real BalancedCPScheduler schedule as a `Plan` with stats attached.

    Each of its micro-batches is one round; a sample's group is the contiguous set of GPUs that
    hold it in that micro-batch.  Raises ImportError when megatron-core is missing, `TooLarge` (a
    ValueError, before running it) when samples x ranks exceed `MAX_WORK`, and ValueError when its
    output is not contiguous or does not place every sample exactly once.
    """
    refuse_above(float(np.size(lengths)) * config.num_ranks, MAX_WORK, "megatron-core's BalancedCPScheduler",
                 f"scheduling {np.size(lengths):,} samples over {config.num_ranks:,} ranks")
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as exc:
        raise ImportError(
            "megatron_core_plan needs megatron-core (>= 0.16, with "
            "megatron.core.pipeline_parallel.hybrid_cp_schedule); pip install megatron-core"
        ) from exc
    arr = np.asarray(lengths, dtype=np.int64)
    N, B = config.num_ranks, config.max_tokens_per_rank
    sched = BalancedCPScheduler(max_seq_len_per_rank=B, dp_cp_group=_GroupSize(N))
    _, sample_id_groups = sched.get_groups_and_subsamples(
        [(i, int(L)) for i, L in enumerate(arr.tolist())], config=None
    )
    n = arr.size
    round_of = np.full(n, -1, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    size = np.zeros(n, dtype=np.int64)
    for r, per_gpu in enumerate(sample_id_groups):
        gpus_of: dict[int, list[int]] = {}
        for gpu, ids in enumerate(per_gpu):
            for s in ids:
                gpus_of.setdefault(int(s), []).append(gpu)
        for s, gpus in gpus_of.items():
            if round_of[s] != -1:
                raise ValueError(f"megatron-core placed sample {s} in two micro-batches")
            if gpus != list(range(gpus[0], gpus[0] + len(gpus))):
                raise ValueError(f"megatron-core put sample {s} on non-contiguous GPUs {gpus}")
            round_of[s], start[s], size[s] = r, gpus[0], len(gpus)
    missing = np.flatnonzero(round_of < 0)
    if missing.size:
        raise ValueError(f"megatron-core left samples unplaced: {missing[:10].tolist()}")
    p = Plan.from_columns(
        num_ranks=N, max_tokens_per_rank=B, policy="megatron-core", lengths=arr,
        round_of=round_of, group_start=start, group_size=size,
    )
    return p.with_stats(simulate(p, config.cost, pipeline_stages=config.pipeline_stages))


def budget_ok(plan: Plan) -> bool:
    """True when no rank holds more than B tokens in any round of ``plan``."""
    return bool(plan.tokens_per_rank().max(initial=0) <= plan.max_tokens_per_rank)


def megatron_core_report(lengths: Sequence[int] | np.ndarray, config: PlannerConfig) -> dict:
    """Stats of the real megatron-core plan plus ``budget_ok`` and the worst per-rank tokens."""
    p = megatron_core_plan(lengths, config)
    out = p.stats.to_dict()
    out["budget_ok"] = budget_ok(p)
    return out
