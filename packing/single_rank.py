"""A domain of one rank: every plan is a bin packing of the samples into rounds of B tokens.

With N = 1 there are no groups to choose: every sample runs whole on the one rank, a round holds at
most B tokens, and the step time is Σ work + rounds · β (+ the pipeline's fill under PP), so the
best plan has the fewest rounds.  `pack_rounds` is first-fit decreasing (at most 11/9 · OPT + 6/9
rounds; on batches of many small samples it meets the lower bound ⌈Σ L / B⌉) with a max segment
tree over the rounds' free tokens: O(S log S), about a second for 10⁵ samples.  Every policy plans
N = 1 this way (`hdp.packing.plan`).
"""

from __future__ import annotations

import numpy as np

from hdp.packing.policies.common import Assignment

__all__ = ["pack_rounds"]


def pack_rounds(lengths: np.ndarray, budget: int) -> Assignment:
    """Rounds of at most ``budget`` tokens for samples ``lengths`` [S] (each <= budget), first-fit decreasing."""
    n = int(lengths.size)
    order = np.argsort(-lengths, kind="stable")  # longest first; ties in caller order
    size = 1
    while size < max(n, 1):
        size *= 2
    free = [0] * (2 * size)  # max free tokens per subtree; leaf i = round i (unopened rounds: budget)
    for i in range(size):
        free[size + i] = budget
    for i in range(size - 1, 0, -1):
        free[i] = budget
    round_of = np.empty(n, dtype=np.int64)
    for s in order.tolist():
        need = int(lengths[s])
        node = 1  # descend to the first round with room (leftmost leaf with free >= need)
        while node < size:
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        r = node - size
        round_of[s] = r
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    zeros = np.zeros(n, dtype=np.int64)
    return Assignment(round_of=round_of, group_start=zeros, group_size=zeros + 1)
