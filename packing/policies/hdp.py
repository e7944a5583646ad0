"""The `hdp` policy: sequence-length-aware hybrid data/context parallel packing.

For a candidate number of rounds R (from the token-budget minimum upwards):

1. **Group sizes.**  Every sample starts at its smallest feasible group size k_min (zigzag-exact
   ``ceil(L/B)``).  The target round height is ``tau = sum_i k_i * c(L_i, k_i) / (N * R)`` — the
   rank-time of the step spread evenly over the R rounds — where ``c(L, k)`` is the per-rank cost
   of a sample on k ranks (quadratic-aware, with CP overheads).  A sample taller than ``tau``
   would make its round longer than every other rank can fill within the token budget, so its
   group grows to the smallest k (any size, or powers of two with ``group_shape=pow2``) whose
   height fits under ``tau``; ``tau`` is then recomputed (rank-time grows a little with k).
2. **Groups.**  Multi-rank samples, tallest first, go to the round where they raise the round's
   height above ``max(roof, tau)`` the least — either as a new contiguous (or aligned) block of
   free ranks, or stacked onto an existing group of the same size that still has token room —
   ties going to the round with the fewest free ranks left (shelf packing).
3. **Single-rank samples** fill every free (round, rank) slot by longest-processing-time-first:
   each sample, tallest first, to the least-loaded slot that still has token room.  Big batches
   are placed a slot-sized slice at a time with numpy (largest remaining samples matched to the
   least-loaded slots); the tail is placed one by one with a heap.
4. **Refinement.**  Samples move from the tallest rank of each round to the least-loaded rank
   with room (single-rank samples only) while that lowers the step time.

The R with the lowest simulated step time ``sum_r max_rank load + R * beta`` wins, so extra
rounds are used only when they lower T (e.g. when the budget forces imbalance).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import replace

import numpy as np

from hdp.packing.config import GroupShape, PlannerConfig
from hdp.packing.cost import max_rank_tokens, min_group_size
from hdp.packing.plan import Plan
from hdp.packing.policies import static_cp
from hdp.packing.policies.common import Assignment, pow2_ceil
from hdp.packing.policies.kk import bins_fit, karmarkar_karp, lpt_with_capacity
from hdp.packing.simulate import min_rounds, rank_loads

__all__ = ["assign"]

_log = logging.getLogger(__name__)


_KK_MAX_SAMPLES = 16384  # above this the balanced-bins construction costs too much time
_FILL = 0.97  # token fill a round is planned to (bin packing needs slack)


class _Infeasible(Exception):
    """R rounds cannot hold the batch under the token budget."""


def _allowed_sizes(num_ranks: int, shape: GroupShape) -> np.ndarray:
    if shape is GroupShape.POW2:
        return 1 << np.arange(int(np.log2(num_ranks)) + 1, dtype=np.int64)
    return np.arange(1, num_ranks + 1, dtype=np.int64)


def _grow_sizes(
    lengths: np.ndarray, k: np.ndarray, height: np.ndarray, reach: float,
    config: PlannerConfig, sizes: np.ndarray,
) -> None:
    """In place: widen the groups of samples taller than ``reach``, the height other ranks reach.

    A sample of height h(k) on k ranks in a round whose other N - k ranks can only reach
    ``reach`` wastes about (N - k) * (h(k) - reach); a wider group costs k * h(k) - k0 * h(k0)
    extra rank-time (CP overhead).  Each tall sample takes the k minimising the sum.
    """
    cost, N = config.cost, config.num_ranks
    tall = np.flatnonzero(height > reach * (1 + 1e-9))
    if tall.size == 0:
        return
    cand = sizes[None, :]  # [1, K]
    h = cost.sample_cost(lengths[tall][:, None], cand)  # [S, K]
    score = cand * h + (N - cand) * np.maximum(0.0, h - reach)
    score = np.where(cand >= k[tall][:, None], score, np.inf)  # only sizes >= the current one
    j = np.argmin(score, axis=1)
    k[tall], height[tall] = sizes[j], h[np.arange(tall.size), j]


class _Round:
    """Slots of one round being filled: plain ranks and multi-rank groups ("super-slots")."""

    def __init__(self, num_ranks: int, budget: int):
        self.N, self.B = num_ranks, budget
        self.next_free = 0
        self.groups: list[list] = []  # [start, k, load, tokens_per_rank]

    def add_group(self, k: int, shape: GroupShape) -> list | None:
        start = self.next_free
        if shape is GroupShape.POW2 and start % k:
            start += k - start % k
        if start + k > self.N:
            return None
        g = [start, k, 0.0, 0]
        self.groups.append(g)
        self.next_free = start + k
        return g


def _fill_round(
    items: np.ndarray, lengths: np.ndarray, height1: np.ndarray, rnd: _Round,
    config: PlannerConfig, slot_of: np.ndarray,
) -> list[int]:
    """LPT (earliest finish) of single-rank samples over a round's free ranks and group slots.

    Returns the samples that did not fit the token budget.  ``slot_of[i]`` receives the group start
    rank (for samples joining a group, negative-encoded as -(start + 1)) or the plain rank.
    """
    cost, N, B = config.cost, rnd.N, rnd.B
    plain = np.arange(rnd.next_free, N, dtype=np.int64)
    # group ranks that appear before next_free but are padding (pow2 alignment) are plain too
    covered = np.zeros(N, dtype=bool)
    for g in rnd.groups:
        covered[g[0] : g[0] + g[1]] = True
    plain = np.flatnonzero(~covered)
    load = np.zeros(N)
    tok = np.zeros(N, dtype=np.int64)
    failed: list[int] = []
    order = items  # already tallest first
    m = plain.size
    pos = 0
    # Bulk phase: a slot-sized slice at a time, largest samples to least-loaded plain ranks.
    while m and order.size - pos > m:
        chunk = order[pos : pos + m]
        pos += m
        slots = plain[np.argsort(load[plain], kind="stable")]
        fits = tok[slots] + lengths[chunk] <= B
        load[slots[fits]] += height1[chunk[fits]]
        tok[slots[fits]] += lengths[chunk[fits]]
        slot_of[chunk[fits]] = slots[fits]
        failed.extend(chunk[~fits].tolist())
    rest = order[pos:]
    if failed:
        rest = np.concatenate([np.asarray(failed, dtype=np.int64), rest])
        rest = rest[np.lexsort((rest, -height1[rest]))]
        failed = []
    # Heap phase: exact earliest-finish list scheduling over plain ranks and group slots.
    plain_heap = [(float(load[s]), int(s)) for s in plain if tok[s] < B]
    heapq.heapify(plain_heap)
    plain_stash: list[tuple[int, int]] = []  # (-room, rank): ranks too full for the current length
    group_heap = [(g[2], g[0], gi) for gi, g in enumerate(rnd.groups) if g[3] < B]
    heapq.heapify(group_heap)
    # per group size: tokens per rank and per-rank cost of every remaining sample joining it
    join_tok: dict[int, dict[int, int]] = {}
    join_cost: dict[int, dict[int, float]] = {}
    if group_heap and rest.size:
        for gk in {g[1] for g in rnd.groups}:
            kk = np.full(rest.size, gk, dtype=np.int64)
            join_tok[gk] = dict(zip(rest.tolist(), max_rank_tokens(lengths[rest], kk).tolist()))
            join_cost[gk] = dict(zip(rest.tolist(), cost.sample_cost(lengths[rest], kk).tolist()))
    for i in rest.tolist():
        need = int(lengths[i])
        while plain_stash and -plain_stash[0][0] >= need:
            _, s = heapq.heappop(plain_stash)
            heapq.heappush(plain_heap, (float(load[s]), s))
        while plain_heap and B - int(tok[plain_heap[0][1]]) < need:
            _, s = heapq.heappop(plain_heap)
            room = B - int(tok[s])
            if room > 0:
                heapq.heappush(plain_stash, (-room, s))
        best_finish, choice = np.inf, None
        if plain_heap:
            best_finish, choice = plain_heap[0][0] + float(height1[i]), ("p", plain_heap[0][1])
        if group_heap:
            # the least-loaded group, if it has token room for this sample
            gl, _, gi = group_heap[0]
            g = rnd.groups[gi]
            t = join_tok[g[1]][i]
            if g[3] + t <= B:
                f = gl + join_cost[g[1]][i]
                if f < best_finish:
                    best_finish, choice = f, ("g", gi, t)
        if choice is None:
            failed.append(i)
            continue
        if choice[0] == "p":
            _, s = heapq.heappop(plain_heap)
            load[s] += float(height1[i])
            tok[s] += need
            slot_of[i] = s
            if tok[s] < B:
                heapq.heappush(plain_heap, (float(load[s]), s))
        else:
            gi, t = choice[1], choice[2]
            g = rnd.groups[gi]
            heapq.heappop(group_heap)  # the chosen group is the heap's top
            g[2] = best_finish
            g[3] += t
            slot_of[i] = -(g[0] + 1)
            if g[3] < B:
                heapq.heappush(group_heap, (g[2], g[0], gi))
    rnd.plain_load = load
    return failed


def _assign_rounds(
    lengths: np.ndarray, k0: np.ndarray, rounds: int, cap: float | None,
    config: PlannerConfig, sizes: np.ndarray,
) -> tuple[Assignment, float]:
    """Shelf-pack the batch into at most ``rounds`` rounds; return the plan and its step time."""
    cost, N, B = config.cost, config.num_ranks, config.max_tokens_per_rank
    k = k0.copy()
    height = cost.sample_cost(lengths, k)
    if cap is not None:
        _grow_sizes(lengths, k, height, cap, config, sizes)
    height1 = cost.work(lengths)  # height of a sample on one rank
    tokens = max_rank_tokens(lengths, k)
    work = k * height
    remaining = np.lexsort((np.arange(lengths.size), -height))  # tallest first
    round_of = np.full(lengths.size, -1, dtype=np.int64)
    start = np.zeros(lengths.size, dtype=np.int64)
    size = k.copy()
    slot_of = np.zeros(lengths.size, dtype=np.int64)
    step = 0.0
    for r in range(rounds):
        if remaining.size == 0:
            break
        last = r == rounds - 1
        w = work[remaining]
        target = max(float(w.sum()) / (N * (rounds - r)), float(height[remaining[0]]))
        # Segment: the longest prefix within the round's work target, token capacity and ranks.
        if last:
            take = remaining.size
        else:
            multi = k[remaining] > 1
            cum_w = np.cumsum(w)
            cum_t = np.cumsum(lengths[remaining])
            # rank footprint: groups take k whole ranks; a single of more than B/2 tokens takes
            # a rank of its own; the others share ranks by tokens
            big = ~multi & (2 * lengths[remaining] > B)
            cum_k = np.cumsum(np.where(multi, k[remaining], 0) + big)
            cum_f = np.cumsum(np.where(multi, k[remaining], lengths[remaining] / B))
            # at least the tokens the later rounds cannot hold, at most this round's capacity
            need_t = int(lengths[remaining].sum()) - (rounds - r - 1) * N * B * _FILL
            ok = ((cum_w <= target * N * (1 + 1e-9)) | (cum_t <= need_t)) & (cum_f <= N * _FILL) & (cum_k <= N)
            take = max(1, int(np.argmin(ok)) if not ok.all() else ok.size)
        seg, remaining = remaining[:take], remaining[take:]
        rnd = _Round(N, B)
        carry: list[int] = []
        multi_items = seg[k[seg] > 1]
        if config.group_shape is GroupShape.POW2:
            multi_items = multi_items[np.lexsort((multi_items, -height[multi_items], -k[multi_items]))]
        for i in multi_items.tolist():
            g = rnd.add_group(int(k[i]), config.group_shape)
            if g is None:
                carry.append(i)
                continue
            g[2] += float(height[i])
            g[3] += int(tokens[i])
            round_of[i], start[i] = r, g[0]
        singles = seg[k[seg] == 1]
        slot_of[singles] = 0
        failed = _fill_round(singles, lengths, height1, rnd, config, slot_of)
        placed = np.setdiff1d(singles, np.asarray(failed, dtype=np.int64), assume_unique=True)
        joined = placed[slot_of[placed] < 0]
        plain = placed[slot_of[placed] >= 0]
        round_of[plain], start[plain] = r, slot_of[plain]
        round_of[joined] = r
        start[joined] = -slot_of[joined] - 1
        if joined.size:
            k_of_start = {g[0]: g[1] for g in rnd.groups}
            size[joined] = [k_of_start[int(s)] for s in start[joined]]
        carry.extend(failed)
        _log.debug("round %d/%d: take %d tokens %d carry %d remaining %d", r, rounds, take,
                   int(lengths[seg].sum()), len(carry), remaining.size)
        if carry:
            if last:
                raise _Infeasible
            back = np.asarray(carry, dtype=np.int64)
            remaining = np.concatenate([back, remaining])
            remaining = remaining[np.lexsort((remaining, -height[remaining]))]
        round_max = max([g[2] for g in rnd.groups] + [float(rnd.plain_load.max())] if rnd.N else [0.0])
        step += round_max + cost.round_cost
    if remaining.size:
        raise _Infeasible
    return Assignment(round_of=round_of, group_start=start, group_size=size), step


def _layout_columns(
    widths: np.ndarray, heights: np.ndarray, num_ranks: int, shape: GroupShape
) -> tuple[np.ndarray, np.ndarray]:
    """Lay columns (width = ranks, height = time) out as rounds of N ranks, tallest first.

    Each round takes the tallest remaining column and then, in height order, every column that
    still fits its free ranks (shelf packing; for width-1 columns this minimises the sum of round
    maxima).  Within a round, wider columns go left so power-of-two blocks stay aligned.
    Returns the round and first rank of every column.
    """
    order = list(np.lexsort((np.arange(widths.size), -heights)))
    rnd = np.zeros(widths.size, dtype=np.int64)
    start = np.zeros(widths.size, dtype=np.int64)
    r = 0
    while order:
        free, members, rest = num_ranks, [], []
        for c in order:
            w = int(widths[c])
            if w <= free:
                members.append(c)
                free -= w
            else:
                rest.append(c)
        members.sort(key=lambda c: (-int(widths[c]), c))
        pos = 0
        for c in members:
            rnd[c], start[c] = r, pos
            pos += int(widths[c])
        order, r = rest, r + 1
    return rnd, start


def _kk_rounds(
    lengths: np.ndarray, k0: np.ndarray, rounds: int, reach: float | None,
    config: PlannerConfig, sizes: np.ndarray,
) -> tuple[Assignment, float]:
    """Balanced-bins construction: multi-rank samples as blocks, single-rank samples
    Karmarkar-Karp-partitioned into the remaining rank slots of ``rounds`` rounds, all laid out
    by `_layout_columns`."""
    cost, N, B = config.cost, config.num_ranks, config.max_tokens_per_rank
    k = k0.copy()
    height = cost.sample_cost(lengths, k)
    if reach is not None:
        _grow_sizes(lengths, k, height, reach, config, sizes)
    multi = np.flatnonzero(k > 1)
    single = np.flatnonzero(k == 1)
    m = max(0, min(rounds * N - int(k[multi].sum()), single.size))
    if single.size and m < 1:
        raise _Infeasible
    bins = np.zeros(0, dtype=np.int64)
    if single.size:
        w = height[single]
        tok = lengths[single]
        bins = karmarkar_karp(w, m)
        if not bins_fit(bins, tok, m, B):
            lpt = lpt_with_capacity(w, tok, m, B)
            if lpt is None:
                raise _Infeasible
            bins = lpt
    bin_h = np.bincount(bins, weights=height[single], minlength=m) if single.size else np.zeros(0)
    widths = np.concatenate([k[multi], np.ones(m, dtype=np.int64)])
    heights = np.concatenate([height[multi], bin_h])
    col_round, col_start = _layout_columns(widths, heights, N, config.group_shape)
    round_of = np.zeros(lengths.size, dtype=np.int64)
    start = np.zeros(lengths.size, dtype=np.int64)
    round_of[multi], start[multi] = col_round[: multi.size], col_start[: multi.size]
    if single.size:
        round_of[single] = col_round[multi.size + bins]
        start[single] = col_start[multi.size + bins]
    n_rounds = int(col_round.max(initial=0)) + 1
    round_max = np.zeros(n_rounds)
    np.maximum.at(round_max, col_round, heights)
    step = float(round_max.sum()) + n_rounds * cost.round_cost
    return Assignment(round_of=round_of, group_start=start, group_size=k), step


def assign(lengths: np.ndarray, config: PlannerConfig) -> Assignment:
    """Plan ``lengths`` with the hdp policy (see module docstring)."""
    N, B = config.num_ranks, config.max_tokens_per_rank
    k_min = min_group_size(lengths, B, N)
    sizes = _allowed_sizes(N, config.group_shape)
    if config.group_shape is GroupShape.POW2:
        k_min = pow2_ceil(k_min)
        if int(k_min.max()) > int(sizes[-1]):
            i = int(np.argmax(k_min))
            raise ValueError(
                f"lengths[{i}]={int(lengths[i])} needs {int(k_min[i])} ranks, more than the largest "
                f"power-of-two block of the domain ({int(sizes[-1])} of {N} ranks); use "
                "group_shape='any' or a larger max_tokens_per_rank"
            )
    cost = config.cost
    height0 = cost.sample_cost(lengths, k_min)
    single_h = height0[k_min == 1]
    h1max = float(single_h.max()) if single_h.size else 0.0
    total = float((k_min * height0).sum())
    r_min = min_rounds(lengths, N, B)
    best: tuple[float, Assignment] | None = None
    large = lengths.size > _KK_MAX_SAMPLES
    builders = [_assign_rounds] if large else [_assign_rounds, _kk_rounds]
    modes = ("none", "single") if large else ("none", "single", "tau")
    extra_rounds = min(config.max_extra_rounds, 1) if large else config.max_extra_rounds
    for builder, cap_mode in itertools.product(builders, modes):
        r, tried, worse, infeasible = r_min, 0, 0, 0
        while tried <= extra_rounds and r <= r_min + lengths.size:
            tau = total / (N * r)
            cap = {"none": None, "single": max(tau, h1max), "tau": tau}[cap_mode]
            try:
                a, step = builder(lengths, k_min, r, cap, config, sizes)
            except _Infeasible:
                r += 1
                infeasible += 1
                if infeasible > 8:
                    break
                continue
            tried += 1
            step = _step_time(lengths, a, config)
            if best is None or step < best[0] * (1 - 1e-9):
                best, worse = (step, a), 0
            else:
                worse += 1
                if worse >= 2:
                    break
            r += 1
    # Uniform plans (one group size for every sample, Karmarkar-Karp balanced) are part of the
    # search space too: on batches where one size suits everything they are the best plans.
    for k in _uniform_sizes(k_min, sizes)[: 1 if large else None]:
        a = static_cp.assign(lengths, replace(config, static_cp_size=int(k)))
        step = _step_time(lengths, a, config)
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, a)
    assert best is not None, "no feasible round count found"
    return best[1]


def _uniform_sizes(k_min: np.ndarray, sizes: np.ndarray) -> list[int]:
    """Group sizes worth trying for a uniform plan: the smallest that fits every sample, and the
    power-of-two sizes above it up to 4x."""
    need = int(k_min.max())
    cand = {int(s) for s in sizes if need <= s <= 4 * need and (s & (s - 1)) == 0}
    if need in set(sizes.tolist()):
        cand.add(need)
    return sorted(cand)


def _step_time(lengths: np.ndarray, a: Assignment, config: PlannerConfig) -> float:
    """Simulated step time of an assignment (units)."""
    p = Plan.from_columns(
        num_ranks=config.num_ranks, max_tokens_per_rank=config.max_tokens_per_rank,
        policy="hdp", lengths=lengths, round_of=a.round_of, group_start=a.group_start,
        group_size=a.group_size,
    )
    loads = rank_loads(p, config.cost)
    return float(loads.max(axis=1).sum()) + p.num_rounds * config.cost.round_cost
