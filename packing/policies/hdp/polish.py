"""The polish pass: local search on a finished plan -- samples move or trade places to lower the
round maxima.

The construction balances columns (groups) per size class and lays them out shelf by shelf,
which leaves gaps a construction cannot see: a round of short multi-rank groups under a roof set
by its tallest group, a round whose roof is one column a little taller than the rest.  `polish`
repeats the best of:

* **move**: a sample leaves a column at its round's roof for another column -- of any round and
  width -- or a new group of its fewest ranks on ranks a round leaves free, where it fits the token
  budget B and does not raise that round's roof.  A sample that joins a wider group is split over
  it (the group's exact cost, `CostModel.group_cost`); a group keeps the ranks its samples need;
* **trade**: when no sample of a roof column can move, one of them trades places with a shorter
  sample of another column (each split over its new group) whose round roof the trade does not
  raise;
* **widen**: a round's only roof column takes ranks its round leaves free, when that lowers the
  round's roof.

Targets are the roomiest columns of every round (`_State.roomiest`: the few single-rank columns with the
most room under their round's roof -- a single-rank column's height is the sum of its samples'
work, so the roomiest fits every sample another one fits and levels best -- and the multi-rank
columns with the most room times width).  The best step lowers the step time the most (its
round's roof, and with PP stages the tallest round PP - 1 more times), then costs the least
rank-time, then levels most (lowers sum(width * height**2)).  Steps are taken together where their
figures stay exact (`_pick`): a round either gives (its roof column steps down) or receives (steps
from other rounds, each into another column under that round's roof), and no column changes twice
-- so several rounds can feed one roomy round at once.  Every step lowers the step time, or keeps
it and lowers sum(width * height**2), so the search ends, and it never makes a plan worse.

One evaluation is bounded work: a sort of the live columns (`_State.survey`), a scan of the samples,
and arrays of (sample, target) pairs; the per-width values of every sample are kept in a table up to
`_TABLE_SAMPLES` samples, so a pair costs a gather, not the padding arithmetic.

It is anytime: before each evaluation it checks the ``search`` pool of the budget -- every scored
(sample, target) pair costs one unit, every evaluation a fixed amount for its array operations, and
every step the scan of its samples and columns -- and stops when the pool (or the call's ``limit``)
would be overspent.
Deterministic: ties go to the lowest indices.
"""

from __future__ import annotations

import numpy as np

from hdp.packing.cost import max_rank_tokens, padded_float
from hdp.packing.policies.hdp.columns import Columns

__all__ = ["polish"]

_TOL = 1e-9  # relative: a roof drop smaller than this is no drop
_PATIENCE_MIN, _PATIENCE_DIV, _PROGRESS, _WINDOWS = 32, 256, 1e-4, 8
"""The search stops when a window of max(32, n / 256) steps, or of an eighth of the units it may
spend, lowered the sum of the round roofs by less than 0.01% (it has settled; large batches
otherwise spend the whole pool on levelling -- at 131,072 samples a step's bookkeeping alone is
7% of the default pool)."""
_TARGETS = 4  # moves go to the this many roomiest single-rank and multi-rank columns of every round
_SOURCES = 1  # moves take samples off the this many tallest columns of every round
_TRADE_COLUMNS = 8  # trades look at the samples of the this many roomiest columns of every round
_TRADE_MOVERS = 32  # ... for this many of the longest samples of the roof columns
_CALL_UNITS = 1_500  # fixed work of one evaluation (a few dozen array operations), in pairs
_TABLE_SAMPLES = 16_384  # batches up to this size keep every width's per-sample values in a table
_WORK, _LEN, _SQ, _TOK = range(4)  # the per-column sums: padded work, length, length**2, busiest-rank tokens


def _rank_in_runs(key: np.ndarray) -> np.ndarray:
    """Position of every element within its run of equal ``key`` values (``key`` sorted)."""
    idx = np.arange(key.size)
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    return idx - np.maximum.accumulate(np.where(first, idx, 0))


class _State:
    """The plan as columns: round, width, member count and the sums their cost needs; after
    `survey`, every round's roof and the order of its columns."""

    def __init__(self, cols: Columns, problem) -> None:
        c = cols.compact()
        lengths, N = problem.lengths, problem.num_ranks
        self.lengths, self.cost, self.N, self.B = lengths, problem.cost, N, problem.budget
        self.k_min = problem.k_min
        self.stages = problem.stages
        self.work1 = self.cost.work(lengths.astype(np.float64))  # [n] every sample on one rank
        n_cols = c.n_columns
        self.n_rounds = c.num_rounds
        cap = 2 * n_cols + self.n_rounds + 8  # grows when moves open more groups
        self.opened = n_cols
        self.col_of = c.col_of.copy()
        self.rnd = np.zeros(cap, dtype=np.int64)
        self.rnd[:n_cols] = c.round
        self.width = np.ones(cap, dtype=np.int64)
        self.width[:n_cols] = c.width
        self.alive = np.zeros(cap, dtype=bool)
        self.alive[:n_cols] = True
        self.row_of = np.full(N + 1, -1, dtype=np.int64)  # row of the table of every width (-1: none yet)
        self.tab = np.zeros((4, lengths.size if lengths.size <= _TABLE_SAMPLES else 0, 4))  # [rows, n, 4]
        own = self.vals(np.arange(lengths.size), c.width[self.col_of])  # [n, 4] every sample on its own group
        self.sums = np.stack([np.bincount(self.col_of, weights=own[:, q], minlength=cap) for q in range(4)], 1)
        self.count = np.bincount(self.col_of, minlength=cap)  # samples of every column
        self.h = np.where(self.alive, self._cost(self.sums, self.width), 0.0)
        self.free = N - np.bincount(self.rnd[:n_cols], weights=self.width[:n_cols],
                                    minlength=self.n_rounds).astype(np.int64)
        self.roof = np.zeros(self.n_rounds)
        self.second = np.zeros(self.n_rounds)
        self.at_roof = np.zeros(cap, dtype=bool)
        self.source = np.zeros(cap, dtype=bool)
        self.depth = np.zeros(cap, dtype=np.int64)
        self.below = np.zeros(cap)

    def _cost(self, sums: np.ndarray, width: np.ndarray) -> np.ndarray:
        """Per-rank cost of groups from their sums [..., 4] (`CostModel.group_cost`)."""
        return self.cost.group_cost(sums[..., _WORK], sums[..., _LEN], sums[..., _SQ], width)

    def grow(self) -> None:
        """Double the column capacity (moves open new groups)."""
        cap = self.rnd.size
        for name, fill in (("rnd", 0), ("width", 1), ("alive", False), ("h", 0.0), ("count", 0), ("at_roof", False),
                           ("source", False), ("depth", 0), ("below", 0.0)):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.full(cap, fill, dtype=a.dtype)]))
        self.sums = np.concatenate([self.sums, np.zeros_like(self.sums)])

    def rows(self, widths: np.ndarray) -> np.ndarray:
        """Table rows of ``widths`` (any shape), made on first use."""
        rows = self.row_of[widths]
        if np.any(rows < 0):
            for w in np.unique(np.asarray(widths)[rows < 0]).tolist():
                self._add_row(w)
            rows = self.row_of[widths]
        return rows

    def vals(self, samples: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """[..., 4] padded work, length, length**2 and busiest-rank tokens of ``samples`` on groups of
        ``widths`` (arrays broadcast together).  On batches of up to `_TABLE_SAMPLES` samples every
        width's values for the whole batch are kept in a table made on first use (a gather is
        cheaper than the arithmetic); on larger ones they are computed for the pairs asked."""
        widths = np.asarray(widths)
        if self.lengths.size <= _TABLE_SAMPLES:
            rows = self.rows(widths)  # (first: it may grow the table)
            return self.tab[rows, samples]
        L, w = np.broadcast_arrays(self.lengths[samples], widths)
        lp = padded_float(L, w)
        tok = max_rank_tokens(L.ravel(), w.ravel()).reshape(L.shape).astype(np.float64)
        return np.stack([self.cost.work(lp), lp, lp * lp, tok], axis=-1)

    def _add_row(self, w: int) -> None:
        """A row of the table: every sample's four values on a group of w ranks."""
        d = int((self.row_of >= 0).sum())
        if d == self.tab.shape[0]:  # full: double the rows (amortised O(1) per new width)
            self.tab = np.concatenate([self.tab, np.zeros_like(self.tab)])
        lp = padded_float(self.lengths, w)
        self.tab[d] = np.stack([self.cost.work(lp), lp, lp * lp, max_rank_tokens(self.lengths, w)], axis=-1)
        self.row_of[w] = d

    def survey(self, k_source: int = 1) -> None:
        """Every round's roof and second-tallest column (``roof``, ``second``), the columns at their
        round's roof (``at_roof``), the ``k_source`` tallest of every round and the roof columns
        (``source``), each column's place in its round, tallest first (``depth``), and the next
        lower column's height (``below``): one sort of the live columns, kept for `roomiest`."""
        live = np.flatnonzero(self.alive[: self.opened])
        r, h = self.rnd[live], self.h[live]
        order = np.lexsort((h, r))  # by round, then height (ties: column order)
        rs, hs = r[order], h[order]
        last = np.ones(order.size, dtype=bool)
        last[:-1] = rs[1:] != rs[:-1]  # the tallest column of every round
        ends = np.flatnonzero(last)
        self.roof[:] = 0.0
        self.roof[rs[ends]] = hs[ends]
        prev = np.maximum(ends - 1, 0)
        self.second[:] = 0.0
        has2 = (ends > 0) & (rs[prev] == rs[ends])
        self.second[rs[ends[has2]]] = hs[prev[has2]]
        self.at_roof[: self.opened] = False
        self.at_roof[live] = h >= self.roof[r] * (1 - _TOL)
        depth = _rank_in_runs(rs[::-1])[::-1]  # 0 for the tallest column of every round
        self.depth[live[order]] = depth
        below = np.zeros(order.size)
        below[1:] = np.where(rs[1:] == rs[:-1], hs[:-1], 0.0)  # the next lower column of the round
        self.below[live[order]] = below
        self.source[: self.opened] = self.at_roof[: self.opened]
        self.source[live[order[depth < k_source]]] = True
        self._sorted = (live, r, h, order)

    def roomiest(self, k: int) -> np.ndarray:
        """Columns worth moving to (after `survey`), ascending: in every round the ``k`` single-rank
        columns with the most room under the round's roof, and the ``k`` multi-rank ones with the most
        room times width (a sample split over w ranks adds about 1/w of its work to each)."""
        live, r, h, order = self._sorted
        w = self.width[live]
        single = order[w[order] == 1]  # ascending height: the roomiest first
        pick = [single[_rank_in_runs(r[single]) < k]]
        multi = np.flatnonzero(w > 1)
        if multi.size:
            gap = (self.roof[r[multi]] - h[multi]) * w[multi]
            mo = multi[np.lexsort((-gap, r[multi]))]
            pick.append(mo[_rank_in_runs(r[mo]) < k])
        return np.sort(live[np.concatenate(pick)])

    def others(self) -> np.ndarray:
        """[cap] the tallest other column of each roof column's round (its roof for the others)."""
        return np.where(self.at_roof, self.second[self.rnd], self.roof[self.rnd])

    def pipeline_gain(self, r: np.ndarray, new_roof: np.ndarray) -> np.ndarray:
        """(PP - 1) x the change of the tallest round when round ``r``'s roof becomes ``new_roof``
        (never above its roof): the pipeline term of the step time; 0 without PP."""
        if self.stages == 1 or self.n_rounds == 0:
            return 0.0
        top = int(np.argmax(self.roof))
        gmax = float(self.roof[top])
        second = float(np.delete(self.roof, top).max(initial=0.0))
        d = np.where(r == top, np.maximum(new_roof, second) - gmax, 0.0)
        return (self.stages - 1) * np.minimum(d, 0.0)

    def move(self, i: int, src: int, dst: int) -> None:
        """Sample i leaves column ``src`` for column ``dst`` (sums and counts)."""
        v = self.vals(np.array([i, i]), self.width[[src, dst]])  # [2, 4]
        self.sums[src] -= v[0]
        self.sums[dst] += v[1]
        self.count[src] -= 1
        self.count[dst] += 1
        self.col_of[i] = dst

    def open(self, r: int, w: int) -> int:
        """A new empty column of width w on free ranks of round r."""
        c = self.opened
        self.opened += 1
        self.rnd[c], self.width[c], self.alive[c] = r, w, True
        self.free[r] -= w
        return c

    def settle(self, cols: list[int]) -> None:
        """Recompute the heights of ``cols`` (emptied ones close, freeing ranks); roofs wait for the
        next `survey`."""
        c = np.asarray(cols, dtype=np.int64)
        empty = c[self.count[c] == 0]
        for e in empty[self.alive[empty]].tolist():
            self.alive[e] = False
            self.free[self.rnd[e]] += self.width[e]
        self.h[c] = np.where(self.count[c] > 0, self._cost(self.sums[c], self.width[c]), 0.0)

    def columns(self) -> Columns:
        """The state as `Columns`: wider groups left in a round (aligned power-of-two blocks stay
        aligned), empty columns and rounds dropped."""
        live = np.flatnonzero(self.alive)
        remap = np.full(self.alive.size, -1, dtype=np.int64)
        remap[live] = np.arange(live.size)
        return Columns.from_groups(remap[self.col_of], self.rnd[live], self.width[live]).compact()


class _Budget:
    """The search pool as one call of `polish` may spend it."""

    def __init__(self, meter, stop_at: int) -> None:
        self.meter, self.stop_at = meter, stop_at

    def take(self, units: int) -> bool:
        """Charge ``units`` when they fit; False (nothing charged) when they do not."""
        if self.meter.spent["search"] + units > self.stop_at:
            return False
        self.meter.charge("search", units)
        return True


def polish(cols: Columns, problem, *, limit: int | None = None) -> Columns:
    """The polish pass: lower the step time of ``cols`` (every sample planned) by moves, trades and
    widenings (module docstring) until no step helps, the ``search`` pool is spent, or ``limit``
    units are.  Never a higher step time than ``cols``."""
    assert cols.complete, "polish needs every sample planned"
    meter = problem.meter
    left = max(0, meter.left("search"))
    budget = _Budget(meter, meter.spent["search"] + (left if limit is None else min(left, limit)))
    if problem.n == 0 or not budget.take(problem.n // 4 + cols.n_columns):  # setting up the state
        return cols
    s = _State(cols, problem)
    steps = 0
    mark, stale, mark_units = None, 0, meter.spent["search"]
    patience = max(_PATIENCE_MIN, problem.n // _PATIENCE_DIV)
    # and a window of work: on huge batches a step's bookkeeping alone is a large part of the pool
    window = max(1, (budget.stop_at - meter.spent["search"]) // _WINDOWS)
    while budget.take(s.lengths.size // 8 + s.opened):  # the step's bookkeeping: roof samples, columns
        if s.opened + s.n_rounds + 1 >= s.alive.size:
            s.grow()
        s.survey(_SOURCES)
        if mark is None:
            mark = float(s.roof.sum())
        movers = np.flatnonzero(s.source[s.col_of])  # [M] samples in the tallest columns
        if movers.size == 0:
            break
        others = s.others()
        found = _best_move(s, movers, others, s.roomiest(_TARGETS), budget)
        if found is None:
            break
        if not found:
            found = _best_trade(s, movers[s.at_roof[s.col_of[movers]]], others, budget)
            if found is None:
                break
        if not found:
            found = _widen(s, np.flatnonzero(s.at_roof[: s.opened]), others, problem.sizes, budget)
        if not found:
            break
        for step in found:  # steps on rounds no other step lowers: each one's figures stay exact
            step()
        steps += len(found)
        stale += len(found)
        if stale > patience or meter.spent["search"] - mark_units > window:
            # a window of steps or of work: stop once the roofs barely came down over it
            s.survey()
            now = float(s.roof.sum())
            if now > mark * (1 - _PROGRESS):
                break
            mark, stale, mark_units = now, 0, meter.spent["search"]
    return cols if steps == 0 else problem.better(s.columns(), cols)


def _pick(d_obj: np.ndarray, added: np.ndarray, d_phi: np.ndarray, good: np.ndarray, scale: float,
          rounds: tuple[np.ndarray, np.ndarray], touched: tuple[np.ndarray, np.ndarray],
          depth: np.ndarray) -> list[int]:
    """Flat indices of the best ``good`` steps that can be taken together, best first: most drop of
    its column's round (the roof, or the column itself and the next lower one for a column below the
    roof), least rank-time, most levelling, lowest index (compared at relative tolerance).
    ``rounds``: the (source, target) round of every step; ``touched``: the two columns it changes
    (a new group counts as a column of its round); ``depth``: its source column's place in its round,
    tallest first; all shaped like ``good``.

    A round either gives (its tallest columns step down, one step each, in height order: a column
    steps only after every taller one of its round did) or receives (steps from other rounds, each
    into another column, none above the round's roof); no column changes twice.  So every step's
    own figures stay exact, a giving round's roof comes down, and no roof rises."""
    g = np.flatnonzero(good.ravel())
    if g.size == 0:
        return []
    q = max(_TOL * scale, 1e-300)
    o = g[np.lexsort((g, d_phi.ravel()[g], np.round(added.ravel()[g] / q), np.round(d_obj.ravel()[g] / q)))]
    shape = good.shape
    cols = [np.broadcast_to(t, shape).ravel()[o].tolist() for t in (*rounds, *touched, depth)]
    gives: dict[int, int] = {}  # giving round -> steps it took so far (the depth of its next column)
    receives: set[int] = set()
    changed: set[int] = set()
    out: list[int] = []
    for j, a, b, c1, c2, dep in zip(o.tolist(), *cols):
        if c1 in changed or c2 in changed or gives.get(a, 0) != dep or a in receives or (b != a and b in gives):
            continue
        out.append(j)
        gives[a] = dep + 1
        if b != a:
            receives.add(b)
        changed.update((c1, c2))
    return out


def _best_move(s: _State, movers: np.ndarray, others: np.ndarray, cols: np.ndarray, budget: _Budget):
    """The best single-sample moves that can be taken together (`_pick`), as closures that apply
    them: to one of the roomiest columns (``cols``, `_State.survey`), or to a new group of the
    sample's fewest ranks on a round's free ranks.  None when the budget does not cover the
    evaluation."""
    M, C, R = movers.size, cols.size, s.n_rounds
    if not budget.take(M * (C + R) + _CALL_UNITS):
        return None
    B, k_min = s.B, s.k_min
    src = s.col_of[movers]  # [M]
    r_src, w_s, h_s = s.rnd[src], s.width[src], s.h[src]
    rest = s.sums[src] - s.vals(movers, w_s)  # [M, 4] the source without the mover
    h_src = np.where(s.count[src] > 1, s._cost(rest, w_s), 0.0)  # [M] the source's new height
    # existing columns: [C, M] with the mover added, split over the column's width
    w_c = s.width[cols][:, None]
    grown = s.sums[cols][:, None, :] + s.vals(movers[None, :], w_c)  # [C, M, 4]
    h_new = s._cost(grown, w_c)
    r_c = s.rnd[cols][:, None]
    same = r_c == r_src
    lim = np.where(same, h_s * (1 - _TOL), s.roof[r_c])
    k0 = k_min[movers]
    ok = (grown[..., _TOK] <= B) & (h_new <= lim) & (w_c >= k0) & (cols[:, None] != src)
    h_prev = s.h[cols][:, None]
    tgt_col = cols[:, None]
    if int(s.free.max(initial=0)) >= int(k0.min()):  # a new group of k_min ranks on a round's free ranks: [R, M]
        h0 = s.cost.sample_cost(s.lengths[movers], k0)  # [M]
        rr = np.arange(R)[:, None]
        same_o = rr == r_src
        lim_o = np.where(same_o, h_s * (1 - _TOL), s.roof[:, None])
        ok_o = (s.free[:, None] >= k0) & (h0 <= lim_o) & (max_rank_tokens(s.lengths[movers], k0) <= B)
        h_new = np.concatenate([h_new, np.broadcast_to(h0, (R, M))])  # [C+R, M]
        h_prev = np.concatenate([h_prev, np.zeros((R, 1))])
        w_c = np.concatenate([np.broadcast_to(w_c, (C, M)), np.broadcast_to(k0, (R, M))])
        same = np.concatenate([same, same_o])
        ok = np.concatenate([ok, ok_o])
        r_c = np.concatenate([r_c, rr])
        tgt_col = np.concatenate([tgt_col, -1 - rr])  # a new group: "column" -1 - r
    base = np.maximum(s.below[src], h_src)  # [M] the source column and the next lower one of its round
    roof_r = np.where(same, np.maximum(base, h_new), base)
    d_obj = roof_r - h_s + np.where(s.depth[src] == 0, s.pipeline_gain(r_src, roof_r), 0.0)
    added = w_c * (h_new - h_prev) - w_s * (h_s - h_src)
    d_phi = w_s * (h_src ** 2 - h_s ** 2) + w_c * (h_new ** 2 - h_prev ** 2)
    scale = float(s.roof.max())
    good = ok & ((d_obj < -_TOL * scale) | (d_phi < -_TOL * scale * scale))
    steps = []
    for j in _pick(d_obj, added, d_phi, good, scale, (r_src[None, :], r_c), (src[None, :], tgt_col),
                   s.depth[src][None, :]):
        t, m = divmod(j, M)

        def apply(i: int = int(movers[m]), c: int = int(src[m]), t: int = t, w0: int = int(k0[m])) -> None:
            tgt = int(cols[t]) if t < C else s.open(t - C, w0)
            s.move(i, c, tgt)
            s.settle([c, tgt])
        steps.append(apply)
    return steps


def _best_trade(s: _State, movers: np.ndarray, others: np.ndarray, budget: _Budget):
    """The best trades of a roof sample i for a shorter sample j of another column (each takes
    the other's group, split over its width) that can be taken together (`_pick`), as closures
    that apply them; j from the roomiest columns of every round.  None when the budget does not
    cover the evaluation."""
    if movers.size > _TRADE_MOVERS:  # the longest samples of the roof columns
        movers = movers[np.lexsort((movers, -s.lengths[movers]))[:_TRADE_MOVERS]]
    roomy = np.zeros(s.alive.size, dtype=bool)
    roomy[s.roomiest(_TRADE_COLUMNS)] = True
    cand = np.flatnonzero(roomy[s.col_of] & (s.lengths < s.lengths[movers].max()))  # [J]
    if cand.size:
        # i takes j's place: j's column grows by about work(i) - work(j) (over its width), which must
        # stay within that column's room -- so j is no shorter than the shortest mover less that room
        work1 = s.work1
        c2 = s.col_of[cand]
        room = 2.0 * (s.roof[s.rnd[c2]] - s.h[c2]) * s.width[c2]
        cand = cand[work1[cand] >= work1[movers].min() - room]
    if cand.size == 0:
        return []
    if not budget.take(movers.size * cand.size + _CALL_UNITS):
        return None
    B, k_min = s.B, s.k_min
    src, c2 = s.col_of[movers], s.col_of[cand]  # [M], [J]
    w1, w2 = s.width[src], s.width[c2]
    # c loses i and gains j (on c's width); c2 loses j and gains i (on c2's width): [J, M, 4]
    new_c = (s.sums[src] - s.vals(movers, w1))[None, :, :] + s.vals(cand[:, None], w1[None, :])
    new_c2 = (s.sums[c2] - s.vals(cand, w2))[:, None, :] + s.vals(movers[None, :], w2[:, None])
    h_c = s._cost(new_c, w1)  # [J, M]
    h_c2 = s._cost(new_c2, w2[:, None])
    hc, hc2 = s.h[src], s.h[c2][:, None]
    same = s.rnd[c2][:, None] == s.rnd[src]
    lim = np.where(same, hc * (1 - _TOL), s.roof[s.rnd[c2]][:, None])
    ok = ((s.lengths[cand][:, None] < s.lengths[movers]) & (c2[:, None] != src)
          & (h_c < hc * (1 - _TOL)) & (h_c2 <= lim) & (new_c[..., _TOK] <= B) & (new_c2[..., _TOK] <= B)
          & (k_min[cand][:, None] <= w1) & (k_min[movers] <= w2[:, None]))
    base = np.maximum(s.below[src], h_c)
    roof_r = np.where(same, np.maximum(base, h_c2), base)
    d_obj = roof_r - hc + np.where(s.depth[src] == 0, s.pipeline_gain(s.rnd[src], roof_r), 0.0)
    added = w1 * (h_c - hc) + w2[:, None] * (h_c2 - hc2)
    d_phi = w1 * (h_c ** 2 - hc ** 2) + w2[:, None] * (h_c2 ** 2 - hc2 ** 2)
    scale = float(s.roof.max())
    good = ok & ((d_obj < -_TOL * scale) | (d_phi < -_TOL * scale * scale))
    steps = []
    for j in _pick(d_obj, added, d_phi, good, scale, (s.rnd[src][None, :], s.rnd[c2][:, None]),
                   (src[None, :], c2[:, None]), s.depth[src][None, :]):
        t, m = divmod(j, movers.size)

        def apply(i: int = int(movers[m]), jj: int = int(cand[t]), c: int = int(src[m]), cc: int = int(c2[t])) -> None:
            s.move(i, c, cc)
            s.move(jj, cc, c)
            s.settle([c, cc])
        steps.append(apply)
    return steps


def _widen(s: _State, roof_cols: np.ndarray, others: np.ndarray, sizes: np.ndarray, budget: _Budget):
    """A round's only roof column widened onto ranks its round leaves free, when that lowers the
    round's roof (the size giving the lowest roof, then the least rank-time); on disjoint rounds,
    as closures that apply them."""
    steps = []
    done: set[int] = set()
    for c in roof_cols.tolist():
        r, w = int(s.rnd[c]), int(s.width[c])
        if r in done or s.free[r] <= 0 or others[c] >= s.roof[r] * (1 - _TOL):
            continue
        wider = sizes[(sizes > w) & (sizes <= w + s.free[r])]
        if not budget.take(wider.size * int(s.count[c]) + s.lengths.size // 8 + _CALL_UNITS // 4):
            break
        members = np.flatnonzero(s.col_of == c)
        best = None
        for w2 in wider.tolist():
            v = s.vals(members, w2).sum(axis=0)  # [4] the column's sums at width w2
            h2 = float(s._cost(v, w2))
            top = max(float(others[c]), h2)
            if v[_TOK] <= s.B and top < s.roof[r] * (1 - _TOL):
                key = (round(top / (_TOL * s.roof[r])), w2 * h2, w2)
                if best is None or key < best[0]:
                    best = (key, w2, v)
        if best is None:
            continue
        done.add(r)

        def apply(c: int = c, r: int = r, w: int = w, w2: int = best[1], v: np.ndarray = best[2]) -> None:
            s.width[c] = w2
            s.sums[c] = v
            s.free[r] -= w2 - w
            s.settle([c])
        steps.append(apply)
    return steps
