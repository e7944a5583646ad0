"""The construct pass: plan every sample that has no column yet, by candidates scored exactly.

A candidate is a choice of group size per sample (a *variant*) and a round count R; `bins.build`
turns it into balanced columns shelved into rounds, the quick level pass (`level`, without
re-planning) evens it out, and the step time scores it.  Variants:

* ``k_min``: every sample on its fewest ranks (zigzag-exact ``ceil(L/B)``);
* ``grow-tau`` / ``grow-1.25tau`` / ``grow-1.5tau``: samples taller than tau(R) (the height of a
  perfectly balanced round of R, times 1 / 1.25 / 1.5) widened (`sizes.grow_sizes`);
  ``grow-single``: those taller than max(tau, the tallest single-rank sample);
  ``grow-single-rmin``: the same with tau fixed at the fewest rounds' (more rounds do not widen
  more samples, which would need still more rounds);
* ``uniform-u``: every sample on u ranks (the smallest size that fits every sample and the powers
  of two above it) -- the static-CP family, so hdp's own plans include static CP's shapes;
* ``pow2-*``: under ``group_shape=any`` also k_min and grow-tau on power-of-two sizes only (the
  shapes ``group_shape=pow2`` plans with).

Every variant gets one candidate first: the widening variant (``grow-*`` or ``k_min``) whose sizes
need the fewest rounds first, then the others in the order of `_variants` (the likeliest winners first, static
CP's shape second: the first two are built whatever the budget, so hdp's own plans always include
a static-CP plan; on big batches the budget may allow no more), at the round count its sizes need (a fixed point: sizes for R
rounds need R' >= R rounds, sizes re-chosen for R', ...); then the variants whose plans are best
so far go on, one build at a time, to more rounds while the step time improves (up to
``max_extra_rounds`` beyond, more while each build improves, at most 8 builds).  A variant whose
lower bound (`_floor`) cannot beat the best plan so far is skipped.  The first candidate is always built; every further build
costs its samples from the ``construct`` pool of the search budget and is skipped when the pool
is spent -- so a huge batch gets one candidate and a small one all of them.  A candidate that
cannot beat the best so far on its bound is not built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from hdp.packing.config import GroupShape
from hdp.packing.cost import max_rank_tokens, min_group_size, padded_length
from hdp.packing.policies.common import Assignment, allowed_sizes, left_starts
from hdp.packing.kernels.jit import int_array
from hdp.packing.policies.hdp.kernels.costs import rank_tokens
from hdp.packing.policies.hdp.bins import Infeasible, build, partition, size_classes
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.level import _level, _with_tallest, level
from hdp.packing.policies.hdp.sizes import grow_sizes
from hdp.packing.simulate import min_rounds

__all__ = ["construct", "spread"]

_log = logging.getLogger(__name__)

_MAX_BUILDS = 8  # builds per variant while each still improves
_FREE_BUILDS = 2  # candidates built whatever the budget: the first variant's and static CP's shape
_LEVEL_RESERVE = 3  # the construction leaves this many placements per sample for the level pass
_BUILD_FIXED = 1024  # placements' worth of fixed work per candidate (a few hundred array operations)
_WIDE = 2  # placements a wide group costs the shelf layout (one scan of the rounds each)
_MORE_ROUNDS = 1.3  # a variant needing this many times the fewest rounds of any goes last
_GRID_SCAN = 8  # rounds x ranks the levelling scans for the price of one placement


def construct(cols: Columns, problem) -> Columns:
    """The construct pass: the samples of ``cols`` without a column planned (module docstring) in
    rounds after ``cols``'s own; planned samples keep their columns."""
    todo = np.flatnonzero(cols.col_of < 0)
    if todo.size == 0:
        return cols
    sub = problem if todo.size == problem.n else problem.sub(todo)
    return cols.plus(_best_candidate(sub), todo)


Variant = Callable[[int], tuple[np.ndarray, np.ndarray]]


def _variants(problem) -> list[tuple[str, Variant]]:
    """(name, R -> (group size, height) of every sample) for each variant (module docstring)."""
    lengths, k_min, cost, N = problem.lengths, problem.k_min, problem.cost, problem.num_ranks
    h0 = cost.sample_cost(lengths, k_min)
    total = float((k_min * h0).sum())

    def grown(k_base: np.ndarray, h_base: np.ndarray, sizes: np.ndarray, reach_of: Callable[[float], float]) -> Variant:
        memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def at(rounds: int) -> tuple[np.ndarray, np.ndarray]:
            if rounds not in memo:
                k, h = k_base.copy(), h_base.copy()
                grow_sizes(lengths, k, h, reach_of(total / (N * rounds)), problem, sizes)
                memo[rounds] = (k, h)
            return memo[rounds]
        return at

    single = h0[k_min == 1]
    tau0 = total / (N * min_rounds(lengths, N, problem.budget))
    h1max = float(single.max()) if single.size else 0.0
    sizes = problem.sizes
    need = int(k_min.max())
    uniform: list[tuple[str, Variant]] = []
    for u in sizes[(sizes >= need) & (sizes <= 4 * need)]:
        u = int(u)
        if not problem.pow2 and u != need and u & (u - 1):
            continue  # uniform plans: the smallest fitting size and powers of two above it
        ku = np.full(lengths.size, u, dtype=np.int64)
        hu = cost.sample_cost(lengths, ku)
        uniform.append((f"uniform-{u}", lambda rounds, ku=ku, hu=hu: (ku, hu)))
    # static CP's shape (every sample on the smallest power of two that fits the longest) early:
    # hdp's own plans then cover what static-cp and verl-kk build
    static = next((i for i, (name, _) in enumerate(uniform) if not int(name.split("-")[1]) & (int(name.split("-")[1]) - 1)), 0)
    uniform = uniform[static : static + 1] + uniform[:static] + uniform[static + 1 :]
    out: list[tuple[str, Variant]] = [  # the likeliest winners first (the first is always built)
        ("grow-single-rmin", grown(k_min, h0, sizes, lambda tau: max(tau0, h1max))),
        *uniform[:1],
        ("grow-single", grown(k_min, h0, sizes, lambda tau: max(tau, h1max))),
        ("grow-1.5tau", grown(k_min, h0, sizes, lambda tau: 1.5 * tau)),
        ("k_min", lambda rounds: (k_min, h0)),
        ("grow-tau", grown(k_min, h0, sizes, lambda tau: tau)),
        ("grow-1.25tau", grown(k_min, h0, sizes, lambda tau: 1.25 * tau)),
        *uniform[1:2],
        *uniform[2:],
    ]
    if not problem.pow2:  # the power-of-two shapes too (what group_shape=pow2 would plan with)
        k2 = min_group_size(lengths, problem.budget, N, pow2=True)
        if int(k2.max()) <= N and not np.array_equal(k2, k_min):
            p2 = allowed_sizes(N, GroupShape.POW2)
            h2 = cost.sample_cost(lengths, k2)
            pow2 = [("pow2-k_min", lambda rounds, k2=k2, h2=h2: (k2, h2)),
                    ("pow2-grow-tau", grown(k2, h2, p2, lambda tau: tau))]
            # on nodes, where a ring across them costs more than inside one for some sample on its fewest
            # ranks, aligned blocks (of at most a node) stay inside nodes: likely winners, built early
            out = out[:1] + pow2[::-1] + out[1:] if _crossing_costs(problem) else out + pow2
    return out


def _crossing_costs(problem) -> bool:
    """On a domain over nodes: whether some sample alone on its fewest ranks (at least 2) is taller with
    its ring across nodes than inside one (its transfer does not hide behind its attention)."""
    if problem.nodes is None:
        return False
    multi = problem.k_min > 1
    lengths, k = problem.lengths[multi], problem.k_min[multi]
    inside = problem.cost.sample_cost(lengths, k)
    return bool(np.any(problem.cost.sample_cost(lengths, k, cross=True) > inside * (1 + 1e-9)))


def _floor(problem, k: np.ndarray, rounds: int) -> float:
    """A lower bound of the step time of any plan of ``rounds`` or more rounds with these group sizes.

    A group of k ranks costs each of them at least its samples' padded work / k (`CostModel.work`;
    every other term of a group's cost is non-negative), so the rank-time is at least the summed
    padded work; a round is at least as tall as its tallest sample alone (the pipeline term).
    """
    cost, N, lengths = problem.cost, problem.num_ranks, problem.lengths
    rank_time = float(cost.work(padded_length(lengths, k)).sum())
    floor = rank_time / N + rounds * cost.round_cost
    if problem.stages > 1:
        floor += (problem.stages - 1) * max(float(cost.sample_cost(lengths, k).max()), rank_time / (N * rounds))
    return floor


def _best_candidate(problem) -> Columns:
    """The best candidate plan of the variants x round counts (module docstring), quick-levelled."""
    lengths, N, B, meter = problem.lengths, problem.num_ranks, problem.budget, problem.meter
    n = problem.n
    r_min = min_rounds(lengths, N, B)
    extra = problem.config.max_extra_rounds
    best: tuple[float, Columns, str] | None = None
    best_rounds = 0
    variants = _variants(problem)
    tok_cache: dict[bytes, np.ndarray] = {}  # tokens per rank of each group-size vector
    built: dict[bytes, float | None] = {}  # (columns, sizes, rounds) -> step time (None: infeasible)
    floor_t = [_floor(problem, fn(r_min)[0], r_min) for _, fn in variants]
    builds = 0
    # what the level pass needs on the chosen plan (re-planning rounds, merging groups) stays in the pool
    reserve = min(max(0, meter.left("construct")) // 4, _LEVEL_RESERVE * n)

    def more(k: np.ndarray | None = None, rounds: int = 0) -> bool:
        """Whether one more candidate build fits the pool (beyond the reserve)."""
        return meter.allows("construct", (n if k is None else units(k, rounds)) + reserve)

    def sizing(fn: Variant, rounds: int, own: bool) -> tuple:
        """(group sizes, heights, tokens per rank, rounds >= ``rounds`` their tokens need)."""
        k, height = fn(rounds)
        key_k = k.tobytes()
        if key_k not in tok_cache:
            tok_cache[key_k] = rank_tokens(lengths, int_array(k))
        tok = tok_cache[key_k]
        sz, cls = size_classes(k)
        need = -(-np.bincount(cls, weights=tok).astype(np.int64) // B)
        if own:  # multi-rank samples each take their own group
            need = np.where(sz > 1, np.bincount(cls), need)
        return k, height, tok, max(rounds, -(-int((need * sz).sum()) // N))

    def units(k: np.ndarray, rounds: int) -> int:
        """What a candidate costs: its samples, a fixed part, the shelf layout's placement of the
        wide groups one by one and the levelling's scans of the rounds x ranks grid."""
        wide = int(np.count_nonzero(k > 1))
        return n + _BUILD_FIXED + _WIDE * wide + rounds * problem.num_ranks // _GRID_SCAN

    def candidate(k, height, tok, rounds: int, own: bool, exact: bool = False) -> tuple[Columns, float]:
        nonlocal builds
        # the first builds are free: a plan must come out, and static CP's shape is always among them
        # (an exact re-build of a shared-group candidate always costs)
        meter.charge("construct", units(k, rounds) if builds >= _FREE_BUILDS or exact else 0)
        cols = level(build(problem, k, height, tok, rounds, own, exact=exact), problem, thorough=False)
        builds += 0 if exact else 1  # (a build the budget cannot hold raised: it does not count)
        return cols, problem.step_time(cols)

    def too_many(rounds: int) -> bool:
        """Far more rounds than the best plan so far: not worth a build."""
        return best is not None and rounds > 1.25 * best_rounds + problem.stages

    var_best = [np.inf] * len(variants)

    def explore(vi: int):
        """Builds of variant ``vi``, one per ``next``: round counts upwards from the minimum while the
        step time improves (module docstring)."""
        nonlocal best, best_rounds
        name, fn = variants[vi]
        own = not name.startswith("uniform")
        r = r_min
        tried, worse, misses = 0, 0, 0
        seen: set[bytes] = set()  # candidates of this variant
        own_key = b"o" if own else b"u"
        v_extra = max(extra, 1) if not own else extra  # uniform plans: their best round count varies
        while (tried <= v_extra or (worse == 0 and tried < _MAX_BUILDS)) and misses <= 8:
            # group sizes for r rounds, then the rounds their tokens need, re-chosen for those rounds
            cands = [sizing(fn, r, own)]
            while cands[-1][3] > r and len(cands) < 4 and not too_many(cands[-1][3]):
                r = cands[-1][3]
                cands.append(sizing(fn, r, own))
            for k, height, tok, r_c in cands[-1:]:  # the fixed point: sizes chosen for the rounds they need
                key = own_key + k.tobytes() + r_c.to_bytes(8, "little")
                if key in seen:
                    continue
                if too_many(r_c):
                    return
                seen.add(key)
                step = built.get(key, -1.0)
                if step == -1.0:  # not built by an earlier variant yet
                    if builds >= _FREE_BUILDS and not more(k, r_c):
                        return
                    try:
                        cols, step = candidate(k, height, tok, r_c, own)
                        if not own and step < min(best[0] if best else np.inf, var_best[vi]) * 1.005 and more(k, r_c):
                            # a competitive shared-group plan: exact LPT where the budget is tight
                            cols2, step2 = candidate(k, height, tok, r_c, own, exact=True)
                            if step2 < step:
                                cols, step = cols2, step2
                        var_best[vi] = min(var_best[vi], step)
                        _log.debug("hdp construct: %s R=%d step %.6g (%d builds)", name, r_c, step, builds)
                        if best is None or step < best[0] * (1 - 1e-9):
                            best, worse, best_rounds = (step, cols, f"{name} R={r_c}"), -1, r_c
                    except Infeasible:
                        step = None
                    built[key] = step
                    if step is not None:
                        yield  # a feasible build: the scheduler decides who goes next
                if step is None:
                    misses += 1
                    continue
                tried += 1
                worse += 1
                if worse >= 2:
                    return
            r = cands[-1][3] + 1

    # every variant's first candidate, cheapest bound first; then the variants whose plans are
    # best so far go on to more round counts, one build at a time, while the budget lasts
    def fixed_point(vi: int) -> int:
        """The rounds variant ``vi``'s sizes need, re-chosen for those rounds (as its first build)."""
        name, fn = variants[vi]
        own = not name.startswith("uniform")
        r = r_min
        for _ in range(4):
            r_c = sizing(fn, r, own)[3]
            if r_c <= r:
                break
            r = r_c
        return r

    # in the order of `_variants` (the likeliest winners first), but a variant whose own groups need
    # far more rounds than k_min's goes last (tight budgets: widening everything multiplies rounds)
    names = [v[0] for v in variants]
    fewest = fixed_point(names.index("k_min"))

    def order():
        # first the widening variant whose sizes need the fewest rounds (the earliest among equals):
        # more rounds than needed mostly mean idle ranks and ring overhead
        grow = [vi for vi, name in enumerate(names) if name == "k_min" or name.startswith("grow")]
        first = min(grow, key=lambda vi: (fixed_point(vi), vi))
        yield first
        deferred = []
        for vi, name in enumerate(names):
            if vi == first:
                continue
            if not name.startswith("uniform") and fixed_point(vi) > _MORE_ROUNDS * fewest:
                deferred.append(vi)
            else:
                yield vi
        yield from deferred

    active: list = []
    for vi in order():
        if best is not None and floor_t[vi] >= best[0]:
            continue
        gen = explore(vi)
        if next(gen, StopIteration) is not StopIteration:
            active.append((vi, gen))
        if builds >= _FREE_BUILDS and not more():
            break
    while active and more():
        pos = min(range(len(active)), key=lambda j: (var_best[active[j][0]], j))
        if next(active[pos][1], StopIteration) is StopIteration:
            active.pop(pos)
    if best is None:  # every variant overflowed the budget: one sample per column always fits
        k_min = problem.k_min
        cols = build(problem, k_min, problem.cost.sample_cost(lengths, k_min), max_rank_tokens(lengths, k_min),
                     n, True)
        best = (problem.step_time(cols), cols, "one-per-column")
    _log.debug("hdp construct: chose %s, estimated step %.4g", best[2], best[0])
    return best[1]


def spread(problem, rounds: int) -> Columns | None:
    """A plan of ``rounds`` rounds with the multi-rank samples spread over every round.

    Multi-rank samples (own groups of k_min ranks), tallest first, fill each round up to its share
    of their ranks, so samples of similar height share a round; single-rank samples then go
    tallest first to the single rank with the most room below its round's level (the taller of
    the round's multi-rank groups and the common level), within B tokens.  Unlike the shelf
    layout no round ends up holding only multi-rank groups of uneven height; the result is rough
    (the local search levels it).  None when the budget does not hold the singles in these rounds.
    """
    lengths, k_min = problem.lengths, problem.k_min
    N, B, cost = problem.num_ranks, problem.budget, problem.cost
    h = cost.sample_cost(lengths, k_min)
    multi = np.flatnonzero(k_min > 1)
    multi = multi[np.lexsort((multi, -h[multi]))]
    cap = max(1, -(-int(k_min[multi].sum()) // rounds))
    round_of = np.zeros(lengths.size, dtype=np.int64)
    used: list[int] = [0]
    top: list[float] = [0.0]
    for i in multi.tolist():
        w = int(k_min[i])
        if used[-1] > 0 and (used[-1] + w > N or (used[-1] + w > cap and len(used) < rounds)):
            used.append(0)
            top.append(0.0)
        round_of[i] = len(used) - 1
        used[-1] += w
        top[-1] = max(top[-1], float(h[i]))
    n_rounds = max(rounds, len(used))
    used_a = np.zeros(n_rounds, dtype=np.int64)
    used_a[: len(used)] = used
    floor = np.zeros(n_rounds)
    floor[: len(top)] = top
    start = np.zeros(lengths.size, dtype=np.int64)
    start[multi] = left_starts(round_of[multi], k_min[multi])
    singles = np.flatnonzero(k_min == 1)
    if singles.size:
        slots = N - used_a  # [R] single ranks per round
        floor = _with_tallest(floor, slots, float(h[singles].max()))
        target = np.maximum(_level(float(h[singles].sum()), slots, floor), floor)
        slot_round = np.repeat(np.arange(n_rounds), slots)
        slot_rank = np.concatenate([used_a[r] + np.arange(slots[r]) for r in range(n_rounds)])
        try:
            b = partition(h[singles], lengths[singles], slot_round.size, B, offset=-target[slot_round])
        except Infeasible:
            return None
        round_of[singles], start[singles] = slot_round[b], slot_rank[b]
    return Columns.from_assignment(
        Assignment(round_of=round_of, group_start=start, group_size=k_min.copy()), N
    )
