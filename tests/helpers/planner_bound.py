"""Definitions more than one test module needs (a test module never imports another), moved out of
test_planner_bound.py; used by tests/unit/packing/test_planner_bound.py, tests/unit/packing/test_round_bound.py."""

from __future__ import annotations

import numpy as np

from hdp.packing import Plan
from hdp.packing.cost import max_rank_tokens, min_group_size


def _random_plan(lengths: np.ndarray, n_ranks: int, budget: int, seed: int) -> Plan:
    """A random valid plan: every sample on a random group size >= its fewest ranks, joining a random
    group of that size when the tokens allow (sum of per-sample maxima <= B), groups placed in a
    random round with room or a new one."""
    rng = np.random.default_rng(seed)
    n = lengths.size
    k_min = np.minimum(min_group_size(lengths, budget, n_ranks), n_ranks)
    k = np.array([rng.integers(int(a), n_ranks + 1) for a in k_min], dtype=np.int64)
    tok = max_rank_tokens(lengths, k)
    groups: list[list] = []  # [round, size, tokens, members]
    free: list[int] = []
    for i in rng.permutation(n).tolist():
        same = [g for g in groups if g[1] == k[i] and g[2] + tok[i] <= budget]
        if same and rng.random() < 0.6:
            g = same[int(rng.integers(len(same)))]
            g[2] += int(tok[i])
            g[3].append(i)
            continue
        rooms = [r for r, f in enumerate(free) if f >= k[i]]
        if rooms and rng.random() < 0.8:
            r = rooms[int(rng.integers(len(rooms)))]
        else:
            free.append(n_ranks)
            r = len(free) - 1
        start = n_ranks - free[r]
        free[r] -= int(k[i])
        groups.append([r, int(k[i]), int(tok[i]), [i], start])
    round_of = np.zeros(n, np.int64)
    start = np.zeros(n, np.int64)
    for r, size, _, members, s in groups:
        round_of[members], start[members] = r, s
    return Plan.from_columns(num_ranks=n_ranks, max_tokens_per_rank=budget, policy="random", lengths=lengths,
                             round_of=round_of, group_start=start, group_size=k)
