"""Ascend's HDP recipe for verl: sub-groups inside static CP boxes, best-fit decreasing.

The recipe keeps a static CP size k (``config.static_cp_size`` or the smallest power of two
fitting the longest sample) and splits the domain into N // k CP groups ("boxes")
``[b*k, (b+1)*k)``; ranks beyond the last box idle.  Sub-groups are formed only inside one box, as
contiguous rank ranges of any size.  A sample of L tokens asks for
``r = ceil(L / (1.18 * B))`` ranks (1.18 is the recipe's memory headroom factor), clamped to
``[min_group_size(L), k]`` so that our per-rank budget B holds.  Cost is the token count (the
recipe balances tokens, not L²).

Best-fit decreasing on rank counts: samples, longest first, go to the placement where they fit
best among all rounds and boxes:

1. an existing sub-group of exactly r ranks whose per-rank tokens stay <= B and at or below the
   balanced per-rank target of the round count so far — the least loaded such sub-group;
2. else a new sub-group carved from the free ranks of the (round, box) with the fewest free
   ranks that still hold r (best fit on rank counts);
3. else the least loaded existing sub-group of r ranks with token room;
4. else a new round.

Rounds are as many as needed.  Deterministic: ties go to the lowest (round, box, start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.cost import max_rank_tokens, min_group_size
from hdp.packing.policies.common import Assignment, refuse_above
from hdp.packing.policies.kk import static_cp_size

__all__ = ["assign", "check_scale", "HEADROOM", "MAX_WORK"]

MAX_WORK = 1e9
"""Largest samples x ranks x rounds this port takes on: each sample scans every sub-group of every
round and box in Python (8,192 samples on 512 ranks, 16 rounds: about 2 s)."""

HEADROOM = 1.18
"""The recipe's memory headroom factor: a sample gets ceil(L / (1.18 * B)) ranks."""


@dataclass
class _Box:
    """Mutable planning state of one box in one round."""

    start: int
    free: int
    subs: list[list[int]] = field(default_factory=list)
    """Sub-groups: [start, size, tokens per rank]."""


def check_scale(lengths: np.ndarray, config: PlannerConfig) -> None:
    """Refuse (`TooLarge`, one line) a batch whose samples x ranks x rounds exceed `MAX_WORK`."""
    rounds = -(-int(lengths.sum()) // (config.num_ranks * config.max_tokens_per_rank))
    refuse_above(float(lengths.size) * config.num_ranks * max(1, rounds), MAX_WORK, "ascend-hdp",
                 f"scanning every sub-group of ~{max(1, rounds)} rounds x {config.num_ranks:,} ranks "
                 f"for each of {lengths.size:,} samples")


def assign(lengths: np.ndarray, config: PlannerConfig) -> Assignment:
    """Sub-groups inside CP boxes; best-fit decreasing on rank counts with token cost."""
    lengths = np.asarray(lengths, dtype=np.int64)
    N, B = config.num_ranks, config.max_tokens_per_rank
    k = static_cp_size(lengths, config)
    boxes = N // k
    want = np.ceil(lengths / (HEADROOM * B)).astype(np.int64)
    r_of = np.clip(np.maximum(want, min_group_size(lengths, B, N)), 1, k)
    tok = np.array([int(max_rank_tokens(int(L), int(r))[0]) for L, r in zip(lengths, r_of)])

    rounds: list[list[_Box]] = []
    n = lengths.size
    round_of = np.zeros(n, dtype=np.int64)
    g_start = np.zeros(n, dtype=np.int64)
    placed_tokens = 0
    usable = boxes * k

    def new_round() -> None:
        rounds.append([_Box(start=b * k, free=k) for b in range(boxes)])

    new_round()
    for i in np.lexsort((np.arange(n), -lengths)):
        r, t = int(r_of[i]), int(tok[i])
        placed_tokens += int(lengths[i])
        target = placed_tokens / (usable * len(rounds))  # balanced per-rank tokens so far
        join: list[tuple[int, int, int, int]] = []  # (load, round, box, sub)
        for ri, rnd in enumerate(rounds):
            for bi, box in enumerate(rnd):
                for si, sub in enumerate(box.subs):
                    if sub[1] == r and sub[2] + t <= B:
                        join.append((sub[2], ri, bi, si))
        join.sort()
        choice: tuple[int, int, int] | None = None
        if join and join[0][0] + t <= target:
            choice = join[0][1:]
        else:
            fits = [
                (box.free, ri, bi)
                for ri, rnd in enumerate(rounds)
                for bi, box in enumerate(rnd)
                if box.free >= r
            ]
            if fits:
                _, ri, bi = min(fits)
                box = rounds[ri][bi]
                box.subs.append([box.start + k - box.free, r, 0])
                box.free -= r
                choice = (ri, bi, len(box.subs) - 1)
            elif join:
                choice = join[0][1:]
            else:
                new_round()
                box = rounds[-1][0]
                box.subs.append([box.start, r, 0])
                box.free -= r
                choice = (len(rounds) - 1, 0, 0)
        ri, bi, si = choice
        sub = rounds[ri][bi].subs[si]
        sub[2] += t
        round_of[i], g_start[i] = ri, sub[0]
    return Assignment(round_of=round_of, group_start=g_start, group_size=r_of.astype(np.int64))
