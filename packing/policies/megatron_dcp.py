"""Megatron-core's hybrid context parallel scheduler (``BalancedCPScheduler``), re-implemented.

The published algorithm (megatron/core/pipeline_parallel/hybrid_cp_schedule.py), one micro-batch
at a time until every sample is placed; each micro-batch becomes one of our rounds:

* a sample needs ``gpus_needed = 2**ceil(log2(L / B))`` ranks (at least 1) and costs each of them
  ``L**2 / k`` (its workload estimate); samples are taken longest first;
* the remaining samples are cut into as many buckets as there are distinct ``gpus_needed`` values,
  each of roughly equal work (a bucket closes at 1.1x the mean work, or when the remaining samples
  are needed one per remaining bucket);
* scanning buckets in order, the head sample of the first bucket that can be placed goes to a new
  group carved from free ranks (when there are enough; a fresh group has load 0) or else to the
  least loaded existing group of exactly its size;
* once a smaller size than the first one has been seen, the micro-batch closes as soon as
  ``max - min <= delta * max`` over the rank loads (delta = 0.05, the 5% slack), or when no head
  sample can be placed;
* trimming: while the slack is above delta and no rank is empty, the most recent sample of the
  most loaded group is given back if that lowers the slack;
* idle ranks are filled by doubling the size of the (first) smallest group, pushing later groups
  to the right, until no rank is empty.

Adaptations to our model, both needed for the plan invariants (docs/design.md):

(a) Our memory model is per round: every rank of a group holds all the group's samples of the round
    at once, so a group whose ranks would exceed B tokens (sum of ``max_rank_tokens``) with the
    sample is not a candidate, and ``gpus_needed`` is raised to the next power of two of the
    zigzag-exact ``min_group_size`` (Megatron's ``ceil(L/B)`` can be one token short) and capped at
    N (like Megatron, whose groups are every power of two and the whole DPxCP domain, so with a
    non-power-of-two N a group of all N ranks can occur).  Doubling a group when filling idle ranks is skipped if it would break the budget or the
    free ranks are fewer than its size (those ranks then idle).  Megatron's memory model is per
    sample (each sub-sample is its own forward), see ``hdp.trainer.bench.peers`` for the real thing.
(b) Groups are contiguous rank ranges in creation order (Megatron's are too: fresh groups take
    the lowest free ranks, and filling pushes later groups right).  Group sizes stay powers of two
    but, after doubling, blocks need not be aligned (check with ``check_plan(pow2=False)``).

Load of an expanded group is recomputed over all its samples (Megatron recomputes only its first
sample's).  Each micro-batch places at least one sample, so the loop terminates.
"""

from __future__ import annotations

import math

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.cost import max_rank_tokens, min_group_size
from hdp.packing.policies.common import Assignment, refuse_above

__all__ = ["assign", "check_scale", "DELTA", "MAX_WORK"]

MAX_WORK = 2.5e8
"""Largest samples x ranks this port takes on: it places samples one by one, scanning the
micro-batch's groups and rank loads in Python (8,192 samples on 512 ranks take about 0.5 s)."""

DELTA = 0.05
"""Balance slack that closes a micro-batch (Megatron's ``delta``)."""
BUCKET_SLACK = 1.1
"""A bucket closes above this multiple of the mean bucket work (Megatron's ``make_buckets_equal``)."""


class _Groups:
    """Groups of one micro-batch in rank order: [size, load, tokens per rank, samples]."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.groups: list[list] = []

    @property
    def used(self) -> int:
        return sum(g[0] for g in self.groups)

    def rank_loads(self) -> list[float]:
        loads = [0.0] * self.num_ranks
        pos = 0
        for size, load, _, _ in self.groups:
            loads[pos : pos + size] = [load] * size
            pos += size
        return loads


def _buckets(items: list[tuple[int, int]], need: dict[int, int]) -> list[list[tuple[int, int]]]:
    """Megatron's ``make_buckets_equal``: as many buckets of about equal work as CP sizes."""
    k = len({need[i] for i, _ in items})
    work = [L * L / need[i] for i, L in items]
    target = sum(work) / k
    buckets: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    cur_work = 0.0
    for j, (item, w) in enumerate(zip(items, work)):
        if cur and (cur_work + w > target * BUCKET_SLACK or len(items) - j <= k - len(buckets)):
            buckets.append(cur)
            cur, cur_work = [], 0.0
        cur.append(item)
        cur_work += w
    if cur:
        buckets.append(cur)
    return buckets


def _micro_batch(
    items: list[tuple[int, int]], need: dict[int, int], num_ranks: int, budget: int
) -> tuple[_Groups, list[tuple[int, int]]]:
    """Megatron's ``next_hdp_group`` with the memory adaptation: groups and leftover samples."""
    buckets = _buckets(items, need)
    st = _Groups(num_ranks)

    def tok(L: int, k: int) -> int:
        return int(max_rank_tokens(L, k)[0])

    prev_needed: int | None = None
    check_balance = False
    while buckets:
        pick = None
        for b_idx, bucket in enumerate(buckets):
            if not bucket:
                continue
            i, L = bucket[0]
            k = need[i]
            t = tok(L, k)
            cands = [g for g in st.groups if g[0] == k and g[2] + t <= budget]
            if cands or num_ranks - st.used >= k:
                pick = (b_idx, i, L, k, t, cands)
                break
        if pick is None:
            break
        b_idx, i, L, k, t, cands = pick
        if prev_needed is None:
            prev_needed = k
        best = min(cands, key=lambda g: g[1]) if cands else None  # first least loaded
        if num_ranks - st.used >= k and (best is None or 0.0 < best[1]):
            best = [k, 0.0, 0, []]
            st.groups.append(best)
        best[1] += L * L / k
        best[2] += t
        best[3].append((i, L))
        buckets[b_idx].pop(0)
        while buckets and not buckets[0]:
            buckets.pop(0)
        if k < prev_needed:
            check_balance = True
        if check_balance and buckets:
            loads = st.rank_loads()
            if max(loads) - min(loads) <= DELTA * max(loads):
                break
    leftovers = [item for b in buckets for item in b]

    # trim_overload: give back the last sample of the most loaded group while it lowers the slack
    while True:
        loads = st.rank_loads()
        hi, lo = max(loads), min(loads)
        if hi - lo <= DELTA * hi or lo == 0.0:
            break
        g = next(g for g in st.groups if g[1] == hi)
        if len(g[3]) <= 1:
            break
        i, L = g[3][-1]
        w = L * L / g[0]
        g_lo = sum(gg[0] for gg in st.groups[: st.groups.index(g)])
        proj = loads[:]
        for r in range(g_lo, g_lo + g[0]):
            proj[r] -= w
        if max(proj) - min(proj) < hi - lo:
            g[3].pop()
            g[1] -= w
            g[2] -= tok(L, g[0])
            leftovers.append((i, L))
        else:
            break

    # fill_empty_gpus: double the first smallest group while ranks are idle (adaptation (a))
    while st.used < num_ranks and st.groups:
        smallest = min(g[0] for g in st.groups)
        free = num_ranks - st.used
        grown = False
        for g in st.groups:
            if g[0] != smallest or free < smallest:
                continue
            k2 = 2 * smallest
            t2 = sum(tok(L, k2) for _, L in g[3])
            if t2 > budget:
                continue
            g[0], g[1], g[2] = k2, sum(L * L / k2 for _, L in g[3]), t2
            grown = True
            break
        if not grown:
            break
    return st, leftovers


def check_scale(lengths: np.ndarray, config: PlannerConfig) -> None:
    """Refuse (`TooLarge`, one line) a batch whose samples x ranks exceed `MAX_WORK`."""
    refuse_above(float(lengths.size) * config.num_ranks, MAX_WORK, "megatron-dcp",
                 f"placing {lengths.size:,} samples one by one over groups of {config.num_ranks:,} ranks")


def assign(lengths: np.ndarray, config: PlannerConfig) -> Assignment:
    """Megatron-core's balanced hybrid-CP schedule, micro-batches as rounds (see module doc)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    N, B = config.num_ranks, config.max_tokens_per_rank
    k_fit = min_group_size(lengths, B, N, pow2=True)
    megatron = np.array(
        [max(1, 2 ** math.ceil(math.log2(L / B))) for L in lengths.tolist()], dtype=np.int64
    )
    need_arr = np.minimum(np.maximum(megatron, k_fit), N)
    need = {i: int(k) for i, k in enumerate(need_arr)}
    items = sorted(((i, int(L)) for i, L in enumerate(lengths)), key=lambda x: -x[1])
    n = lengths.size
    round_of = np.zeros(n, dtype=np.int64)
    g_start = np.zeros(n, dtype=np.int64)
    g_size = np.zeros(n, dtype=np.int64)
    r = 0
    while items:
        st, items = _micro_batch(items, need, N, B)
        pos = 0
        for size, _, _, members in st.groups:
            for i, _ in members:
                round_of[i], g_start[i], g_size[i] = r, pos, size
            pos += size
        r += 1
    return Assignment(round_of=round_of, group_start=g_start, group_size=g_size)
