"""Random plans for dispatch/loss/RoPE tests: contiguous groups of size 1..max_k in every round."""

from __future__ import annotations

import numpy as np

from hdp.packing.plan import Plan


def random_partition(rng: np.random.Generator, num_ranks: int, max_k: int) -> list[tuple[int, int]]:
    """A random split of ranks [0, N) into contiguous (start, size) groups with size <= max_k."""
    groups, start = [], 0
    while start < num_ranks:
        size = int(rng.integers(1, min(max_k, num_ranks - start) + 1))
        groups.append((start, size))
        start += size
    return groups


def random_plan(
    rng: np.random.Generator,
    num_ranks: int,
    num_samples: int,
    *,
    max_k: int = 4,
    min_len: int = 1,
    max_len: int = 24,
    max_rounds: int = 3,
) -> Plan:
    """A valid plan (every sample in exactly one group of one round) ignoring token budgets."""
    lengths = rng.integers(min_len, max_len + 1, size=num_samples)
    rounds = [random_partition(rng, num_ranks, max_k) for _ in range(int(rng.integers(1, max_rounds + 1)))]
    round_of = np.zeros(num_samples, np.int64)
    start = np.zeros(num_samples, np.int64)
    size = np.zeros(num_samples, np.int64)
    for i in range(num_samples):
        r = int(rng.integers(len(rounds)))
        g = rounds[r][int(rng.integers(len(rounds[r])))]
        round_of[i], (start[i], size[i]) = r, g
    return Plan.from_columns(
        num_ranks=num_ranks, max_tokens_per_rank=max_len, policy="random", lengths=lengths,
        round_of=round_of, group_start=start, group_size=size,
    )


def plan_with_k(rng: np.random.Generator, num_ranks: int, k: int, num_samples: int, max_len: int = 24) -> Plan:
    """A one-round plan where every sample runs on groups of exactly k ranks (k divides N)."""
    lengths = rng.integers(1, max_len + 1, size=num_samples)
    starts = rng.integers(0, num_ranks // k, size=num_samples) * k
    return Plan.from_columns(
        num_ranks=num_ranks, max_tokens_per_rank=max_len, policy="fixed-k", lengths=lengths,
        round_of=np.zeros(num_samples, np.int64), group_start=starts, group_size=np.full(num_samples, k),
    )
