"""The planner's compiled kernels (`hdp.packing.kernels`, `hdp.packing.policies.hdp.kernels`; numba): the cost
arithmetic is the numpy formulas' own, to the bit; plans are identical in every process (each rank plans on its
own and the engine compares plan checksums), loaded from the on-disk cache -- and compiled without one:
tests/slow/trainer/test_wheel.py plans with the installed wheel where numba finds no cache directory.  Speed is the
bench's business (``hdp bench planner``)."""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import CostModel, PlannerConfig, plan
from hdp.packing.cost import PARAMETERS, max_rank_tokens, padded_float
from hdp.packing.kernels import sort, sums
from hdp.packing.policies.hdp.kernels import balance as compiled_balance
from hdp.packing.policies.hdp.kernels import costs


def _cost_models(rng: np.random.Generator, count: int) -> list[CostModel]:
    """Random cost models, every field 0 or log-uniform over a wide range (as the rivals property test)."""
    out = []
    for _ in range(count):
        values = {f: 0.0 if rng.random() < 0.3 else float(10 ** rng.uniform(-3, 6)) for f in PARAMETERS[:-1]}
        out.append(CostModel(**values))
    return out


def test_group_cost_is_the_cost_models_own_to_the_bit():
    rng = np.random.default_rng(0)
    for cost in _cost_models(rng, 20):
        p = costs.cost_params(cost)
        k = rng.integers(1, 600, 500)
        lengths = rng.integers(1, 2**20, 500)
        lp = padded_float(lengths, k)
        sw, sl, sq = cost.work(lp) * 3.7, lp * 3.7, lp * lp * 3.7  # sums of a few samples
        want = cost.group_cost(sw, sl, sq, k)
        got = np.array([costs.group_cost(p, sw[i], sl[i], sq[i], k[i]) for i in range(k.size)])
        assert np.array_equal(got, want)
        got_one = np.array([costs.sample_cost(p, lengths[i], k[i]) for i in range(k.size)])
        assert np.array_equal(got_one, cost.sample_cost(lengths, k))


def test_padding_and_busiest_rank_tokens_match_numpy():
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(1, 2**40, 2000), np.arange(1, 300)])
    k = np.concatenate([rng.integers(1, 2000, 2000), rng.integers(1, 40, 299)])
    assert np.array_equal([costs.padded(a, b) for a, b in zip(lengths, k)], padded_float(lengths, k))
    assert np.array_equal(costs.rank_tokens(lengths, k), max_rank_tokens(lengths, k))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 127, 128, 129, 300, 1000, 4097])
def test_pairwise_sum_is_numpys(n):
    a = np.random.default_rng(n).random(n) * 1e9
    assert sums.pairwise_sum(a, 0, n) == a.sum()


def test_stable_argsort_matches_numpy_with_ties():
    """Both paths (merging below `_RADIX_MIN` keys, radix from it): numpy's stable order with ties, signed
    zeros (equal), infinities, negative and subnormal keys; NaN last on the radix path (the planner's keys,
    heights and loads, are never NaN)."""
    rng = np.random.default_rng(2)
    for n in (0, 1, 5, 16, 17, 33, 511, 512, 1000, 4097, 20_000):
        x = np.round(rng.random(n) * 10) * rng.choice([-1.0, 1.0], n)  # many ties, both signs
        if n >= 8:
            nan = np.nan if n >= sort.RADIX_MIN else 3.0
            x[:8] = [0.0, -0.0, nan, np.inf, -np.inf, 5e-324, -5e-324, nan]
        assert np.array_equal(sort.argsort_stable(x), np.argsort(x, kind="stable")), n
        y = rng.random(n) * 10.0 ** rng.integers(-300, 300, n)  # every exponent byte in play
        assert np.array_equal(sort.argsort_stable(y), np.argsort(y, kind="stable")), n


# --- the balance and LPT kernels against the numpy waves they replaced -------------------------------

def _lpt_ref(items, height, tokens, load, used, budget, out, exact=False):
    """The numpy waves `bins._lpt` ran before its kernel: the reference, one wave a few sorts."""
    from hdp.packing.policies.hdp.bins import Infeasible, _lpt_exact

    m = load.size
    pos = 0
    while pos < items.size:
        it = items[pos : pos + m]  # [b] next items, tallest first
        elig = np.flatnonzero(used + int(tokens[it].max()) <= budget)
        if exact and elig.size < m:
            _lpt_exact(items[pos:], height, tokens, load, used, budget, out)
            return
        if elig.size == 0:
            i = int(it[0])
            room = np.flatnonzero(used + tokens[i] <= budget)
            if room.size == 0:
                raise Infeasible
            it, bins = it[:1], room[np.lexsort((room, load[room]))[:1]]
        else:
            bins = elig[np.lexsort((elig, load[elig]))[: it.size]]
            it = it[: bins.size]
            low = load[bins]
            raised = np.minimum.accumulate(low + height[it])
            late = np.flatnonzero(low[1:] >= raised[:-1])
            if late.size:
                it, bins = it[: late[0] + 1], bins[: late[0] + 1]
        load[bins] += height[it]
        used[bins] += tokens[it]
        out[it] = bins
        pos += it.size


def _balance_ref(height, tokens, budget, load, out):
    """The numpy waves `kernels.balance.balance` replaced (`bins._balance` past its small cases), with the kernel's
    arguments: ``load`` [m] starting loads, ``out`` in place; False when an item fits no bin."""
    from hdp.packing.policies.hdp.bins import Infeasible

    n, m = height.size, load.size
    order = np.lexsort((np.arange(n), -height))
    used = np.zeros(m, dtype=np.int64)
    deferred = []
    pos = 0
    while n - pos >= 2 * m:
        chunk = order[pos : pos + m]
        pos += chunk.size
        target = np.argsort(load, kind="stable")[: chunk.size]
        fits = used[target] + tokens[chunk] <= budget
        ok_i, ok_b = chunk[fits], target[fits]
        load[ok_b] += height[ok_i]
        used[ok_b] += tokens[ok_i]
        out[ok_i] = ok_b
        if not fits.all():
            deferred.append(chunk[~fits])
    rest = np.concatenate(deferred + [order[pos:]])
    if rest.size:
        rest = rest[np.lexsort((rest, -height[rest]))]
        try:
            _lpt_ref(rest, height, tokens, load, used, budget, out)
        except Infeasible:
            return False
    return True


def _outcome(fn, *args):
    """What ``fn`` returns, or "infeasible" when it raises Infeasible."""
    from hdp.packing.policies.hdp.bins import Infeasible

    try:
        return fn(*args)
    except Infeasible:
        return "infeasible"


def test_balance_and_lpt_kernels_place_every_item_as_the_numpy_waves():
    """Random instances -- heights with many ties, budgets from loose to too tight, zero or unequal starting
    loads, exact or not:
    the same bins (or the same Infeasible) as the numpy reference."""
    from hdp.packing.policies.hdp import bins as B

    rng = np.random.default_rng(3)
    seen = {"feasible": 0, "infeasible": 0}
    for trial in range(400):
        n, m = int(rng.integers(1, 300)), int(rng.integers(1, 40))
        height = np.round(rng.random(n) * rng.choice([3, 1000])).astype(np.float64)  # ties when coarse
        tokens = rng.integers(1, 2000, n)
        budget = int(max(tokens.max(), tokens.sum() / m * rng.uniform(0.9, 3.0)))
        offset = np.zeros(m) if trial % 3 else -rng.random(m) * height.max()
        runs = []
        for fn in (compiled_balance.balance, _balance_ref):
            load, out = np.array(offset, dtype=np.float64), np.full(n, -1, np.int64)
            runs.append((bool(fn(height, tokens, budget, load, out)), out, load))
        (ok1, o1, l1), (ok2, o2, l2) = runs
        assert ok1 == ok2 and np.array_equal(o1, o2) and np.array_equal(l1, l2), (trial, n, m, budget)
        order = np.lexsort((np.arange(n), -height))
        for exact in (False, True):
            outs = []
            for fn in (B._lpt, _lpt_ref):
                load, used, out = np.zeros(m), np.zeros(m, np.int64), np.full(n, -1, np.int64)
                res = _outcome(fn, order, height, tokens, load, used, budget, out, exact)
                outs.append((res, out, load, used))
            (r1, o1, l1, u1), (r2, o2, l2, u2) = outs
            assert r1 == r2 and np.array_equal(o1, o2) and np.array_equal(l1, l2) and np.array_equal(u1, u2)
            seen["infeasible" if r1 == "infeasible" else "feasible"] += 1
    assert seen["feasible"] > 100 and seen["infeasible"] > 20, seen  # both outcomes exercised


@pytest.mark.parametrize("name", ["short-reasoning", "bimodal", "wikipedia", "pareto", "rl-32k"])
def test_plans_with_the_kernels_are_the_numpy_waves_plans(name, monkeypatch):
    """Whole plans: the same checksum with `kernels.balance.balance` and `bins._lpt` swapped for the numpy waves."""
    from hdp.packing import workloads
    from hdp.packing.policies.hdp import bins as B

    for n, ranks, budget in ((1024, 64, 4096), (512, 16, 16_384)):
        lengths = workloads.WORKLOADS[name](n=n, seed=5)
        cfg = PlannerConfig(num_ranks=ranks, max_tokens_per_rank=budget)
        got = plan(lengths, cfg).checksum()
        with monkeypatch.context() as mp:
            mp.setattr(compiled_balance, "balance", _balance_ref)
            mp.setattr(B, "_lpt", _lpt_ref)
            want = plan(lengths, cfg).checksum()
        assert got == want, (name, n, ranks)


# --- Karmarkar-Karp compiled against the Python heap it replaced ---------------------------------------

def _kk_ref(weights: np.ndarray, m: int) -> np.ndarray:
    """The Python `kk.karmarkar_karp` before its kernel (a heap of numpy tuples): the reference."""
    import heapq as _heapq

    w = np.asarray(weights, dtype=np.float64)
    n = w.size
    if m < 1:
        raise ValueError(f"m={m}: need at least one part")
    out = np.zeros(n, dtype=np.int64)
    if n == 0 or m == 1:
        return out
    # node ids: 0..n-1 items; n.. merge nodes; -1 an empty part
    left = np.full(n + (n - 1) * m, -1, dtype=np.int64)
    right = np.full_like(left, -1)
    next_id = n
    steps: list[tuple[int, int]] = []  # node id range created by each merge
    empty = np.full(m - 1, -1, dtype=np.int64)
    heap: list[tuple[float, int, np.ndarray, np.ndarray]] = []
    for i in range(n):
        sums = np.zeros(m)
        sums[0] = w[i]
        heap.append((-float(w[i]), i, sums, np.concatenate(([i], empty))))
    _heapq.heapify(heap)
    tie = n
    while len(heap) > 1:
        _, _, s1, id1 = _heapq.heappop(heap)
        _, _, s2, id2 = _heapq.heappop(heap)
        # s1, s2 are sorted descending: pair heaviest of one with lightest of the other
        sums = s1 + s2[::-1]
        a, b = id1, id2[::-1]
        both = (a >= 0) & (b >= 0)
        ids = np.where(a >= 0, a, b)
        cnt = int(both.sum())
        if cnt:
            new = np.arange(next_id, next_id + cnt)
            left[new], right[new] = a[both], b[both]
            ids[both] = new
            steps.append((next_id, next_id + cnt))
            next_id += cnt
        order = np.argsort(-sums, kind="stable")
        _heapq.heappush(heap, (-(float(sums[order[0]] - sums[order[-1]])), tie, sums[order], ids[order]))
        tie += 1
    _, _, _, ids = heap[0]
    label = np.full(next_id, -1, dtype=np.int64)
    live = ids >= 0
    label[ids[live]] = np.flatnonzero(live)
    for lo, hi in reversed(steps):  # children always have smaller ids than their parent
        label[left[lo:hi]] = label[lo:hi]
        label[right[lo:hi]] = label[lo:hi]
    out[:] = label[:n]
    return out


def test_karmarkar_karp_kernel_gives_every_item_the_python_heaps_part():
    """2,000 random instances (ties from coarse weights, m from 1 to 40, n from 0): the same part for every
    item as the Python version, through `kk.karmarkar_karp` (the door every policy uses)."""
    from hdp.packing.policies.kk import karmarkar_karp

    rng = np.random.default_rng(4)
    for t in range(2000):
        n, m = int(rng.integers(0, 200)), int(rng.integers(1, 40))
        w = np.round(rng.random(n) * rng.choice([3, 1000, 1e9])) if t % 5 else rng.random(n) * 1e6
        assert np.array_equal(karmarkar_karp(w, m), _kk_ref(w, m)), (t, n, m)
    with pytest.raises(ValueError, match="m=0"):
        karmarkar_karp(np.ones(3), 0)


def test_every_kernel_is_stamped_by_all_kernel_sources(tmp_path):
    """A kernel's cached machine code holds the helpers it calls from other files: every kernel's cache
    stamp is the digest of all kernel sources (an edit to any recompiles all), and that digest follows
    every file's name and contents."""
    from hdp.packing.kernels import jit
    from hdp.packing.policies.hdp import kernels

    stamped = [d for m in kernels.MODULES for d, _ in jit.kernels_of(m) if d._cache.cache_path is not None]
    assert len(stamped) == sum(len(jit.kernels_of(m)) for m in kernels.MODULES) >= 14
    for d in stamped:
        assert d._cache._impl.locator.get_source_stamp() == jit._sources_digest()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    first = jit._digest((tmp_path,))
    (tmp_path / "b.py").write_text("y = 3\n")
    assert jit._digest((tmp_path,)) != first
