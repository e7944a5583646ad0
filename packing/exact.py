"""Exact optimum of small instances (<= 12 samples, <= 8 ranks) by branch and bound.

Minimises T = sum over rounds of the slowest rank + rounds * beta (the simulator's step time) over
all plans satisfying the plan invariants (docs/design.md), with groups being contiguous ranges of
any size (``config.group_shape == "any"``) or aligned power-of-two blocks (``"pow2"``).  Memory is
checked exactly (zigzag per-rank token counts summed over the group's samples, <= B).

Search.  A round is a multiset of groups whose sizes sum to <= N: any such multiset can be laid out
as contiguous ranges, and with power-of-two sizes laid out largest first every block is aligned,
so positions need not be searched.  Samples are placed longest first into (round, group): join an
existing group, open a new group of an allowed size in a round with enough free ranks, or open
one new round (rounds and groups are labelled by their first sample, which breaks their
symmetry; consecutive equal samples take non-decreasing slots).  Children are tried cheapest
bound first.  Bound: current sum of round maxima + rounds * beta, raised by the remaining
samples' work ``a*L + L**2`` that does not fit under the current round maxima, divided by N
(every group of k ranks costs its ranks at least the sum of its samples' work over k).  The
incumbent starts from the best valid plan of the baseline policies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hdp.packing.chunks import zigzag_bounds
from hdp.packing.config import GroupShape, PlannerConfig, Policy
from hdp.packing.cost import min_group_size, padded_length
from hdp.packing.policies.common import Assignment

__all__ = ["exact_optimum", "exact_search", "optimum_gaps", "ExactResult", "MAX_SAMPLES", "MAX_RANKS"]

MAX_SAMPLES = 12
"""Largest batch `exact_optimum` accepts."""
MAX_RANKS = 8
"""Largest domain `exact_optimum` accepts."""


@dataclass(frozen=True)
class ExactResult:
    """Outcome of `exact_search`."""

    step_time: float
    """T of the best plan found (units)."""
    assignment: Assignment
    """Its per-sample columns (caller order)."""
    optimal: bool
    """True when the search finished (proven optimum); False when the time limit cut it short."""
    nodes: int
    """Search nodes expanded."""


class _Group:
    __slots__ = ("k", "tok", "sw", "sl", "sq", "members", "cost")

    def __init__(self, k: int) -> None:
        self.k = k
        self.tok = [0] * k
        self.sw = self.sl = self.sq = 0.0
        self.members: list[int] = []
        self.cost = 0.0


class _Round:
    __slots__ = ("groups", "used", "max", "busy")

    def __init__(self) -> None:
        self.groups: list[_Group] = []
        self.used = 0
        self.max = 0.0
        self.busy = 0.0


def _baseline_incumbent(lengths: np.ndarray, config: PlannerConfig, pow2: bool):
    """Best (T, Assignment) among the baseline policies (and hdp when present) valid here."""
    from dataclasses import replace

    from hdp.packing.planner import plan
    from hdp.packing.validate import PlanError, check_plan

    best = None
    for policy in Policy:
        try:
            p = plan(lengths, replace(config, policy=policy))
        except (ModuleNotFoundError, ValueError):  # policy not written yet / cannot plan this
            continue
        try:
            check_plan(p, pow2=pow2)
        except PlanError:
            continue
        if best is None or p.stats.step_time < best[0]:
            best = (p.stats.step_time, p)
    if best is None:
        return None
    p = best[1]
    return best[0], Assignment(
        round_of=np.array(p.round_of), group_start=np.array(p.group_start),
        group_size=np.array(p.group_size),
    )


def exact_search(
    lengths: np.ndarray,
    config: PlannerConfig,
    max_rounds: int | None = None,
    time_limit_s: float = 10.0,
) -> ExactResult:
    """Branch and bound for the least step time; see the module docstring."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n, N, B = lengths.size, config.num_ranks, config.max_tokens_per_rank
    if n < 1 or n > MAX_SAMPLES:
        raise ValueError(f"lengths: exact_optimum takes 1..{MAX_SAMPLES} samples, got {n}")
    if N > MAX_RANKS:
        raise ValueError(f"config.num_ranks={N}: exact_optimum takes at most {MAX_RANKS} ranks")
    if np.any(lengths <= 0):
        raise ValueError("lengths: every sample needs at least 1 token")
    kmin = min_group_size(lengths, B, N)
    if np.any(kmin > N):
        raise ValueError(f"lengths: a sample does not fit {N} ranks x {B} tokens")
    pow2 = config.group_shape == GroupShape.POW2
    cm = config.cost
    a, beta = cm.linear_coef, cm.round_cost
    R_max = n if max_rounds is None else max(1, min(int(max_rounds), n))

    order = [int(i) for i in np.lexsort((np.arange(n), -lengths))]
    sizes_of: list[list[int]] = []
    pieces: dict[tuple[int, int], tuple[list[int], float, float, float]] = {}
    for i in range(n):
        ks = [k for k in range(int(kmin[i]), N + 1) if not pow2 or (k & (k - 1)) == 0]
        if not ks:
            raise ValueError(
                f"lengths[{i}]={int(lengths[i])} needs {int(kmin[i])} ranks: no power-of-two group "
                f"of {N} ranks fits it; use group_shape='any'"
            )
        sizes_of.append(ks)
        for k in range(1, N + 1):
            b = np.diff(zigzag_bounds(int(lengths[i]), k))
            per_rank = (b[:k] + b[::-1][:k]).tolist()
            lp = float(padded_length(int(lengths[i]), k))
            pieces[(i, k)] = (per_rank, a * lp + lp * lp, lp, lp * lp)

    def gcost(k: int, sw: float, sl: float, sq: float) -> float:
        return cm.group_cost_one(sw, sl, sq, k)  # scalar form of CostModel.group_cost

    rem_work = [0.0] * (n + 1)  # work of order[d:]
    for d in range(n - 1, -1, -1):
        L = float(lengths[order[d]])
        rem_work[d] = rem_work[d + 1] + a * L + L * L

    best_T = float("inf")
    best_assign: Assignment | None = None
    inc = _baseline_incumbent(lengths, config, pow2)
    if inc is not None and (max_rounds is None or int(inc[1].round_of.max()) < R_max):
        best_T, best_assign = inc
    rounds: list[_Round] = []
    slot_of = [(-1, -1)] * n
    nodes = 0
    deadline = time.perf_counter() + time_limit_s
    timed_out = False

    def record() -> None:
        nonlocal best_T, best_assign
        T = sum(r.max for r in rounds) + len(rounds) * beta
        if T < best_T:
            ro = np.zeros(n, np.int64)
            gs = np.zeros(n, np.int64)
            gk = np.zeros(n, np.int64)
            for ri, rnd in enumerate(rounds):
                pos = 0
                for g in sorted(rnd.groups, key=lambda g: (-g.k, g.members[0])):
                    for s in g.members:
                        ro[s], gs[s], gk[s] = ri, pos, g.k
                    pos += g.k
            best_T, best_assign = T, Assignment(round_of=ro, group_start=gs, group_size=gk)

    def add(rnd: _Round, g: _Group, i: int) -> tuple:
        per_rank, w, lp, lq = pieces[(i, g.k)]
        saved = (g.sw, g.sl, g.sq, g.cost, rnd.max, rnd.busy)
        g.tok = [x + y for x, y in zip(g.tok, per_rank)]
        g.sw, g.sl, g.sq = g.sw + w, g.sl + lp, g.sq + lq
        old = g.cost
        g.cost = gcost(g.k, g.sw, g.sl, g.sq)
        g.members.append(i)
        rnd.busy += g.k * (g.cost - old)
        rnd.max = max(rnd.max, g.cost)
        return saved

    def undo(rnd: _Round, g: _Group, i: int, saved: tuple) -> None:
        per_rank = pieces[(i, g.k)][0]
        g.tok = [x - y for x, y in zip(g.tok, per_rank)]
        g.sw, g.sl, g.sq, g.cost, rnd.max, rnd.busy = saved
        g.members.pop()

    def fits(g: _Group, i: int) -> bool:
        return all(x + y <= B for x, y in zip(g.tok, pieces[(i, g.k)][0]))

    def dfs(d: int) -> None:
        nonlocal nodes, timed_out
        if timed_out:
            return
        nodes += 1
        if nodes % 2048 == 0 and time.perf_counter() > deadline:
            timed_out = True
            return
        if d == n:
            record()
            return
        i = order[d]
        floor_slot = (-1, -1)
        if d > 0 and lengths[order[d - 1]] == lengths[i]:
            floor_slot = slot_of[order[d - 1]]
        # candidate moves: (bound after the move, kind, round, group index or size); the bound
        # after a move is computed arithmetically from the round's max and busy time
        moves: list[tuple[float, int, int, int]] = []
        top = sum(r.max for r in rounds)
        slack = sum(N * r.max - r.busy for r in rounds)
        rem = rem_work[d + 1]
        n_r = len(rounds)

        def after(rnd_max: float, old_cost: float, new_cost: float, k: int, extra: int) -> float:
            d_max = max(rnd_max, new_cost) - rnd_max
            d_busy = k * (new_cost - old_cost)
            room = slack + N * d_max - d_busy
            return top + d_max + (n_r + extra) * beta + max(0.0, rem - room) / N

        for ri, rnd in enumerate(rounds):
            if (ri,) < floor_slot[:1]:
                continue
            for gi, g in enumerate(rnd.groups):
                if (ri, gi) < floor_slot or not fits(g, i):
                    continue
                _, w, lp, lq = pieces[(i, g.k)]
                c = gcost(g.k, g.sw + w, g.sl + lp, g.sq + lq)
                moves.append((after(rnd.max, g.cost, c, g.k, 0), 0, ri, gi))
            for k in sizes_of[i]:
                if rnd.used + k > N:
                    break
                _, w, lp, lq = pieces[(i, k)]
                moves.append((after(rnd.max, 0.0, gcost(k, w, lp, lq), k, 0), 1, ri, k))
        if n_r < R_max:
            for k in sizes_of[i]:
                _, w, lp, lq = pieces[(i, k)]
                moves.append((after(0.0, 0.0, gcost(k, w, lp, lq), k, 1), 2, n_r, k))
        moves.sort()
        for lb, kind, ri, x in moves:
            if lb >= best_T * (1.0 - 1e-12):
                break
            if kind == 2:
                rounds.append(_Round())
            rnd = rounds[ri]
            if kind == 0:
                g = rnd.groups[x]
                slot_of[i] = (ri, x)
            else:
                g = _Group(x)
                rnd.groups.append(g)
                rnd.used += x
                slot_of[i] = (ri, len(rnd.groups) - 1)
            saved = add(rnd, g, i)
            dfs(d + 1)
            undo(rnd, g, i, saved)
            if kind != 0:
                rnd.groups.pop()
                rnd.used -= x
            if kind == 2:
                rounds.pop()
            if timed_out:
                return

    dfs(0)
    if best_assign is None:
        raise ValueError(f"max_rounds={max_rounds}: no plan fits the token budget in that many rounds")
    return ExactResult(step_time=float(best_T), assignment=best_assign, optimal=not timed_out, nodes=nodes)


def exact_optimum(
    lengths: np.ndarray,
    config: PlannerConfig,
    max_rounds: int | None = None,
    time_limit_s: float = 10.0,
) -> tuple[float, Assignment]:
    """Least step time T (units) and a plan achieving it, for <= 12 samples on <= 8 ranks.

    Group shapes follow ``config.group_shape``; ``max_rounds`` caps the rounds searched.  When
    ``time_limit_s`` runs out the best plan found so far is returned (use `exact_search` to know
    whether it is proven optimal).
    """
    res = exact_search(lengths, config, max_rounds=max_rounds, time_limit_s=time_limit_s)
    return res.step_time, res.assignment


def optimum_gaps(
    instances: int = 20, seed: int = 0, max_samples: int = 10, time_limit_s: float = 10.0,
    model: str = "deepseek-v3", profile: str = "ascend-910b-hccs",
) -> dict:
    """hdp's step time against the exact optimum on random small instances.

    Instance t: N in [2, 8] ranks, B = 1024, 3..``max_samples`` lengths uniform in [16, 3B)
    (capped to fit N x B), the given model and hardware profile.  Returns ``{"instances",
    "mean_gap", "worst_gap", "proven_optimal", "gaps"}`` where gap = T(hdp) / T(optimum) - 1;
    an instance whose search hit ``time_limit_s`` is compared with the best plan found (its gap
    can then only be understated) and counted out of ``proven_optimal``.
    """
    from hdp.packing.planner import plan
    from hdp.packing.profiles import cost_model

    if not 3 <= max_samples <= MAX_SAMPLES:
        raise ValueError(f"max_samples={max_samples}: must be in [3, {MAX_SAMPLES}]")
    rng = np.random.default_rng(seed)
    cost = cost_model(model, profile)
    gaps, proven = [], 0
    for _ in range(instances):
        n_ranks, budget = int(rng.integers(2, MAX_RANKS + 1)), 1024
        lengths = np.minimum(rng.integers(16, 3 * budget, int(rng.integers(3, max_samples + 1))),
                             n_ranks * (budget - 1))
        config = PlannerConfig(num_ranks=n_ranks, max_tokens_per_rank=budget, cost=cost)
        res = exact_search(lengths, config, time_limit_s=time_limit_s)
        stats = plan(lengths, config).stats
        assert stats is not None
        gaps.append(stats.step_time / res.step_time - 1.0)  # both in cost units
        proven += int(res.optimal)
    return {
        "instances": instances, "mean_gap": float(np.mean(gaps)), "worst_gap": float(np.max(gaps)),
        "proven_optimal": proven, "gaps": [float(g) for g in gaps],
    }
