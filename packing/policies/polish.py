"""Local search on a finished assignment: samples move or trade places to lower the round maxima.

The construction of the `hdp` policy balances columns (groups) per size class and lays them out
shelf by shelf, which leaves gaps a construction cannot see: a round of short multi-rank groups
under a roof set by its tallest group, a round whose roof is one column a little taller than the
rest.  `polish` takes the plan as columns (round, width, samples) and repeats the best of:

* **move**: a sample leaves a column at its round's roof for any column -- of any round and width,
  or a new group of its minimum size on ranks its round leaves free -- where it fits the token
  budget B and does not raise that round's roof.  A sample that joins a wider group is split over
  it (the group's exact cost, `CostModel.group_cost`); a group keeps the ranks its samples need;
* **trade**: when no sample of a roof column can move, one of them trades places with a shorter
  sample of another column (each split over its new group) whose round roof the trade does not
  raise;
* **widen**: a round's only roof column takes ranks its round leaves free, when that lowers the
  round's roof.

The best step drops the sum of round maxima the most, then costs the least rank-time, then
levels most (lowers sum(width * height**2)).  Every step lowers the sum of maxima, or keeps it and
lowers sum(width * height**2), so the search ends; it also stops after ``max_steps``.
Deterministic: ties go to the lowest indices.
"""

from __future__ import annotations

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.cost import max_rank_tokens, padded_length
from hdp.packing.policies.common import Assignment, allowed_sizes, left_starts

__all__ = ["polish"]

_TOL = 1e-9  # relative: a roof drop smaller than this is no drop
_TRADE_COLUMNS = 2  # trades look at the samples of the (this x N) columns with most room
_TRADE_MOVERS = 32  # ... for this many of the longest samples of the roof columns


class _Columns:
    """The plan as columns: round, width, member samples and the sums their cost needs."""

    def __init__(self, lengths: np.ndarray, a: Assignment, config: PlannerConfig, max_steps: int) -> None:
        N, cost = config.num_ranks, config.cost
        self.lengths, self.cost, self.N, self.B = lengths, cost, N, config.max_tokens_per_rank
        gid, col_of = np.unique(a.round_of * N + a.group_start, return_inverse=True)
        n_cols = gid.size
        self.n_rounds = int(gid.max() // N) + 1
        cap = n_cols + max_steps + self.n_rounds  # groups that moves open: one per step at most (a
        # batch of steps on disjoint rounds may pass max_steps by fewer than n_rounds)
        self.opened = n_cols
        self.col_of = col_of.astype(np.int64)
        self.rnd = np.zeros(cap, dtype=np.int64)
        self.rnd[:n_cols] = gid // N
        self.width = np.ones(cap, dtype=np.int64)
        self.width[col_of] = a.group_size
        self.alive = np.zeros(cap, dtype=bool)
        self.alive[:n_cols] = True
        self.tab = np.zeros((0, 4, lengths.size))  # [D, 4, n] per width: work, Lp, Lp**2, tokens
        self.widths: dict[int, int] = {}  # width -> row of ``tab``
        self.cw = np.zeros(cap, dtype=np.int64)  # row of every column's width
        for w in np.unique(a.group_size).tolist():
            self.row(w)
        self.cw[: n_cols] = [self.widths[int(w)] for w in self.width[:n_cols].tolist()]
        own = self.tab[self.cw[col_of], :, np.arange(lengths.size)]  # [n, 4]
        self.sw = np.bincount(col_of, weights=own[:, 0], minlength=cap)
        self.sl = np.bincount(col_of, weights=own[:, 1], minlength=cap)
        self.sq = np.bincount(col_of, weights=own[:, 2], minlength=cap)
        self.tok = np.bincount(col_of, weights=own[:, 3], minlength=cap)
        self.h = np.where(self.alive, cost.group_cost(self.sw, self.sl, self.sq, self.width), 0.0)
        self.free = N - np.bincount(self.rnd[:n_cols], weights=self.width[:n_cols],
                                    minlength=self.n_rounds).astype(np.int64)
        self.roof = np.zeros(self.n_rounds)
        np.maximum.at(self.roof, self.rnd[:n_cols], self.h[:n_cols])

    def row(self, w: int) -> int:
        """Row of ``tab`` for width w: every sample's padded work, length, length**2 and busiest-
        rank tokens on a w-rank group (added on first use)."""
        if w not in self.widths:
            lp = padded_length(self.lengths, w).astype(np.float64)
            tok = max_rank_tokens(self.lengths, w).astype(np.float64)
            self.tab = np.concatenate([self.tab, np.stack([self.cost.work(lp), lp, lp * lp, tok])[None]])
            self.widths[w] = self.tab.shape[0] - 1
        return self.widths[w]

    def others(self) -> np.ndarray:
        """[cap] the tallest other column of each column's round (second maximum at the roof)."""
        h = np.where(self.alive, self.h, -1.0)
        top = self.roof[self.rnd]
        at = self.alive & (h >= top * (1 - 1e-15))
        n_at = np.bincount(self.rnd[at], minlength=self.n_rounds)
        below = np.full(self.n_rounds, 0.0)
        lower = self.alive & ~at
        np.maximum.at(below, self.rnd[lower], h[lower])
        second = np.where(n_at >= 2, self.roof, below)  # a tie keeps the roof
        return second[self.rnd]

    def take(self, i: int, c: int, sign: float) -> None:
        """Add (sign=1) or remove (sign=-1) sample i to/from column c's sums."""
        v = self.tab[self.cw[c], :, i]
        self.sw[c] += sign * v[0]
        self.sl[c] += sign * v[1]
        self.sq[c] += sign * v[2]
        self.tok[c] += sign * v[3]

    def settle(self, cols: list[int]) -> None:
        """Recompute heights of ``cols`` (emptied ones close, freeing ranks) and their roofs."""
        for c in cols:
            if not np.any(self.col_of == c):
                if self.alive[c]:
                    self.alive[c] = False
                    self.free[self.rnd[c]] += self.width[c]
                self.h[c] = 0.0
            else:
                self.h[c] = float(self.cost.group_cost(self.sw[c], self.sl[c], self.sq[c], self.width[c]))
        for r in {int(self.rnd[c]) for c in cols}:
            sel = self.alive & (self.rnd == r)
            self.roof[r] = float(self.h[sel].max(initial=0.0))

    def assignment(self) -> Assignment:
        """Columns back to per-sample (round, group start, group size); wider groups left in a
        round (aligned power-of-two blocks stay aligned), empty rounds dropped."""
        cols = np.flatnonzero(self.alive)
        used = np.unique(self.rnd[cols])
        renum = np.zeros(self.n_rounds, dtype=np.int64)
        renum[used] = np.arange(used.size)
        start = np.zeros(self.rnd.size, dtype=np.int64)
        start[cols] = left_starts(self.rnd[cols], self.width[cols])
        assert int((start[cols] + self.width[cols]).max()) <= self.N
        return Assignment(
            round_of=renum[self.rnd[self.col_of]],
            group_start=start[self.col_of],
            group_size=self.width[self.col_of].copy(),
        )


def polish(
    lengths: np.ndarray, a: Assignment, config: PlannerConfig, k_min: np.ndarray, max_steps: int,
) -> Assignment:
    """Lower ``sum_r max column height`` of ``a`` by moves and trades (module docstring).

    ``k_min`` [n]: the fewest ranks each sample may run on (its budget minimum, or the power of
    two above it for power-of-two group shapes).  Returns ``a`` itself when nothing changed.
    """
    s = _Columns(lengths, a, config, max_steps)
    sizes = allowed_sizes(config.num_ranks, config.group_shape)
    steps = 0
    while steps < max_steps:
        at_roof = s.alive & (s.h >= s.roof[s.rnd] * (1 - _TOL))
        movers = np.flatnonzero(at_roof[s.col_of])  # [M] samples in roof columns
        if movers.size == 0:
            break
        others = s.others()
        found = (_best_move(s, movers, others, k_min) or _best_trade(s, movers, others, k_min)
                 or _widen(s, np.flatnonzero(at_roof), others, sizes))
        if not found:
            break
        for step in found:  # steps on disjoint rounds: each one's figures stay exact
            step()
        steps += len(found)
    return a if steps == 0 else s.assignment()


def _pick(
    d_roof: np.ndarray, added: np.ndarray, d_phi: np.ndarray, good: np.ndarray, scale: float,
    rounds: tuple[np.ndarray, np.ndarray],
) -> list[int]:
    """Flat indices of the best ``good`` steps that touch disjoint rounds, best first: most roof
    drop, least rank-time, most levelling, lowest index (roof and rank-time compared at relative
    tolerance).  ``rounds``: the (source, target) round of every step, shaped like ``good``."""
    g = np.flatnonzero(good.ravel())
    if g.size == 0:
        return []
    q = max(_TOL * scale, 1e-300)
    o = g[np.lexsort((g, d_phi.ravel()[g], np.round(added.ravel()[g] / q), np.round(d_roof.ravel()[g] / q)))]
    r_src = np.broadcast_to(rounds[0], good.shape).ravel()[o]
    r_tgt = np.broadcast_to(rounds[1], good.shape).ravel()[o]
    busy: set[int] = set()
    out: list[int] = []
    for j, a, b in zip(o.tolist(), r_src.tolist(), r_tgt.tolist()):
        if a in busy or b in busy:
            continue
        out.append(j)
        busy.update((a, b))
    return out


def _gather(s: _Columns, rows: np.ndarray, samples: np.ndarray) -> list[np.ndarray]:
    """(work, Lp, Lp**2, tokens) of each sample on the width of its table row ([K] each)."""
    return [s.tab[rows, q, samples] for q in range(4)]


def _outer(s: _Columns, rows: np.ndarray, samples: np.ndarray) -> list[np.ndarray]:
    """(work, Lp, Lp**2, tokens) of every sample on every row's width: [A, K] each for ``rows``
    [A] and ``samples`` [K] (a row gather: the table holds few widths)."""
    sub = s.tab[:, :, samples]  # [D, 4, K]
    return [sub[:, q, :][rows] for q in range(4)]


def _best_move(s: _Columns, movers: np.ndarray, others: np.ndarray, k_min: np.ndarray):
    """The best single-sample moves on disjoint rounds, as closures that apply them."""
    cost, B = s.cost, s.B
    src = s.col_of[movers]  # [M]
    w_s = s.width[src]
    own = _gather(s, s.cw[src], movers)  # [M] each
    left = s.sl[src] - own[1]
    h_src = np.where(left > 0, cost.group_cost(s.sw[src] - own[0], left, s.sq[src] - own[2], w_s), 0.0)
    r_src = s.rnd[src]
    # existing columns with room under their roof for the shortest mover (a sample of L tokens
    # adds work(L) to a single rank, at least a*L/w to every rank of a w-rank group), and the
    # movers' own rounds: [M, C] heights with the sample added (split over each column's width)
    cols = np.flatnonzero(s.alive)
    short = float(s.lengths[movers].min())
    need = np.where(s.width[cols] == 1, float(cost.work(short)), cost.linear_coef * short / s.width[cols])
    room = s.roof[s.rnd[cols]] - s.h[cols]
    cols = cols[(room >= need * (1 - 1e-9)) | np.isin(s.rnd[cols], r_src)]
    wc = s.width[cols][None, :]
    add = [v.T for v in _outer(s, s.cw[cols], movers)]  # [M, C] each
    h_new = cost.group_cost(s.sw[cols] + add[0], s.sl[cols] + add[1], s.sq[cols] + add[2], wc)
    t_new = s.tok[cols] + add[3]
    same = s.rnd[cols][None, :] == r_src[:, None]
    lim = np.where(same, s.h[src][:, None] * (1 - _TOL), s.roof[s.rnd[cols]][None, :])
    ok = (cols[None, :] != src[:, None]) & (wc >= k_min[movers][:, None]) & (t_new <= B) & (h_new <= lim)
    # a new group of k_min ranks on a round's free ranks: [M, R]
    k0 = k_min[movers]
    h0 = s.cost.sample_cost(s.lengths[movers], k0)
    rounds = np.arange(s.n_rounds)
    same_o = rounds[None, :] == r_src[:, None]
    lim_o = np.where(same_o, s.h[src][:, None] * (1 - _TOL), s.roof[None, :])
    fits = max_rank_tokens(s.lengths[movers], k0) <= B
    ok_o = (s.free[None, :] >= k0[:, None]) & (h0[:, None] <= lim_o) & fits[:, None]
    h_all = np.concatenate([h_new, np.broadcast_to(h0[:, None], ok_o.shape)], axis=1)  # [M, C+R]
    h_prev = np.concatenate([np.broadcast_to(s.h[cols][None, :], h_new.shape), np.zeros(ok_o.shape)], axis=1)
    w_all = np.concatenate([np.broadcast_to(wc, h_new.shape), np.broadcast_to(k0[:, None], ok_o.shape)], axis=1)
    same_all = np.concatenate([same, same_o], axis=1)
    ok_all = np.concatenate([ok, ok_o], axis=1)
    base = np.maximum(others[src], h_src)[:, None]
    roof_r = np.where(same_all, np.maximum(base, h_all), base)
    d_roof = roof_r - s.roof[r_src][:, None]
    added = w_all * (h_all - h_prev) - (w_s * (s.h[src] - h_src))[:, None]
    d_phi = (w_s * (h_src ** 2 - s.h[src] ** 2))[:, None] + w_all * (h_all ** 2 - h_prev ** 2)
    scale = float(s.roof.max())
    good = ok_all & ((d_roof < -_TOL * scale) | (d_phi < -_TOL * scale * scale))
    tgt_round = np.concatenate([s.rnd[cols], rounds])[None, :]
    picked = _pick(d_roof, added, d_phi, good, scale, (r_src[:, None], tgt_round))
    steps = []
    for j in picked:
        m, t = divmod(j, h_all.shape[1])

        def apply(i: int = int(movers[m]), c: int = int(src[m]), t: int = t, w0: int = int(k0[m])) -> None:
            if t < cols.size:
                tgt = int(cols[t])
            else:  # open a group on free ranks of round t - C
                tgt = s.opened
                s.opened += 1
                s.rnd[tgt], s.width[tgt], s.alive[tgt] = t - cols.size, w0, True
                s.cw[tgt] = s.row(w0)
                s.free[s.rnd[tgt]] -= w0
            s.take(i, c, -1.0)
            s.col_of[i] = tgt
            s.take(i, tgt, 1.0)
            s.settle([c, tgt])
        steps.append(apply)
    return steps


def _best_trade(s: _Columns, movers: np.ndarray, others: np.ndarray, k_min: np.ndarray):
    """The best trade of a roof sample i for a shorter sample j of another column (each takes
    the other's group, split over its width), on disjoint rounds, as closures that apply them."""
    if movers.size == 0:
        return []
    if movers.size > _TRADE_MOVERS:  # the longest samples of the roof columns
        movers = movers[np.lexsort((movers, -s.lengths[movers]))[:_TRADE_MOVERS]]
    cost, B = s.cost, s.B
    # [J] shorter samples in the columns with the most room under their round's roof
    cols = np.flatnonzero(s.alive)
    gap = s.roof[s.rnd[cols]] - s.h[cols]
    roomy = np.zeros(s.alive.size, dtype=bool)
    roomy[cols[np.argsort(-gap, kind="stable")[: _TRADE_COLUMNS * s.N]]] = True
    cand = np.flatnonzero(roomy[s.col_of] & (s.lengths < s.lengths[movers].max()))
    if cand.size == 0:
        return []
    c2 = s.col_of[cand]
    src = s.col_of[movers]  # [M]
    wc, wc2 = s.width[src][:, None], s.width[c2][None, :]
    i_c = _gather(s, s.cw[src], movers)  # i as it is, in c  [M]
    j_c2 = _gather(s, s.cw[c2], cand)  # j as it is, in c2  [J]
    j_c = _outer(s, s.cw[src], cand)  # j moved into c  [M, J]
    i_c2 = [v.T for v in _outer(s, s.cw[c2], movers)]  # i moved into c2  [M, J]
    col_c = (s.sw[src], s.sl[src], s.sq[src], s.tok[src])
    col_c2 = (s.sw[c2], s.sl[c2], s.sq[c2], s.tok[c2])
    new_c_s = [(col_c[q] - i_c[q])[:, None] + j_c[q] for q in range(4)]
    new_c2_s = [(col_c2[q] - j_c2[q])[None, :] + i_c2[q] for q in range(4)]
    new_c = cost.group_cost(new_c_s[0], new_c_s[1], new_c_s[2], wc)  # [M, J]
    new_c2 = cost.group_cost(new_c2_s[0], new_c2_s[1], new_c2_s[2], wc2)
    hc = s.h[src][:, None]
    same = s.rnd[c2][None, :] == s.rnd[src][:, None]
    lim = np.where(same, hc * (1 - _TOL), s.roof[s.rnd[c2]][None, :])
    ok = ((s.lengths[cand][None, :] < s.lengths[movers][:, None]) & (c2[None, :] != src[:, None])
          & (new_c < hc * (1 - _TOL)) & (new_c2 <= lim) & (new_c_s[3] <= B) & (new_c2_s[3] <= B)
          & (k_min[cand][None, :] <= wc) & (k_min[movers][:, None] <= wc2))
    base = np.maximum(others[src][:, None], new_c)
    d_roof = np.where(same, np.maximum(base, new_c2), base) - s.roof[s.rnd[src]][:, None]
    added = wc * (new_c - hc) + wc2 * (new_c2 - s.h[c2][None, :])
    d_phi = wc * (new_c ** 2 - hc ** 2) + wc2 * (new_c2 ** 2 - s.h[c2][None, :] ** 2)
    scale = float(s.roof.max())
    good = ok & ((d_roof < -_TOL * scale) | (d_phi < -_TOL * scale * scale))
    picked = _pick(d_roof, added, d_phi, good, scale, (s.rnd[src][:, None], s.rnd[c2][None, :]))
    steps = []
    for j in picked:
        m, t = divmod(j, cand.size)

        def apply(i: int = int(movers[m]), jj: int = int(cand[t]), c: int = int(src[m]), cc: int = int(c2[t])) -> None:
            s.take(i, c, -1.0)
            s.take(jj, cc, -1.0)
            s.col_of[i], s.col_of[jj] = cc, c
            s.take(i, cc, 1.0)
            s.take(jj, c, 1.0)
            s.settle([c, cc])
        steps.append(apply)
    return steps


def _widen(s: _Columns, roof_cols: np.ndarray, others: np.ndarray, sizes: np.ndarray):
    """A round's only roof column widened onto ranks its round leaves free, when that lowers the
    round's roof (the size giving the lowest roof, then the least rank-time); on disjoint rounds,
    as closures that apply them."""
    steps = []
    done: set[int] = set()
    for c in roof_cols.tolist():
        r, w = int(s.rnd[c]), int(s.width[c])
        if r in done or s.free[r] <= 0 or others[c] >= s.roof[r] * (1 - _TOL):
            continue
        members = np.flatnonzero(s.col_of == c)
        best = None
        for w2 in sizes[(sizes > w) & (sizes <= w + s.free[r])].tolist():
            row = s.row(w2)  # (may add a row to the table)
            v = s.tab[row][:, members].sum(axis=1)  # [4] the column's sums at width w2
            h2 = float(s.cost.group_cost(v[0], v[1], v[2], w2))
            top = max(float(others[c]), h2)
            if v[3] <= s.B and top < s.roof[r] * (1 - _TOL):
                key = (round(top / (_TOL * s.roof[r])), w2 * h2, w2)
                if best is None or key < best[0]:
                    best = (key, w2, v)
        if best is None:
            continue
        done.add(r)

        def apply(c: int = c, r: int = r, w: int = w, w2: int = best[1], v: np.ndarray = best[2]) -> None:
            s.width[c], s.cw[c] = w2, s.row(w2)
            s.sw[c], s.sl[c], s.sq[c], s.tok[c] = v
            s.free[r] -= w2 - w
            s.settle([c])
        steps.append(apply)
    return steps
